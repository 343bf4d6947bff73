"""No user's work can stall another's: the syscall thread, the capability pool,
spawns and the CPU are shared per user.

Alice's LIPs and clients attack with work that is legitimate one call at a
time: durable syncs of large files, listings of a large directory, thousands
of forks of a large file, back-to-back spawns, busy threads, slow granted HTTP
calls, a doorbell rung without calls.  Bob's well-behaved LIP is timed alone
and during each attack (tests/security/isolation.py): the same answer, within 3x + 1 s.
Attacks are scaled down to show the effect in a few seconds."""
import os
import threading
import time

import pytest

from conftest import ALICE_UID, BOB_UID, REPO, QuietHandler, http_servers, requires_root
from .isolation import end_all, check_neighbour, neighbour, rss_mib, start_kernel, wait_until

HOSTILE = REPO / "tests/security/lips/hostile"
BOUNDS = []
LONG = 1200                 # the neighbour's preds where an attack costs it CPU time rather than waits

pytestmark = requires_root


@pytest.fixture(scope="module")
def tk(tmp_path_factory):
    k = start_kernel(tmp_path_factory, "isotime", "--kv-memory-mb", "48", "--durable-dir", str(tmp_path_factory.mktemp("durable")),
                     "--max-lips", "64", "--max-lips-per-user", "16", *BOUNDS)
    yield k
    k.stop()
    assert k.proc.returncode == 0, k.read_log()[-3000:]
    assert k.shm_names() == []


def _spawn(client, name, *args, **kw):
    client.spawn((HOSTILE / f"{name}.py").read_text(), list(args), filename=f"{name}.py", **kw)
    return client.events(timeout=120)


def test_syncs_do_not_stall_others(tk):
    """A loop of f.sync() on large files held the syscall thread for each whole
    copy, hash, write and fsync."""
    alone = neighbour(tk)
    with tk.client_as(ALICE_UID, timeout=120) as a:
        events = _spawn(a, "iso_sync", "4", "4000")
        assert next(events)["data"] == "ready\n"
        time.sleep(0.5)
        check_neighbour(tk, alone, "sync")
    end_all(tk)


def test_large_listings_do_not_stall_others(tk):
    """32 connections listing a directory of 3,000 files, each listing built at once on the syscall thread."""
    alone = neighbour(tk)
    stop = threading.Event()
    with tk.client_as(ALICE_UID, timeout=120) as a:
        events = _spawn(a, "iso_dir", "3000")
        d = next(events)["data"].split()[1]
        conns = [tk.client_as(ALICE_UID, timeout=120) for _ in range(32)]

        def lister(c):
            while not stop.is_set():
                assert len(c.kv_ls(d)) == 3000
        threads = [threading.Thread(target=lister, args=(c,), daemon=True) for c in conns]
        for t in threads:
            t.start()
        time.sleep(0.5)
        try:
            check_neighbour(tk, alone, "listings")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            for c in conns:
                c.close()
    end_all(tk)


def test_forks_of_a_large_file_do_not_stall_others(tk):
    """3 LIPs each forking a 250-page file 4,000 times: each fork, and each publish of
    the kernel's counters, walked every handle and every page of every fork."""
    alone = neighbour(tk)
    rss0 = rss_mib(tk.proc.pid)
    clients = [tk.client_as(ALICE_UID, timeout=120) for _ in range(3)]
    try:
        streams = [_spawn(c, "iso_forks", "4000", "4000") for c in clients]
        time.sleep(1)
        check_neighbour(tk, alone, "forks")
        said = [next(s)["data"] for s in streams]
        print("forks:", said[0].strip(), f"kernel RSS +{rss_mib(tk.proc.pid) - rss0:.0f} MiB")
        check_neighbour(tk, alone, "forks held")
    finally:
        for c in clients:
            c.close()
    end_all(tk)


def test_a_spawn_flood_does_not_starve_others(tk):
    """12 connections spawning trivial LIPs back to back."""
    alone = neighbour(tk, n=LONG)
    stop = threading.Event()
    started = []
    conns = [tk.client_as(ALICE_UID, timeout=120) for _ in range(12)]

    def flood(c):
        while not stop.is_set():
            c.spawn("def main():\n    pass\n")
            for ev in c.events(timeout=120):
                pass
            started.append(1)
    threads = [threading.Thread(target=flood, args=(c,), daemon=True) for c in conns]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        check_neighbour(tk, alone, "spawns", n=LONG)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        for c in conns:
            c.close()
    print(f"spawns: {len(started)} LIPs ran")
    end_all(tk)


def test_busy_lips_do_not_take_the_cpu_from_the_model(tk):
    """6 LIPs with 2 threads of pure-Python busy work each: every LIP was its own
    scheduling group (setsid, autogroup) and the forward pass lost the CPU."""
    alone = neighbour(tk, n=LONG)
    clients = [tk.client_as(ALICE_UID, timeout=120) for _ in range(6)]
    try:
        for c in clients:
            _spawn(c, "iso_busy", "1")
        time.sleep(1)
        check_neighbour(tk, alone, "busy LIPs", n=LONG)
    finally:
        for c in clients:
            c.close()
    end_all(tk)


def _drive_bell(db, ring, rings_per_call: int, n: int = 320) -> int:
    """Ring ``ring``'s bell ``n`` times, posting a request with every
    ``rings_per_call``-th ring (which the kernel takes and answers); the wakes."""
    import struct
    from symphony.ipc import layout
    fd, wakes = os.dup(ring.bell_fd), 0
    try:
        for i in range(n):
            call = i % rings_per_call == rings_per_call - 1
            if call:
                ring._mm[layout.STATES_OFF:layout.STATES_OFF + 4] = struct.pack("<I", layout.REQUEST)
            os.eventfd_write(fd, 1)
            wakes += db.wait(0.002, ring.pending)
            for slot in ring.poll():
                ring.respond(slot, 0, 0, b"")
                ring._mm[layout.STATES_OFF:layout.STATES_OFF + 4] = struct.pack("<I", layout.FREE)
    finally:
        os.close(fd)
    return wakes


def test_a_bell_rung_more_often_than_its_calls_is_muted():
    """A bell rung 16 times a call was never muted: each call reset its count of
    rings without requests.  One rung once (or twice) a call never is."""
    from symphony.ipc.kernel_side import KernelSide
    from symphony.ipc.wait import WaitSet
    db = WaitSet(spin_us=0)
    db.MUTE_S = db.MUTE_MAX_S = 5.0                            # long mutes: the counts below are exact
    rings = [KernelSide.create(f"isobell{os.getpid()}x{i}", n_slots=2, slot_bytes=1024, arena_bytes=0,
                               waitset=db) for i in range(3)]
    try:
        honest = _drive_bell(db, rings[0], 1) + _drive_bell(db, rings[1], 2)
        assert db.mutes == 0 and honest >= 600, honest
        wakes = _drive_bell(db, rings[2], 16)
        assert db.mutes == 1 and wakes < 2 * db.MUTE_AFTER, wakes
    finally:
        for r in rings:
            r.close()
            r.unlink()
        db.close()


class _Slow(QuietHandler):
    def do_GET(self):
        time.sleep(12)
        self.reply(b"slow")


READER = '''
import time
from symphony.lip import read_file, send

def main(path):
    t0 = time.monotonic()
    data = read_file(path)
    send({"s": time.monotonic() - t0, "data": data})
'''


def _read_time(k, path, grants):
    with k.client_as(BOB_UID, timeout=60) as b:
        t0 = time.monotonic()
        b.spawn(READER, [path], grants=grants)
        out = [ev["data"] for ev in b.events(timeout=60) if ev["event"] == "out"]
    assert out and out[0]["data"] == "hello\n", out
    return time.monotonic() - t0


def test_slow_capability_calls_do_not_hold_the_pool(tk, public_tmp):
    """8 LIPs each with 2 slow granted HTTP calls took every capability worker:
    another user's read_file waited for them."""
    (public_tmp / "f.txt").write_text("hello\n")
    grants = {"read": [str(public_tmp)]}
    alone = _read_time(tk, str(public_tmp / "f.txt"), grants)
    with http_servers(_Slow, 1) as (port,):
        clients = [tk.client_as(ALICE_UID, timeout=120) for _ in range(8)]
        try:
            for c in clients:
                _spawn(c, "cap_http", f"http://127.0.0.1:{port}/", "2", "20",
                       grants={"http": [f"127.0.0.1:{port}"]})
            time.sleep(1)
            t = _read_time(tk, str(public_tmp / "f.txt"), grants)
        finally:
            for c in clients:
                c.close()
    print(f"capabilities: read_file {alone:.2f} s alone, {t:.2f} s beside the slow calls")
    assert t <= 3 * alone + 1, (t, alone)
    end_all(tk)
