"""The trust boundary between users: every LIP runs as a uid of its own,
cannot signal the kernel or anyone else's processes (not even through
fcntl(F_SETOWN)), sees no root-only path and none of the kernel's environment, finds
no other user's program in its memory, dies with the kernel, cannot disturb the
kernel's wake-ups through its doorbell and cannot start unbounded threads.

Each hostile program (tests/security/lips/hostile/id_*.py) runs as one user (a client
connected by a process of Unix uid ALICE_UID or BOB_UID) beside a well-behaved LIP
that must still answer "Paris"; the kernel must keep running."""
import os
import re
import secrets
import signal
import tempfile
import time

import pytest

from conftest import ALICE_UID, BOB_UID, REPO, SECRET_ENV, KernelProc, requires_root

HOSTILE = REPO / "tests/security/lips/hostile"
LIP_MAX_THREADS = 64            # the kernel's default threads limit (--lip-threads), RLIMIT_NPROC of the LIP's uid
LIP_UIDS = (61184, 65519)        # the kernel's default --lip-uids


def src(name: str) -> str:
    return (HOSTILE / f"{name}.py").read_text()


@pytest.fixture
def tkernel(kernel):
    """The session kernel: it was started with a secret (``kernel.secret``) in its environment."""
    return kernel


def collect(client, timeout=120) -> tuple[str, dict]:
    """All output of the client's attached LIP and its exit event."""
    out, last = [], {}
    for ev in client.events(timeout=timeout):
        if ev.get("event") in ("out", "stdout", "stderr"):
            out.append(ev.get("data", ""))
        last = ev
    return "".join(out), last


def neighbour_ok(k) -> None:
    good = k.run(HOSTILE / "well_behaved.py")
    assert good.returncode == 0 and "Paris" in good.stdout, (good.stdout, good.stderr)


def alive(k) -> None:
    assert k.proc.poll() is None, "the kernel died:\n" + k.read_log()[-2000:]
    assert k.client().stats()["instance"] == k.instance


def first_line(client, timeout=60) -> str:
    for ev in client.events(timeout=timeout):
        if ev.get("event") == "out":
            return ev["data"]
        if ev.get("event") == "exit":
            raise AssertionError(f"LIP exited early: {ev}")
    raise AssertionError("no output")


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# ---------------------------------------------------------------- identities
@requires_root
def test_each_lip_runs_as_a_uid_of_its_own(tkernel):
    alice, bob = tkernel.client_as(ALICE_UID), tkernel.client_as(BOB_UID)
    la = alice.spawn(src("id_whoami"), filename="id_whoami.py")
    lb = bob.spawn(src("id_whoami"), filename="id_whoami.py")
    lines = [first_line(alice), first_line(bob)]
    neighbour_ok(tkernel)
    ids = []
    for line in lines:
        m = re.fullmatch(r"uid=(\d+) euid=(\d+) gid=(\d+) groups=\[\] pid=(\d+)\n", line)
        assert m, line
        uid, euid, gid, _ = map(int, m.groups())
        assert uid == euid == gid, line
        assert uid not in (0, os.getuid(), ALICE_UID, BOB_UID), line
        assert LIP_UIDS[0] <= uid <= LIP_UIDS[1], line
        ids.append(uid)
    assert ids[0] != ids[1], "two live LIPs share a uid"
    ps = {p["lip"]: p for p in tkernel.client().ps()["lips"]}
    for lip in (la, lb):                                      # the worker's real credentials
        with open(f"/proc/{ps[lip]['pid']}/status") as f:
            uids = next(l for l in f if l.startswith("Uid:")).split()[1:]
        assert len(set(uids)) == 1 and int(uids[0]) in ids
    alice.send_input(la, "bye")
    bob.send_input(lb, "bye")
    assert collect(alice)[1]["reason"] == "finished"
    assert collect(bob)[1]["reason"] == "finished"
    alive(tkernel)


# ---------------------------------------------------------------- signals
def _sleeper_as(uid: int) -> int:
    """An unrelated process of Unix user ``uid`` (not a LIP): sleeps until killed."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            while True:
                time.sleep(1)
        finally:
            os._exit(0)
    return pid


@requires_root
def test_no_signals_to_the_kernel_or_other_users(tkernel):
    alice = tkernel.client_as(ALICE_UID)
    la = alice.spawn(src("id_whoami"), filename="id_whoami.py")
    first_line(alice)
    alice_lip_pid = {p["lip"]: p for p in tkernel.client().ps()["lips"]}[la]["pid"]
    other = _sleeper_as(ALICE_UID)
    try:
        bob = tkernel.client_as(BOB_UID)
        targets = {"kernel": tkernel.proc.pid, "alice_lip": alice_lip_pid, "alice_proc": other}
        bob.spawn(src("id_signals"), [f"{n}={p}" for n, p in targets.items()], filename="id_signals.py")
        out, ex = collect(bob)
        time.sleep(0.3)                                        # a signal, if any, has landed
        alive(tkernel)
        lines = out.splitlines()
        assert len(lines) == 12, out
        assert all(l.endswith(" refused") for l in lines), out
        for name, pid in targets.items():
            assert proc_state(pid) not in ("T", "t", "Z", "X"), (name, proc_state(pid))
        neighbour_ok(tkernel)
        alice.send_input(la, "bye")
        assert collect(alice)[1]["reason"] == "finished"      # alice's LIP was untouched
    finally:
        os.kill(other, signal.SIGKILL)
        os.waitpid(other, 0)


# ---------------------------------------------------------------- file system, environment
@requires_root
def test_root_only_paths_are_invisible(tkernel, tmp_path):
    d = tempfile.mkdtemp(prefix="symphony-rootonly-")
    try:
        os.chmod(d, 0o700)
        secret = os.path.join(d, "secret.txt")
        with open(secret, "w") as f:
            f.write("root only\n")
        os.symlink("/etc/hostname", os.path.join(d, "link"))
        bob = tkernel.client_as(BOB_UID)
        bob.spawn(src("id_files"), [secret, os.path.join(d, "link"), d, "/proc/1/cwd"],
                  filename="id_files.py")
        out, ex = collect(bob)
        lines = out.splitlines()
        assert len(lines) == 24, out
        assert all(l.endswith(" refused") for l in lines), out
        neighbour_ok(tkernel)
        alive(tkernel)
    finally:
        for n in ("secret.txt", "link"):
            os.unlink(os.path.join(d, n))
        os.rmdir(d)


@requires_root
def test_environment_is_clean(tkernel):
    bob = tkernel.client_as(BOB_UID)
    bob.spawn(src("id_environ"), filename="id_environ.py")
    out, ex = collect(bob)
    assert out.endswith("END\n") and ex["reason"] == "finished", out
    assert tkernel.secret not in out and SECRET_ENV not in out, out
    names = {l.split("=", 1)[0] for l in out.splitlines()[:-1]}
    assert names <= {"PATH", "LANG", "LC_ALL", "HOME", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                     "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONDONTWRITEBYTECODE",
                     "PYTHONPATH"}, names
    neighbour_ok(tkernel)


# ---------------------------------------------------------------- memory
@requires_root
def test_no_other_users_program_in_a_lips_memory(tkernel):
    """Alice runs LIPs whose argument (and source) hold a secret; bob's LIP, forked
    later from the same zygote, scans its own memory for it."""
    secret = "ALICE-SECRET-" + secrets.token_hex(16)
    alice = tkernel.client_as(ALICE_UID)
    pad = "# " + "x" * 100 + "\n"
    for size in (20, 60, 200):                       # messages of several sizes: several heap bins
        source = f"# {secret}\n" + pad * size + "def main(a):\n    pass\n"
        alice.spawn(source, [secret], filename="alice.py")
        assert collect(alice)[1]["reason"] == "finished"
    bob = tkernel.client_as(BOB_UID)
    bob.spawn(src("id_memscan"), ["ALICE-", "SECRET-"], filename="id_memscan.py")
    out, ex = collect(bob, timeout=300)
    assert ex["reason"] == "finished" and out.endswith("END\n"), (ex, out[-2000:])
    scanned = int(re.search(r"scanned (\d+) pages", out).group(1))
    assert scanned > 1000, out                        # it really looked
    assert secret not in out, "bob found alice's secret in his own memory"
    neighbour_ok(tkernel)


# ---------------------------------------------------------------- doorbell
def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])          # utime + stime


@requires_root
def test_doorbell_tampering_hurts_nobody(tkernel):
    t0 = time.monotonic()
    neighbour_ok(tkernel)
    alone = time.monotonic() - t0
    bob = tkernel.client_as(BOB_UID)
    lip = bob.spawn(src("id_doorbell"), filename="id_doorbell.py", limits={"timeout": 120})
    assert first_line(bob) == "saturated\n"
    time.sleep(0.5)
    hz = os.sysconf("SC_CLK_TCK")
    c0, w0 = _cpu_ticks(tkernel.proc.pid), time.monotonic()
    time.sleep(3.0)                                   # the kernel has nothing else to do
    busy = (_cpu_ticks(tkernel.proc.pid) - c0) / hz / (time.monotonic() - w0)
    assert busy < 0.25, f"the kernel used {busy:.0%} of a core while idle"
    t0 = time.monotonic()
    neighbour_ok(tkernel)                             # new spawns work, and answer in time
    beside = time.monotonic() - t0
    assert beside < 3 * alone + 5, (alone, beside)
    bob.kill(lip)
    assert "killed" in collect(bob)[1]["reason"]
    alive(tkernel)


# ---------------------------------------------------------------- threads
@requires_root
def test_thread_bomb_is_capped(tkernel):
    bob = tkernel.client_as(BOB_UID)
    bob.spawn(src("id_threads"), filename="id_threads.py")
    out, ex = collect(bob)
    m = re.fullmatch(r"threads (\d+) (\w+)\n", out)
    assert m, out
    n = int(m.group(1))
    assert m.group(2) == "RuntimeError" and n < LIP_MAX_THREADS, out
    neighbour_ok(tkernel)
    alive(tkernel)


# ---------------------------------------------------------------- the kernel dies
def _workers_of(zygote: int) -> list[int]:
    try:
        with open(f"/proc/{zygote}/task/{zygote}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _exists(pid: int) -> bool:
    try:
        return proc_state(pid) not in ("Z", "X")
    except OSError:
        return False


@requires_root
def test_workers_die_with_the_kernel(tmp_path):
    from modelfiles import write_tiny_gguf
    k = KernelProc(tmp_path, "--model", str(write_tiny_gguf(tmp_path)))     # no pred: any model will do
    pids, zygote = [], []
    try:
        alice, bob = k.client_as(ALICE_UID), k.client_as(BOB_UID)
        alice.spawn(src("id_whoami"), filename="id_whoami.py")
        bob.spawn(src("id_whoami"), filename="id_whoami.py")
        first_line(alice)
        first_line(bob)
        pids = [p["pid"] for p in k.client().ps()["lips"]]
        assert len(pids) == 2 and all(_exists(p) for p in pids)
        with open(f"/proc/{k.proc.pid}/task/{k.proc.pid}/children") as f:
            zygote = [int(p) for p in f.read().split() if set(_workers_of(int(p))) >= set(pids)]
        assert len(zygote) == 1
        os.kill(k.proc.pid, signal.SIGKILL)
        k.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_exists(p) for p in pids + zygote):
            time.sleep(0.05)
        left = [p for p in pids + zygote if _exists(p)]
        assert not left, f"processes outlived the kernel: {left}"
    finally:
        for p in pids + zygote:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        for n in k.shm_names():                        # a SIGKILLed kernel cannot clean up
            os.unlink(f"/dev/shm/{n}")
        k.stop()


# ---------------------------------------------------------------- a kernel that is not root
def test_a_kernel_without_root_serves_only_its_own_uid():
    """The decision a non-root kernel makes (starting one as another uid here is not
    possible: /root, where python lives, is 0700)."""
    from symphony.kernel.identity import IdentityError, UidPool, check_caller
    check_caller(1000, 1000, can_switch=False)
    with pytest.raises(IdentityError, match="cannot give a LIP an identity"):
        check_caller(1000, 1001, can_switch=False)
    with pytest.raises(IdentityError):
        check_caller(1000, 0, can_switch=False)
    check_caller(0, 1001, can_switch=True)
    pool = UidPool(can_switch=False)
    assert pool.allocate(1) is None and len(pool) == 0


def test_uid_pool():
    from symphony.kernel.identity import DEFAULT_RANGE, IdentityError, UidPool, parse_range
    assert DEFAULT_RANGE == LIP_UIDS
    assert parse_range("61184-65519") == (61184, 65519)
    for bad in ("0-10", "10-5", "abc", "5", "-1-3", "1-4294967295"):
        with pytest.raises(ValueError):
            parse_range(bad)
    import pwd
    taken = pwd.getpwnam("nobody").pw_uid if any(p.pw_name == "nobody" for p in pwd.getpwall()) else None
    if taken is not None and taken > 1:
        pool = UidPool(taken - 1, taken + 1, can_switch=True)
        got = [pool.allocate(i) for i in range(2)]
        assert taken not in got and len(set(got)) == 2      # a real account is skipped
        with pytest.raises(IdentityError, match="no free LIP uid"):
            pool.allocate(3)
        pool.release(0)
        assert pool.allocate(4) == got[0]
    pool = UidPool(70000, 70003, can_switch=True)
    a = [pool.allocate(i) for i in range(3)]
    assert len(set(a)) == 3 and pool.allocate(1) == a[1]   # idempotent per LIP
    pool.release(1)
    assert pool.allocate(9) == 70003                         # round robin: freed last
    assert pool.allocate(10) == a[1]


def test_kernel_rejects_a_bad_uid_range(capsys):
    from symphony.cli import kernel_main
    for bad in ("10-5", "0-100", "x"):
        with pytest.raises(SystemExit):
            kernel_main(["--lip-uids", bad])
        assert "--lip-uids" in capsys.readouterr().err
