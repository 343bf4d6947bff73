"""The shared-memory system-call ring (symphony/ipc/: layout, wait, kernel_side, lip_side)."""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import struct
import threading
import time

import numpy as np
import orjson
import posix_ipc
import pytest

from symphony.ipc import layout as shm
from symphony.ipc.abi import ARENA_F32
from symphony.ipc.kernel_side import KernelSide
from symphony.ipc.layout import BUSY, FREE, REQUEST, RESPONSE, RingClosed, RingError
from symphony.ipc.lip_side import LipSide
from symphony.ipc.wait import WaitSet

EINVAL = -22


def _prefix() -> str:
    return "symtest" + secrets.token_hex(4)


def _dev_shm(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if prefix in n)


def serve_once(k: KernelSide, slot: int) -> None:
    """The echo kernel: json back, tokens back as a float32 arena row (x 0.5)."""
    try:
        req = k.read_request(slot)
    except RingError as e:
        k.respond(slot, 0, EINVAL, orjson.dumps({"error": str(e)}))
        return
    if req.tokens.size:
        a = k.arena(slot, 1, req.tokens.size)
        a[0] = req.tokens.astype(np.float32) * 0.5
        k.respond(slot, req.call_id, req.op, req.json, ARENA_F32, 1, req.tokens.size)
    else:
        k.respond(slot, req.call_id, req.op, req.json)


class KernelThread:
    """A tiny kernel loop in a thread: wait on the doorbell, poll, echo."""

    def __init__(self, k: KernelSide, db: WaitSet, serve=serve_once):
        self.k, self.db, self.serve = k, db, serve
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            while not self.stop.is_set():
                self.db.wait(0.05, self.k.pending)
                for s in self.k.poll():
                    self.serve(self.k, s)
        except BaseException as e:   # pragma: no cover - reported by the test
            self.errors.append(e)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(5)
        assert not self.errors, self.errors


@pytest.fixture
def ring():
    prefix = _prefix()
    db = WaitSet(spin_us=20)
    k = KernelSide.create(prefix, n_slots=4, slot_bytes=4096, arena_bytes=4096, waitset=db)
    lip = LipSide.attach(k.names, os.dup(k.bell_fd), spin_us=20)
    yield prefix, db, k, lip
    lip.close()
    k.close()
    k.unlink()
    db.close()
    assert _dev_shm(prefix) == []


# ------------------------------------------------------------------ round trip
def test_round_trip_one_process(ring):
    _, db, k, lip = ring
    with KernelThread(k, db):
        body = orjson.dumps({"hello": "world", "n": 3})
        toks = np.array([1, 2, 3, 40000, -5], dtype=np.int32)
        r = lip.call(7, body, toks)
        assert r.status == 7
        assert r.json == body
        assert r.arena.dtype == np.float32 and r.arena.shape == (1, 5)
        np.testing.assert_array_equal(r.arena[0], toks.astype(np.float32) * 0.5)
        # zero-copy: a view into the segment, read-only on the LIP side
        seg = np.frombuffer(lip.buffer, dtype=np.uint8)
        assert np.shares_memory(r.arena, seg)
        assert r.arena.ctypes.data % 64 == 0
        assert not r.arena.flags.writeable
        del seg
        # no tokens, no arena; empty json
        r2 = lip.call(0, b"", None)
        assert (r2.status, r2.json, r2.arena) == (0, b"", None)
        # int64 tokens are converted (values fit)
        r3 = lip.call(1, b"{}", np.arange(10, dtype=np.int64))
        np.testing.assert_array_equal(r3.arena[0], np.arange(10) * 0.5)
    assert set(k.states.tolist()) == {FREE}


def test_request_is_copied_out(ring):
    """The kernel's Request must not alias the segment: the LIP can scribble after validation."""
    _, db, k, lip = ring
    got = {}

    def serve(k, slot):
        req = k.read_request(slot)
        off = _slot_off(k, slot)
        lip.buffer[off:off + k.slot_bytes] = b"\xab" * k.slot_bytes   # the LIP scribbles
        got["req"] = req
        k.respond(slot, req.call_id, 0, b"")

    with KernelThread(k, db, serve):
        lip.call(3, b'{"a":1}', np.array([9, 8, 7], dtype=np.int32), flags=5)
    req = got["req"]
    assert (req.op, req.json, req.flags) == (3, b'{"a":1}', 5)
    assert req.tokens.tolist() == [9, 8, 7] and req.tokens.dtype == np.int32
    # a copy that aliases nothing the LIP can write: read-only, over an immutable bytes object
    assert not req.tokens.flags.writeable and isinstance(req.tokens.base, bytes)
    assert isinstance(req.json, bytes)


def test_request_too_large_raises_before_writing(ring):
    _, db, k, lip = ring
    snap = bytes(lip.buffer)
    with pytest.raises(ValueError):
        lip.call(0, b"x" * 5000)
    with pytest.raises(ValueError):
        lip.call(0, b"", np.zeros(lip.max_tokens() + 1, dtype=np.int32))
    with pytest.raises(ValueError):
        lip.call(0, b"", np.array([1 << 40]))
    with pytest.raises(ValueError):
        lip.call(0, b"", np.zeros((2, 2), dtype=np.int32))
    assert bytes(lip.buffer) == snap
    # exactly full fits
    with KernelThread(k, db):
        n = lip.max_tokens(5)
        r = lip.call(0, b"12345", np.arange(n, dtype=np.int32))
        assert r.json == b"12345" and r.arena.shape == (1, n)


def test_arena_view_stays_valid_per_thread(ring):
    _, db, k, lip = ring
    with KernelThread(k, db):
        first = lip.call(0, b"", np.array([2, 4], dtype=np.int32)).arena
        keep = first.copy()

        def other():
            for _ in range(20):
                lip.call(0, b"", np.array([100, 200, 300], dtype=np.int32))

        ts = [threading.Thread(target=other) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        np.testing.assert_array_equal(first, keep)     # other threads used other slots
        second = lip.call(0, b"", np.array([6, 8], dtype=np.int32)).arena
        assert np.shares_memory(first, second)          # the same thread reuses its slot


def test_many_threads_more_than_slots(ring):
    _, db, k, lip = ring
    errors = []

    def worker(w):
        try:
            for j in range(50):
                body = orjson.dumps([w, j])
                r = lip.call(1, body, np.array([w, j], dtype=np.int32))
                assert r.json == body
                assert r.arena[0].tolist() == [w * 0.5, j * 0.5]
        except BaseException as e:
            errors.append(e)

    with KernelThread(k, db):
        ts = [threading.Thread(target=worker, args=(w,)) for w in range(10)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
    assert not errors, errors[:3]


def test_stale_posts_are_not_responses(ring):
    """Posts left by calls whose spin won must not end a later call early."""
    _, db, k, lip = ring
    delay = {"s": 0.0}

    def serve(k, slot):
        req = k.read_request(slot)
        if delay["s"]:
            time.sleep(delay["s"])
        k.respond(slot, req.call_id, 0, req.json)

    with KernelThread(k, db, serve):
        for j in range(200):                      # many spin wins: leftover posts possible
            assert lip.call(0, b"%d" % j).json == b"%d" % j
        for name in k.names["slot_sems"]:         # and some blatantly stale ones, on every slot
            sem = posix_ipc.Semaphore(name)
            for _ in range(5):
                sem.release()
            sem.close()
        delay["s"] = 0.1
        t0 = time.monotonic()
        r = lip.call(0, b"slow")
        assert r.json == b"slow"
        assert time.monotonic() - t0 >= 0.09


def test_a_hint_wakes_the_waiter_early_and_never_passes_for_an_answer(ring):
    """The kernel's hint (layout.py, "hints"): the waiter woken by it goes on waiting until the
    answer; polls around the expected time (CPU time spent near it, not all along); an answer
    well before the expected time still wakes it at once; and the answer clears the hint, so
    the slot's next call, unhinted, blocks as usual (no CPU while waiting)."""
    _, db, k, lip = ring

    def serve(k, slot):
        req = k.read_request(slot)
        if req.json in (b"late", b"early"):
            ahead = 0.06 if req.json == b"late" else 2.0
            assert k.hint(slot, time.perf_counter_ns() + int(ahead * 1e9))
            k.wake(slot)
        time.sleep(0.06 if req.json in (b"late", b"plain") else 0.02)
        k.respond(slot, req.call_id, 0, req.json)

    with KernelThread(k, db, serve):
        for _ in range(3):                      # the adaptive spin gives up on long calls
            lip.call(0, b"plain")
        t0, c0 = time.monotonic(), time.thread_time()
        assert lip.call(0, b"late").json == b"late"
        wall, cpu = time.monotonic() - t0, time.thread_time() - c0
        assert wall >= 0.055 and cpu < 0.04, (wall, cpu)     # woken by the hint, slept, then polled
        t0 = time.monotonic()
        assert lip.call(0, b"early").json == b"early"       # expected in 2 s, answered in 20 ms
        assert time.monotonic() - t0 < 1.0
        assert set(np.frombuffer(lip.buffer, dtype="<u8", count=k.n_slots, offset=shm.hints_off(k.n_slots))) == {0}
        c0 = time.thread_time()
        assert lip.call(0, b"plain").json == b"plain"       # no stale hint: blocks, no polling
        assert time.thread_time() - c0 < 0.02
    assert not k.hint(0, 1)                     # a slot not in the kernel's hands takes none


# ------------------------------------------------------------------ two processes
def _lip_child(names, bell_fd, conn, n_threads, n_calls):
    try:
        lip = LipSide.attach(names, bell_fd, spin_us=20)
        errors = []
        per = n_calls // n_threads

        def worker(w):
            rng = np.random.default_rng(w)
            try:
                for j in range(per):
                    body = orjson.dumps({"w": w, "j": j, "pad": "x" * int(rng.integers(0, 50))})
                    toks = rng.integers(-1000, 1000, size=int(rng.integers(0, 20))).astype(np.int32)
                    r = lip.call(5, body, toks)
                    if r.status != 5 or r.json != body:
                        errors.append(f"thread {w} call {j}: wrong echo {r.json[:60]!r}")
                    if toks.size and not np.array_equal(r.arena[0], toks.astype(np.float32) * 0.5):
                        errors.append(f"thread {w} call {j}: wrong arena")
                    if not toks.size and r.arena is not None:
                        errors.append(f"thread {w} call {j}: unexpected arena")
            except BaseException as e:
                errors.append(f"thread {w}: {e!r}")

        ts = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        lip.close()
        conn.send(errors[:10])
    except BaseException as e:
        conn.send([repr(e)])
    finally:
        conn.close()


def test_two_processes_concurrent_threads():
    prefix = _prefix()
    db = WaitSet(spin_us=20)
    k = KernelSide.create(prefix, n_slots=8, slot_bytes=4096, arena_bytes=4096, waitset=db)
    try:
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_lip_child, args=(k.names, k.bell_fd, child, 4, 2000))
        p.start()
        child.close()
        served = 0
        t_end = time.monotonic() + 15
        while p.exitcode is None and time.monotonic() < t_end:
            db.wait(0.05, k.pending)
            for s in k.poll():
                serve_once(k, s)
                served += 1
        p.join(5)
        errors = parent.recv() if parent.poll(1) else ["child sent nothing"]
        assert p.exitcode == 0
        assert errors == []
        assert served == 2000
    finally:
        k.close()
        k.unlink()
        db.close()
    assert _dev_shm(prefix) == []


# ------------------------------------------------------------------ hostile input
# A hostile LIP writes through its own mapping of the segment (LipSide.buffer), as any LIP can.
def _slot_off(k, i):
    return shm.geometry(k.n_slots, k.slot_bytes, k.arena_bytes)[0] + i * k.slot_bytes


def _arena_off(k):
    return shm.geometry(k.n_slots, k.slot_bytes, k.arena_bytes)[1]


def _state(lip, i, v):
    struct.pack_into("<I", lip.buffer, shm.STATES_OFF + 4 * i, v)


def test_hostile_bad_lengths(ring):
    _, db, k, lip = ring
    off = _slot_off(k, 0)
    mm = lip.buffer
    cases = [
        (1, 0, 0xFFFFFFFF, 0, 0),             # json_len huge
        (1, 0, 0, 0xFFFFFFFF, 0),             # n_tokens huge
        (1, 0, 0, 0x40000000, 0),             # n_tokens * 4 wraps a u32
        (1, 0, 4096 - 24 + 1, 0, 0),          # json one byte past the slot
        (1, 0, 2000, 600, 0),                 # json + tokens overflow together
        (1, 0, 4096 - 24, 1, 0),              # json exactly fills, then one token
    ]
    for hdr in cases:
        shm.REQ_HDR.pack_into(mm, off, *hdr)
        _state(lip, 0, REQUEST)
        assert k.poll() == [0]
        with pytest.raises(RingError):
            k.read_request(0)
        k.respond(0, 0, EINVAL, b"")
    # exact fits are accepted
    shm.REQ_HDR.pack_into(mm, off, 1, 0, 4096 - 24, 0, 0)
    _state(lip, 0, REQUEST)
    assert k.poll() == [0]
    assert len(k.read_request(0).json) == 4096 - 24
    k.respond(0, 1, 0, b"")
    shm.REQ_HDR.pack_into(mm, off, 1, 0, 0, (4096 - 24) // 4, 0)
    _state(lip, 0, REQUEST)
    assert k.poll() == [0]
    assert k.read_request(0).tokens.size == (4096 - 24) // 4
    k.respond(0, 1, 0, b"")


def test_hostile_states_and_header(ring):
    _, db, k, lip = ring
    # invalid state values are ignored, not taken
    for v in (7, 0xFFFFFFFF, 0x01000000, 0x0100, BUSY, RESPONSE):
        for i in range(k.n_slots):
            _state(lip, i, v)
        assert not k.pending()
        assert k.poll() == []
    # unaligned byte pattern 01 00 00 00 across two state words: no false take
    struct.pack_into("<II", lip.buffer, shm.STATES_OFF, 0x01000000, 0)
    assert not k.pending() and k.poll() == []
    # a slot re-flipped to REQUEST while the kernel holds it is not taken twice
    _state(lip, 1, REQUEST)
    shm.REQ_HDR.pack_into(lip.buffer, _slot_off(k, 1), 9, 0, 0, 0, 0)
    assert k.poll() == [1]
    _state(lip, 1, REQUEST)
    assert not k.pending() and k.poll() == []
    k.respond(1, 9, 0, b"")
    # scribbled header (geometry, magic): the kernel never reads it back
    lip.buffer[0:shm.HEADER_BYTES] = os.urandom(shm.HEADER_BYTES)
    struct.pack_into("<I", lip.buffer, 20, 0)   # keep 'closed' clear so the LIP goes on
    for i in range(k.n_slots):
        _state(lip, i, FREE)
    with KernelThread(k, db):
        r = lip.call(2, b'{"ok":true}', np.array([1], dtype=np.int32))
        assert r.json == b'{"ok":true}' and r.arena[0, 0] == 0.5


def test_hostile_random_garbage_then_valid_calls(ring):
    _, db, k, lip = ring
    rng = np.random.default_rng(1234)
    mm = lip.buffer
    raised = ok = 0
    for _ in range(300):
        i = int(rng.integers(0, k.n_slots))
        off = _slot_off(k, i)
        mm[off:off + k.slot_bytes] = rng.bytes(k.slot_bytes)
        if rng.random() < 0.5:   # small plausible lengths sometimes
            struct.pack_into("<II", mm, off + 12, int(rng.integers(0, 5000)), int(rng.integers(0, 1100)))
        # random garbage in the whole state array, then one REQUEST
        mm[shm.STATES_OFF:shm.STATES_OFF + 4 * k.n_slots] = rng.bytes(4 * k.n_slots)
        _state(lip, i, REQUEST)
        for s in k.poll():
            try:
                req = k.read_request(s)
            except RingError:
                raised += 1
                k.respond(s, 0, EINVAL, b"")
                continue
            ok += 1
            assert len(req.json) + 4 * req.tokens.size <= k.slot_bytes - 24
            k.respond(s, req.call_id, 0, b"")
    assert raised > 100 and ok > 10
    # garbage in the arena and a hostile LIP making the kernel answer a garbage slot
    # through the normal loop: error status, then valid calls still work
    mm[_arena_off(k):_arena_off(k) + 4 * k.arena_bytes] = rng.bytes(4 * k.arena_bytes)
    for i in range(k.n_slots):
        _state(lip, i, FREE)
    with KernelThread(k, db):
        off = _slot_off(k, 3)
        shm.REQ_HDR.pack_into(mm, off, 77, 1, 0xFFFFFF, 0, 0)
        _state(lip, 3, REQUEST)
        db.ring()
        t_end = time.monotonic() + 5
        while k.states[3] != RESPONSE and time.monotonic() < t_end:
            time.sleep(0.001)
        status = shm.RESP_HDR.unpack_from(mm, off)[1]
        assert status == EINVAL
        _state(lip, 3, FREE)
        for j in range(50):
            body = orjson.dumps({"j": j})
            r = lip.call(4, body, np.array([j, j + 1], dtype=np.int32))
            assert (r.status, r.json) == (4, body)
            assert r.arena[0].tolist() == [j * 0.5, (j + 1) * 0.5]


def test_arena_bounds(ring):
    _, db, k, lip = ring
    a = k.arena(3, 4, 256)           # exactly 4096 bytes
    assert a.shape == (4, 256) and a.flags.writeable and a.ctypes.data % 64 == 0
    start, size = k.arena_range()    # every slot's arena, one block
    assert size == k.n_slots * k.arena_bytes and a.ctypes.data == start + 3 * k.arena_bytes
    assert k.arena(0, 1, 1).ctypes.data == start
    with pytest.raises(ValueError):
        k.arena(0, 5, 256)
    with pytest.raises(ValueError):
        k.arena(0, -1, 4)
    with pytest.raises(IndexError):
        k.arena(4, 1, 1)
    with pytest.raises(ValueError):
        k.respond(0, 1, 0, b"", ARENA_F32, 2, 1024)
    with pytest.raises(ValueError):
        k.respond(0, 1, 0, b"x" * 5000)
    with pytest.raises(IndexError):
        k.read_request(-1)


# ------------------------------------------------------------------ closing, names, cleanup
def test_closed_flag(ring):
    _, db, k, lip = ring
    box = {}

    def blocked_call():
        try:
            lip.call(0, b"")          # nobody serves it
        except BaseException as e:
            box["e"] = e

    t = threading.Thread(target=blocked_call)
    t.start()
    time.sleep(0.1)
    asked = [i for i in range(k.n_slots) if k.states[i] == REQUEST]
    assert len(asked) == 1 and k.poll() == asked
    k.mark_closed()
    t.join(2)
    assert not t.is_alive()
    assert isinstance(box.get("e"), RingClosed)
    assert lip.closed
    with pytest.raises(RingClosed):
        lip.call(0, b"")


def test_call_timeout_then_late_answer(ring):
    _, db, k, lip = ring
    with pytest.raises(TimeoutError):
        lip.call(0, b"late", timeout=0.05)
    [s] = k.poll()
    req = k.read_request(s)
    k.respond(s, req.call_id, 0, b"late")     # arrives after the LIP gave up
    with KernelThread(k, db):
        for j in range(2 * k.n_slots):
            assert lip.call(0, b"%d" % j).json == b"%d" % j


def test_names_unique_and_cleanup():
    prefix = _prefix()
    before = _dev_shm(prefix)
    assert before == []
    db = WaitSet()
    k1 = KernelSide.create(prefix, n_slots=2, slot_bytes=1024, arena_bytes=1024, waitset=db)
    k2 = KernelSide.create(prefix, n_slots=2, slot_bytes=1024, arena_bytes=1024, waitset=db)
    n1, n2 = k1.names, k2.names
    assert set(n1) == {"segment", "slot_sems"}          # the doorbell is an fd, not a name
    all1 = {n1["segment"], *n1["slot_sems"]}
    all2 = {n2["segment"], *n2["slot_sems"]}
    assert len(all1) == 3 and len(all2) == 3 and not all1 & all2
    for name in all1 | all2:
        assert name.startswith(f"/{prefix}-") and len(name) == len(prefix) + 2 + 32
    # each ring has a doorbell of its own: distinct eventfds (distinct inodes)
    assert os.readlink(f"/proc/self/fd/{k1.bell_fd}") == "anon_inode:[eventfd]"
    os.eventfd_write(k1.bell_fd, 3)
    with pytest.raises(BlockingIOError):
        os.eventfd_read(k2.bell_fd)                      # k2's bell did not ring
    assert os.eventfd_read(k1.bell_fd) == 3
    # segment and semaphores are on /dev/shm with mode 0600
    listed = _dev_shm(prefix)
    assert len(listed) == 6
    for n in listed:
        assert os.stat(f"/dev/shm/{n}").st_mode & 0o777 == 0o600
    lip = LipSide.attach(n1, os.dup(k1.bell_fd))
    lip.close()
    bells = (k1.bell_fd, k2.bell_fd)
    for obj in (k1, k2):
        obj.close()
        obj.unlink()
        obj.unlink()                  # idempotent
    assert k1.bell_fd == k2.bell_fd == -1 and db.watching() == 0
    for fd in bells:
        with pytest.raises(OSError):
            os.fstat(fd)              # closed with the ring
    db.close()
    assert _dev_shm(prefix) == []
    with pytest.raises(Exception):
        LipSide.attach(n1)            # gone


def test_create_failure_cleans_up():
    prefix = _prefix()
    with pytest.raises(ValueError):
        KernelSide.create(prefix, n_slots=0)
    with pytest.raises(ValueError):
        KernelSide.create("bad/prefix")
    assert _dev_shm(prefix) == []


def test_attach_rejects_bad_header():
    prefix = _prefix()
    k = KernelSide.create(prefix, n_slots=2, slot_bytes=1024, arena_bytes=0)
    mm = shm.map_segment(posix_ipc.SharedMemory(k.names["segment"]), shm.HEADER_BYTES)   # a LIP's own mapping
    try:
        mm[0:8] = b"NOTARING"
        with pytest.raises(RingError):
            LipSide.attach(k.names)
        mm[0:8] = shm.MAGIC
        with pytest.raises(RingError):
            LipSide.attach({**k.names, "slot_sems": k.names["slot_sems"][:1]})
        LipSide.attach(k.names).close()
    finally:
        mm.close()
        k.close()
        k.unlink()
    assert _dev_shm(prefix) == []


# ------------------------------------------------------------------ doorbells
def test_waitset_spin_and_block():
    db = WaitSet(spin_us=200)
    try:
        # nothing ready, nothing rung: times out, the spin budget shrinks
        assert db.wait(0.01, lambda: False) is False
        assert db.spin_us == 200           # one failure is not a trend
        assert db.wait(0.01, lambda: False) is False
        assert db.spin_us < 200
        for _ in range(12):
            db.wait(0.001, lambda: False)
        assert db.spin_us == 0
        # a block woken quickly (a spin would have won) grows it from 0 ...
        db.ring()
        assert db.wait(1.0, lambda: False) is True
        assert db.spin_us > 0
        # ... and so do spins that win (ready() turns true during the spin)
        for _ in range(12):
            calls = [0]

            def ready_second_time():
                calls[0] += 1
                return calls[0] >= 2
            db.ring()        # so a spin too short to call ready() twice still wakes at once
            assert db.wait(1.0, ready_second_time) is True
        assert db.spin_us == 200
        while db.wait(0.01):               # stale edges: one spurious wake-up, then quiet
            pass
        assert db.wait(0.01) is False
        # ready() during the spin returns at once
        flag = [0]

        def ready():
            flag[0] += 1
            return flag[0] > 1
        t0 = time.monotonic()
        assert db.wait(1.0, ready) is True
        assert time.monotonic() - t0 < 0.5
        assert flag[0] == 2                # the spin asks at least once, however late it starts
        # blocking wait woken from another thread; no ready callable
        threading.Timer(0.05, db.ring).start()
        t0 = time.monotonic()
        assert db.wait(2.0) is True
        assert 0.03 < time.monotonic() - t0 < 1.5
    finally:
        db.close()


@contextlib.contextmanager
def _two_rings(prefix):
    """A WaitSet (no spin) and two rings on it; all closed and unlinked after, none left in /dev/shm."""
    db = WaitSet(spin_us=0)
    rings = [KernelSide.create(f"{prefix}{i}", n_slots=2, slot_bytes=1024, arena_bytes=0, waitset=db)
             for i in range(2)]
    try:
        yield db, rings
    finally:
        for k in rings:
            k.close()
            k.unlink()
        db.close()
    assert _dev_shm(prefix) == []


def test_each_lip_has_its_own_bell_and_cannot_block_the_kernel():
    prefix = _prefix()
    with _two_rings(prefix) as (db, rings):
        evil_fd, good_fd = os.dup(rings[0].bell_fd), os.dup(rings[1].bell_fd)
        # the hostile LIP saturates its bell, makes it blocking and reads it itself
        os.eventfd_write(evil_fd, (1 << 64) - 2)
        os.set_blocking(evil_fd, True)
        assert os.eventfd_read(evil_fd) == (1 << 64) - 2
        while db.wait(0.01):
            pass
        # the honest LIP's ring still wakes the kernel at once, and the kernel never
        # read (so never blocked on) the hostile, now blocking and empty, eventfd
        good = LipSide.attach(rings[1].names, good_fd, spin_us=0)
        with KernelThread(rings[1], db):
            t0 = time.monotonic()
            for i in range(50):
                assert good.call(0, b"x%d" % i).json == b"x%d" % i
            assert time.monotonic() - t0 < 2.0
        good.close()
        os.close(evil_fd)


def test_a_bell_rung_without_requests_is_muted():
    prefix = _prefix()
    with _two_rings(prefix) as (db, rings):
        evil = os.dup(rings[0].bell_fd)
        db.MUTE_S = db.MUTE_MAX_S = 5.0            # long mutes: the checks below are exact
        wakes = 0
        t_end = time.monotonic() + 0.3
        while time.monotonic() < t_end:       # ring, let the kernel wake, ring again ...
            os.eventfd_write(evil, 1)
            if db.wait(0.005, lambda: any(r.pending() for r in rings)):
                wakes += 1
        assert db.mutes >= 1
        assert wakes <= 2 * db.MUTE_AFTER, wakes  # un-muted it would wake on every ring (~1000s)
        # the other ring's bell still wakes the kernel while the hostile one is muted
        os.eventfd_write(evil, 1)
        assert db.wait(0.05) is False             # muted: its ring wakes nobody
        timer = threading.Timer(0.05, lambda: os.eventfd_write(rings[1].bell_fd, 1))
        timer.start()
        t0 = time.monotonic()
        assert db.wait(2.0) is True
        assert 0.03 < time.monotonic() - t0 < 1.0
        timer.join()
        # a honest request on the muted ring is still served: by the spin / poll
        rings[0]._mm[shm.STATES_OFF:shm.STATES_OFF + 4] = struct.pack("<I", REQUEST)
        assert db.wait(1.0, rings[0].pending) is True
        os.close(evil)


def test_detach_closes_the_ring_at_once_and_unmaps_when_finished():
    """The kernel's side of an exited LIP's ring: `detach` stops polling and closes the
    doorbell on the syscall thread; the returned job, run on another thread (the kernel's
    ring thread, RingThread), unmaps the segment and closes the semaphores."""
    from symphony.kernel.syscall.slowlane import RingThread
    db = WaitSet()
    k = KernelSide.create(_prefix(), n_slots=2, arena_bytes=4096, waitset=db)
    bell, seg = k.bell_fd, k.names["segment"]

    def mapped() -> bool:                              # the segment is in this process's address space
        with open("/proc/self/maps") as f:
            return any(f"/dev/shm{seg}" in line for line in f)
    assert mapped()
    k.unlink()
    finish = k.detach()
    assert k.closed and k.bell_fd == -1 and not k.pending() and k.poll() == []
    with pytest.raises(OSError):
        os.fstat(bell)                                 # the doorbell is closed already
    assert mapped()                                    # ... the mapping not yet
    rings, order = RingThread("test-rings"), []
    rings.submit(lambda: order.append("pin"))          # jobs run in the order given
    done = rings.submit(lambda: (finish(), order.append("unmapped")))
    rings.submit(lambda: 1 / 0)                        # a failing job is logged, the thread goes on
    done.result(5)
    assert not mapped() and order == ["pin", "unmapped"]
    assert rings.submit(lambda: order.append("after")).result(5) is None and order[-1] == "after"
    rings.shutdown()
    db.close()
