"""KVFS on the real kernel, across users: files are private by default, a file
planted in /shared does not fool a stock program, a flood of empty files stops
at the inode quota, and one user holding KV pages cannot lock others out.
Each hostile LIP (tests/security/lips/hostile/kv_*.py) runs beside a well-behaved one
that must still answer; the kernel keeps running."""
import json
import re

import pytest

from conftest import ALICE_UID, BOB_UID, REPO, connect_as, requires_root, stop_kernels, stopped_cleanly

LIPS = REPO / "tests/security/lips"
HOSTILE = LIPS / "hostile"
HOST_PAGES = 64
KERNEL_FLAGS = ("--kv-memory-mb", "64", "--host-pages", str(HOST_PAGES))


@pytest.fixture(scope="module")
def kern(trust_kernels):
    """A kernel of its own (a clean /shared, no per-LIP quota, a small pool)
    with the default per-user quotas: KERNEL_FLAGS (conftest.trust_kernels
    starts it beside test_trust_limits.py's)."""
    k = trust_kernels["kvfs"]
    yield k
    stopped_cleanly({"kvfs": k}, stop_kernels({"kvfs": k}))


def spawn(client, path, *args):
    lip = client.spawn(path.read_text(), list(args), filename=path.name)
    return lip, client.events(timeout=120)


def rest(events) -> tuple[str, dict]:
    """The output of the remaining events and the exit event."""
    evs = list(events)
    assert evs and evs[-1]["event"] == "exit", evs[-3:]
    return "".join(str(e.get("data", "")) for e in evs[:-1]), evs[-1]


def alive(kern):
    assert kern.proc.poll() is None, "the kernel died"
    assert kern.client().stats()["lips"] == 0


@requires_root
def test_another_user_cannot_read_a_default_mode_file(kern):
    """The 04f0b73 attack: bob opens alice's file, forks it and has the model recite it."""
    alice = kern.client_as(ALICE_UID)
    owner, owner_events = spawn(alice, LIPS / "kv_owner.py", "secret.kv", "swordfish")
    assert next(owner_events) == {"event": "out", "data": "ready\n"}
    root = kern.client()
    st = root.kv_stat("/home/uid2101/secret.kv")
    assert (st["owner"], st["mode"]) == ("uid2101", 0o600) and st["length"] > 0
    assert root.kv_stat("/home/uid2101")["mode"] == 0o700

    bob = kern.client_as(BOB_UID)
    _, events = spawn(bob, HOSTILE / "kv_steal.py", "/home/uid2101/secret.kv")
    out, ex = rest(events)
    assert out.splitlines() == ["open refused: PermissionDenied", "list refused: PermissionDenied",
                                "plant refused: PermissionDenied"], out
    assert "swordfish" not in out and ex["reason"] == "finished"

    alice.send_input(owner, "still here")                  # the owner is unharmed
    assert next(owner_events) == {"event": "out", "data": "echo: still here\n"}
    alice.send_input(owner, None)
    assert rest(owner_events)[1]["reason"] == "finished"
    assert root.kv_stat("/home/uid2101/secret.kv")["length"] == st["length"]
    assert [e["name"] for e in root.kv_ls("/home/uid2101")] == ["secret.kv"]
    root.kv_rm("/home/uid2101/secret.kv")
    alive(kern)


QUESTION = "What is the capital of France?"


def parallel_answer(kern, user):
    r = kern.run(REPO / "userland/parallel.py", QUESTION, user=user)
    assert r.returncode == 0, r.stderr
    [line] = r.stdout.splitlines()
    return json.loads(line)["answer"], r.stderr


@requires_root
@pytest.mark.parametrize("mode", ["600", "644"])
def test_a_file_planted_in_shared_does_not_fool_a_stock_program(kern, mode):
    """mallory pre-creates /shared/parallel-sys.kv: unreadable (600) it used to make
    parallel.py fail, readable (644) it used to answer from mallory's KV."""
    mallory = kern.client(user="mallory")
    lip, events = spawn(mallory, HOSTILE / "kv_plant.py", "/shared/parallel-sys.kv", mode)
    assert next(events)["data"].startswith("planted /shared/parallel-sys.kv")
    answer, err = parallel_answer(kern, "alice")
    why = "is not readable" if mode == "600" else "owned by mallory"
    assert re.search(rf"parallel: .*/shared/parallel-sys.kv.*{why}", err), err
    st = kern.client().kv_stat("/shared/parallel-sys.kv")
    assert st["owner"] == "mallory"                         # left alone
    assert kern.client().kv_stat("/home/alice/parallel-sys.kv")["owner"] == "alice"   # the fallback
    mallory.send_input(lip, None)
    out, ex = rest(events)
    assert "removed" in out and ex["reason"] == "finished"

    # the reference: the same question once nothing is planted (alice's own shared file)
    ref, err = parallel_answer(kern, "alice")
    assert "parallel:" not in err, err
    assert kern.client().kv_stat("/shared/parallel-sys.kv")["owner"] == "alice"
    assert answer == ref and "Paris" in answer, (answer, ref)
    for p in ("/shared/parallel-sys.kv", "/home/alice/parallel-sys.kv"):
        kern.client().kv_rm(p)
    alive(kern)


@requires_root
def test_an_empty_file_flood_stops_at_the_inode_quota(kern):
    mallory = kern.client(user="mallory")
    _, events = spawn(mallory, HOSTILE / "kv_inode_flood.py", "85000")
    good = kern.run(HOSTILE / "well_behaved.py")               # beside the flood
    assert good.returncode == 0 and "Paris" in good.stdout, (good.stdout, good.stderr)
    out, ex = rest(events)
    # the flood directory is one inode: 9,999 files reach the default 10,000
    assert ("inode quota stopped me after 9999 files: user 'mallory' has 10000 named KV files and "
            "directories, inode quota 10000") in out, out[-500:]
    assert "cleaned up" in out and ex["reason"] == "finished"
    assert kern.client().kv_ls("/home/mallory") == []
    alive(kern)


@requires_root
def test_one_user_holding_pages_cannot_lock_out_another(kern):
    """Without a default per-user quota, one LIP took every page and the kernel
    refused every other user ("LIP not admitted: KV memory is short")."""
    alice = kern.client(user="alice")
    lip, events = spawn(alice, HOSTILE / "kv_hoard.py")
    msg = next(events)["data"]                              # alice holds all she can
    good = kern.run(HOSTILE / "well_behaved.py", user="bob")
    assert good.returncode == 0 and "Paris" in good.stdout, (msg, good.stdout, good.stderr)
    total = kern.client().stats()["kv_pages_total"] + HOST_PAGES
    quota = total // 2
    m = re.fullmatch(r"holding (\d+) tokens; stopped by QuotaExceeded: user 'alice' would hold (\d+) KV "
                     r"pages, quota (\d+) \(1 over\)\n", msg)
    assert m and int(m[1]) == 16 * quota and int(m[2]) == quota + 1 and int(m[3]) == quota, msg
    alice.send_input(lip, None)
    assert rest(events)[1]["reason"] == "finished"
    assert f"KV quotas: {quota} pages per user" in kern.read_log()
    alive(kern)


@requires_root
def test_only_root_is_the_kvfs_root_user(kern):
    """A KVFS user named root (which bypasses permissions and quotas) is only ever
    a Unix-root client: an ordinary uid cannot ask for it."""
    from symphony.client import Client, KernelError
    with Client(kern.socket, user="root", sock=connect_as(kern.socket, ALICE_UID)) as c:
        with pytest.raises(KernelError, match="only root may act as another user"):
            c.kv_ls("/home")


def test_kernel_quota_flags_parse_and_refuse_bad_values():
    import argparse

    from symphony.kernel_cli import _nonneg_int, _pages_or_percent, _umask
    assert _pages_or_percent("50%") == 0.5 and _pages_or_percent("1200") == 1200
    assert _umask("077") == 0o077 and _nonneg_int("0") == 0
    for f, bad in ((_pages_or_percent, "0%"), (_pages_or_percent, "101%"), (_pages_or_percent, "-3"),
                   (_pages_or_percent, "x%"), (_umask, "800"), (_umask, "1777"), (_nonneg_int, "-1")):
        with pytest.raises(argparse.ArgumentTypeError):
            f(bad)
