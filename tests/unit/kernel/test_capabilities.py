"""Capabilities under policy, without a kernel: the policy and grant checks, file
reads as the submitting user, the http hop checks, and the pool's per-LIP share
and deadlines."""
import os
import threading
import time

import pytest

from conftest import ALICE_UID, BOB_UID, QuietHandler, http_servers, requires_root
from symphony.kernel.capabilities import CapError, CapPolicy, CapPool, Identity, files, http as caphttp
from symphony.kernel.capabilities.http import _names_internal
from symphony.kernel.capabilities.policy import parse_host

MB = 1 << 20
ALICE, BOB = Identity(ALICE_UID, ALICE_UID, ()), Identity(BOB_UID, BOB_UID, ())
ME = Identity(os.geteuid(), os.getegid(), tuple(os.getgroups()))      # the test (kernel) user


@pytest.fixture
def pol():
    return CapPolicy.build()


def read(pol, who, grants, path, **kw):
    return files.read_file(pol, who, {"read": grants}, {"path": str(path), **kw}, MB)


def err_type(fn):
    with pytest.raises(CapError) as e:
        fn()
    return e.value.type


# ---------------------------------------------------------------- policy
def test_policy_denies_builtins_and_the_kernels_own_paths(tmp_path):
    sockdir = tmp_path / "run"
    sockdir.mkdir()
    p = CapPolicy.build(kernel_dirs=[str(tmp_path / "durable")], socket_path=str(sockdir / "k.sock"))
    for d in ("/proc", "/sys", "/dev", "/dev/shm", "/run", str(tmp_path / "durable"), str(sockdir)):
        assert p.denied(d), d
    assert p.denied("/proc/1/environ") == "/proc"
    assert p.denied(str(tmp_path)) is None
    # a socket in a shared sticky directory: only the socket itself is denied, not /tmp
    p = CapPolicy.build(socket_path="/tmp/symphony-x.sock")
    assert p.denied("/tmp/symphony-x.sock") and p.denied("/tmp") is None
    assert p.denied("/tmp/symphony-tok-abc.json")          # the kernel's tokenizer file


def test_policy_flags_are_validated():
    with pytest.raises(ValueError, match="absolute"):
        CapPolicy.build(allow_read=["relative/dir"])
    with pytest.raises(ValueError, match="--cap-share"):
        CapPolicy.build(per_lip=0)
    with pytest.raises(ValueError, match="--cap-timeout"):
        CapPolicy.build(timeout_s=0)
    with pytest.raises(ValueError, match="--allow-http"):
        CapPolicy.build(allow_http=["http://x/"])
    assert CapPolicy.build(allow_read=["none"]).allow_read == ()
    assert CapPolicy.build(allow_http=["none"]).allow_http == ()


def test_grants_are_checked_against_the_policy(tmp_path):
    p = CapPolicy.build(allow_read=[str(tmp_path)], allow_http=["example.com", "*.corp.test", "10.0.0.1:80"])
    (tmp_path / "d").mkdir()
    g = p.check_grants({"read": [str(tmp_path / "d")], "http": ["example.com:8080", "a.corp.test", "10.0.0.1:80"]},
                       ME)
    assert g == {"read": [str(tmp_path / "d")], "http": ["example.com:8080", "a.corp.test", "10.0.0.1:80"]}
    for grants, match in (({"read": ["/etc"]}, "outside the kernel's allowed roots"),
                          ({"http": ["evil.test"]}, "not allowed by the kernel's policy"),
                          ({"http": ["10.0.0.1:81"]}, "not allowed")):
        with pytest.raises(PermissionError, match=match):
            p.check_grants(grants, ME)
    anywhere = CapPolicy.build()
    for d in ("/proc", "/dev/shm", "/sys/kernel", "/run"):
        with pytest.raises(PermissionError, match="forbidden by the kernel's policy"):
            anywhere.check_grants({"read": [d]}, ME)
    for bad, match in (({"read": ["rel"]}, "absolute"), ({"read": [str(tmp_path / "nope")]}, "not a directory"),
                       ({"exec": []}, "grants must be"), ({"http": "x"}, "grants must be"),
                       ({"http": ["a b"]}, "bad http grant"), ({"http": ["*.corp.test"]}, "not a pattern"), ({"read": ["/"] * 65}, "at most")):
        with pytest.raises(ValueError, match=match):
            anywhere.check_grants(bad, ME)
    assert anywhere.check_grants(None, ME) == {"http": [], "read": []}


def test_parse_host():
    assert str(parse_host("[::1]:8080")) == "[::1]:8080"
    assert parse_host("Example.COM").host == "example.com"
    for bad in ("a/b", "x:0", "x:99999", "u@h", "http://h", "", "h?q"):
        with pytest.raises(ValueError):
            parse_host(bad)


# ---------------------------------------------------------------- files
def test_read_and_list_inside_a_grant(pol, tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    (d / "a.txt").write_text("hello")
    (d / "sub").mkdir()
    (tmp_path / "outside.txt").write_text("secret")
    assert read(pol, ME, [str(d)], d / "a.txt") == {"data": "hello"}
    assert read(pol, ME, [str(d)], d / "a.txt", max_bytes=2) == {"data": "he"}
    assert files.list_dir(pol, ME, {"read": [str(d)]}, {"path": str(d)}) == {"entries": ["a.txt", "sub/"]}
    assert err_type(lambda: read(pol, ME, [str(d)], f"{d}/../outside.txt")) == "PermissionDenied"
    assert err_type(lambda: read(pol, ME, [str(d)], d / "sub")) == "IsADirectory"
    assert err_type(lambda: read(pol, ME, [str(d)], d / "missing")) == "NotFound"
    assert err_type(lambda: read(pol, ME, [], d / "a.txt")) == "PermissionDenied"
    for bad in (0, -1, MB + 1, "10", True):
        assert err_type(lambda: read(pol, ME, [str(d)], d / "a.txt", max_bytes=bad)) == "InvalidArgument"
    assert err_type(lambda: read(pol, ME, [str(d)], "a.txt")) == "InvalidArgument"


def test_symlinks_cannot_leave_the_grant_or_reach_a_denied_path(pol, tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    (tmp_path / "outside.txt").write_text("secret")
    (d / "out").symlink_to(tmp_path / "outside.txt")
    (d / "null").symlink_to("/dev/null")
    (d / "in").symlink_to(d / "real.txt")
    (d / "real.txt").write_text("fine")
    assert err_type(lambda: read(pol, ME, [str(d)], d / "out")) == "PermissionDenied"
    assert read(pol, ME, [str(d)], d / "in") == {"data": "fine"}
    with pytest.raises(CapError, match="forbidden by the kernel's policy"):
        read(pol, ME, ["/"], d / "null")
    with pytest.raises(CapError, match="forbidden"):
        read(pol, ME, ["/"], f"/proc/{os.getpid()}/environ")


def test_fifo_socket_and_device_refused_at_once(pol, tmp_path):
    import socket
    d = tmp_path / "g"
    d.mkdir()
    os.mkfifo(d / "fifo")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "sock"))
    t0 = time.monotonic()
    with pytest.raises(CapError, match="is a FIFO"):
        read(pol, ME, [str(d)], d / "fifo")          # on 04f0b73 this open() blocked forever
    with pytest.raises(CapError, match="is a socket"):
        read(pol, ME, [str(d)], d / "sock")
    assert time.monotonic() - t0 < 1
    s.close()
    lenient = CapPolicy.build(deny_read=[])                 # even a policy that forgot /dev: no devices
    object.__setattr__(lenient, "deny_read", ())
    with pytest.raises(CapError, match="character device"):
        read(lenient, ME, ["/dev"], "/dev/null")


@requires_root
def test_files_are_read_with_the_submitting_users_permissions(pol):
    import shutil
    import tempfile
    from pathlib import Path
    top = Path(tempfile.mkdtemp(prefix="symphony-caps-", dir="/tmp"))   # searchable by every user
    try:
        _read_as_users(pol, top)
    finally:
        shutil.rmtree(top)


def _read_as_users(pol, top):
    os.chmod(top, 0o755)
    d = top / "g"
    d.mkdir(mode=0o755)
    f = d / "alice.txt"
    f.write_text("alice's notes")
    os.chown(f, ALICE_UID, ALICE_UID)
    os.chmod(f, 0o600)
    assert read(pol, ALICE, [str(d)], f) == {"data": "alice's notes"}
    with pytest.raises(CapError, match="permission denied") as e:
        read(pol, BOB, [str(d)], f)
    assert e.value.type == "PermissionDenied"
    hidden = d / "private"
    hidden.mkdir(mode=0o700)
    (hidden / "x").write_text("x")
    assert err_type(lambda: read(pol, BOB, [str(d)], hidden / "x")) == "PermissionDenied"
    assert err_type(lambda: files.list_dir(pol, BOB, {"read": [str(d)]}, {"path": str(hidden)})) == "PermissionDenied"
    assert read(pol, ME, [str(d)], hidden / "x") == {"data": "x"}
    # the thread's credentials are back: it reads as root again, and so does every other thread
    assert open(f).read() == "alice's notes"
    status = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
    assert "\nUid:\t0\t0\t0\t0\n" in status and "\nGid:\t0\t0\t0\t0\n" in status
    # and a grant the user cannot reach is refused at spawn
    with pytest.raises(ValueError, match="not a directory you can reach"):
        pol.check_grants({"read": [str(hidden)]}, BOB)
    assert pol.check_grants({"read": [str(hidden)]}, Identity(0, 0, ()))["read"] == [str(hidden)]


def test_credentials_switch_only_the_calling_thread(pol):
    if os.geteuid() != 0:
        pytest.skip("needs root: a non-root kernel reads as itself")
    seen = {}
    inside, release = threading.Event(), threading.Event()

    def worker():
        with pol.creds.as_user(BOB):
            seen["worker"] = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
            inside.set()
            release.wait(5)
    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    main = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
    release.set()
    t.join()
    fs_uid = lambda s: [l for l in s.splitlines() if l.startswith("Uid:")][0].split()[4]
    assert fs_uid(seen["worker"]) == str(BOB_UID) and fs_uid(main) == "0"


# ---------------------------------------------------------------- pool
def _collect():
    box, ev = [], threading.Event()

    def done(res, err):
        box.append((res, err, time.monotonic()))
        ev.set()
    return box, ev, done


def test_pool_gives_each_lip_a_share():
    pool = CapPool(workers=4, per_lip=2)
    started = []
    lock = threading.Lock()

    def slow(tag):
        def fn(ctx):
            with lock:
                started.append(tag)
            time.sleep(0.4)
            return {"tag": tag}
        return fn
    box, _, done = _collect()
    t0 = time.monotonic()
    for i in range(8):
        pool.submit(1, slow(f"a{i}"), done, 10)
    ev = threading.Event()
    got = []
    pool.submit(2, lambda ctx: {"tag": "b"}, lambda r, e: (got.append(time.monotonic() - t0), ev.set()), 10)
    assert ev.wait(5)
    assert got[0] < 0.3, got                      # not behind the flood: LIP 1 holds only 2 workers
    deadline = time.time() + 10
    while len(box) < 8 and time.time() < deadline:
        time.sleep(0.05)
    assert sorted(r["tag"] for r, e, _ in box) == [f"a{i}" for i in range(8)]   # all served, none refused
    assert started[:2] == ["a0", "a1"]             # FIFO within a LIP
    pool.close()


def test_pool_round_robin_between_lips():
    pool = CapPool(workers=1, per_lip=1)
    order = []
    gate = threading.Event()
    pool.submit(9, lambda ctx: gate.wait(5) and {}, lambda r, e: None, 10)
    time.sleep(0.1)
    for owner in (1, 1, 1, 2, 2, 3):
        pool.submit(owner, lambda ctx, o=owner: order.append(o) or {}, lambda r, e: None, 10)
    gate.set()
    deadline = time.time() + 5
    while len(order) < 6 and time.time() < deadline:
        time.sleep(0.02)
    assert order == [1, 2, 3, 1, 2, 1]
    pool.close()


def test_pool_times_out_a_stuck_call_and_keeps_serving():
    pool = CapPool(workers=1, per_lip=2, grace_s=0.1)
    stuck = threading.Event()
    cancelled = threading.Event()

    def hang(ctx):
        ctx.on_cancel(cancelled.set)
        stuck.wait(10)
        return {"late": True}
    box, ev, done = _collect()
    t0 = time.monotonic()
    pool.submit(1, hang, done, timeout=0.3)
    assert ev.wait(3)
    res, err, t = box[0]
    assert res is None and isinstance(err, CapError) and err.type == "TimedOut", box
    assert 0.3 <= t - t0 < 1.5 and cancelled.is_set()
    ev2 = threading.Event()
    pool.submit(2, lambda ctx: {"ok": 1}, lambda r, e: ev2.set(), 5)   # a replacement thread serves it
    assert ev2.wait(2)
    assert pool.stats()["stuck"] == 1
    stuck.set()                                    # the stuck call comes back: answered once only
    time.sleep(0.3)
    assert len(box) == 1 and pool.stats()["stuck"] == 0 and pool.stats()["threads"] == 1
    pool.close()


def test_pool_drops_calls_of_a_gone_lip():
    pool = CapPool(workers=1, per_lip=1)
    gate = threading.Event()
    pool.submit(1, lambda ctx: gate.wait(5) and {}, lambda r, e: None, 10)
    ran = []
    alive = [True]
    for _ in range(3):
        pool.submit(2, lambda ctx: ran.append(1) or {}, lambda r, e: None, 10, alive=lambda: alive[0])
    pool.submit(3, lambda ctx: ran.append(3) or {}, lambda r, e: None, 10)
    pool.submit(3, lambda ctx: ran.append(3) or {}, lambda r, e: None, 10)
    assert pool.drop(3) == 2
    alive[0] = False
    gate.set()
    time.sleep(0.3)
    assert ran == [] and pool.stats()["queued"] == 0
    pool.close()


# ---------------------------------------------------------------- http
class _Ctx:
    def __init__(self, seconds):
        self.deadline = time.monotonic() + seconds

    def on_cancel(self, hook):
        pass


@pytest.fixture
def server():
    """A local server: /ok, /slow (3 s), /big (2 MiB), /to/<port> (302 to that port),
    /loop (redirects to itself)."""
    class H(QuietHandler):
        def do_GET(self):
            if self.path.startswith("/to/"):
                return self.redirect(f"http://127.0.0.1:{self.path[4:]}/ok")
            if self.path == "/loop":
                return self.redirect("/loop")
            if self.path == "/slow":
                time.sleep(3)
            self.reply(b"x" * (2 * MB) if self.path == "/big" else f"hi from {self.server.server_port}".encode())
    with http_servers(H) as ports:
        yield ports


def get(grants, url, seconds=5.0):
    return caphttp.request(grants, url, "GET", None, {}, _Ctx(seconds), MB)


def test_http_checks_every_hop(server):
    a, b = server
    assert get([f"127.0.0.1:{a}"], f"http://127.0.0.1:{a}/ok")["body"] == f"hi from {a}"
    with pytest.raises(CapError, match=f"HTTP to 127.0.0.1:{b} is not granted") as e:
        get([f"127.0.0.1:{a}"], f"http://127.0.0.1:{a}/to/{b}")     # 04f0b73 followed this redirect
    assert e.value.type == "PermissionDenied"
    r = get([f"127.0.0.1:{a}", f"127.0.0.1:{b}"], f"http://127.0.0.1:{a}/to/{b}")
    assert r["body"] == f"hi from {b}" and r["url"] == f"http://127.0.0.1:{b}/ok"
    with pytest.raises(CapError, match="redirects"):
        get([f"127.0.0.1:{a}"], f"http://127.0.0.1:{a}/loop")
    with pytest.raises(CapError, match="not granted"):
        get([f"127.0.0.1:{b}"], f"http://127.0.0.1:{a}/ok")
    with pytest.raises(CapError, match="bad URL"):
        get([f"127.0.0.1:{a}"], f"ftp://127.0.0.1:{a}/ok")


def test_http_deadline_and_size_cap(server):
    a, _ = server
    t0 = time.monotonic()
    with pytest.raises(CapError) as e:
        get([f"127.0.0.1:{a}"], f"http://127.0.0.1:{a}/slow", seconds=0.5)
    assert e.value.type == "TimedOut" and time.monotonic() - t0 < 2
    assert len(get([f"127.0.0.1:{a}"], f"http://127.0.0.1:{a}/big")["body"]) == MB


def test_http_internal_addresses_need_the_address_granted():
    lo = parse_host("127.0.0.1:80")
    import ipaddress
    ip = ipaddress.ip_address("127.0.0.1")
    assert _names_internal([lo], "127.0.0.1", ip, 80)
    assert not _names_internal([parse_host("evil.test")], "evil.test", ip, 80)       # a name that resolves inside
    assert _names_internal([parse_host("localhost")], "localhost", ip, 80)
    # a granted name (not "localhost") that resolves to an internal address is refused before connecting
    import socket
    name = socket.gethostname().lower()
    try:
        addr = ipaddress.ip_address(socket.getaddrinfo(name, 80)[0][4][0])
    except OSError:
        pytest.skip(f"this machine's name {name!r} does not resolve")
    if addr.is_global:
        pytest.skip(f"this machine's name resolves to the public address {addr}")
    with pytest.raises(CapError, match="internal address"):
        caphttp._resolve([parse_host(name)], name, 80, time.monotonic() + 5)


def test_http_arguments_are_validated():
    for b, match in (({"url": 5}, "url"), ({"url": "http://x/", "method": "TRACE"}, "method"),
                     ({"url": "http://x/", "timeout": 0}, "timeout"), ({"url": "http://x/", "timeout": 61}, "timeout"),
                     ({"url": "http://x/", "headers": {"Host": "y"}}, "set by the kernel"),
                     ({"url": "http://x/", "headers": {"a": "b\r\nc: d"}}, "bad header"),
                     ({"url": "http://x/", "body": 5}, "body")):
        with pytest.raises(CapError, match=match):
            caphttp.check_args(b, 60, MB)


def test_kernel_flags_are_checked_before_the_model_loads(capsys):
    from symphony.cli import kernel_main
    for argv, match in ((["--cap-share", "0"], "--cap-share"), (["--allow-read", "rel"], "absolute"),
                        (["--allow-http", "a/b"], "--allow-http entry"), (["--cap-timeout", "0"], "--cap-timeout")):
        with pytest.raises(SystemExit) as e:
            kernel_main(argv)
        assert e.value.code == 2
        assert match in capsys.readouterr().err
