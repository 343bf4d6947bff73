"""The LIP's end of its ring (`LipSide`); the layout is in `layout`, the waiting in `wait`.

The LIP side trusts the segment's header (the kernel wrote it), but still
checks lengths in responses so that a bug reads as ``RingError``, not garbage.

Arena lifetime
--------------
``Response.arena`` is a zero-copy, read-only NumPy view into arena region i of
the slot the call used.  A thread keeps reusing "its" slot, so that view stays
valid until *the same thread's* next call.  Only when more threads than slots
use the ring is the slot of the thread idle longest taken over by another
thread, which overwrites that arena: copy (``arena.copy()``) results you keep.

An ``abi.ARENA_TOPK`` arena arrives as a `TopK` (ids, logprobs) pair of such views.
"""
from __future__ import annotations

import itertools
import mmap
import os
import threading
import time

import numpy as np
import posix_ipc

from . import abi
from .layout import (ARENA_DTYPES, CLOSED_OFF, FREE, HDR, HEADER_BYTES, MAGIC, MAX_SLOT_BYTES, MAX_SLOTS,
                     REQ_BODY_OFF, REQ_HDR, REQUEST, RESP_BODY_OFF, RESP_HDR, RESPONSE, STATES_OFF, U32,
                     U32_MAX, U64, VERSION, Response, RingClosed, RingError, TopK, align, close_sems, geometry, hints_off, map_segment,
                     new_response, unmap)
from .wait import Spin

__all__ = ["LipSide"]

_BLOCK_CHUNK_S = 0.5   # a blocked LIP re-checks `closed` at least this often
# A hinted wait (layout.py, "hints"): wake this long before the expected answer, and poll until
# this long after it before blocking again (a fixed part for the timer's and the step's jitter,
# and a share of the wait, since a longer step varies more)
HINT_LEAD_NS, HINT_LEAD_SHARE = 100_000, 1 / 32
HINT_GRACE_NS, HINT_GRACE_SHARE = 250_000, 1 / 8
_eventfd_write = os.eventfd_write


class _Slot:
    __slots__ = ("idx", "off", "st_off", "owner", "busy", "lost", "last")

    def __init__(self, idx: int, off: int, st_off: int):
        self.idx, self.off, self.st_off = idx, off, st_off
        self.owner = None       # thread ident the slot is bound to
        self.busy = False       # a call is using it
        self.lost = False       # a call timed out; the kernel may still answer
        self.last = 0           # LRU tick


class LipSide:
    """The LIP's end of its ring.  ``call`` is thread-safe."""

    def __init__(self):   # use LipSide.attach
        raise TypeError("use LipSide.attach(names)")

    @classmethod
    def attach(cls, names: dict, bell_fd: int | None = None, spin_us: float = 50.0,
               adaptive: bool = True) -> "LipSide":
        """Map the segment and open the semaphores named by ``KernelSide.names``.

        ``bell_fd``: this LIP's doorbell (an eventfd from the kernel); the LipSide owns
        it from now on (closes it on close()).  None: never ring, the kernel polls."""
        self = object.__new__(cls)
        self._mm = None
        self._sems = []
        if bell_fd is not None and (not isinstance(bell_fd, int) or bell_fd < 0):
            raise ValueError(f"bell_fd must be a file descriptor, got {bell_fd!r}")
        self._bell = bell_fd
        try:
            shm = posix_ipc.SharedMemory(names["segment"])
            size = shm.size
            self._mm = map_segment(shm, size)
            if size < HEADER_BYTES:
                raise RingError("segment smaller than its header")
            (magic, version, n_slots, slot_bytes, _closed, arena_bytes,
             states_off, slots_off, arena_off, total) = HDR.unpack_from(self._mm, 0)
            if magic != MAGIC or version != VERSION:
                raise RingError(f"bad magic/version {magic!r}/{version}")
            if not (1 <= n_slots <= MAX_SLOTS and 64 <= slot_bytes <= MAX_SLOT_BYTES
                    and slot_bytes % 64 == 0 and arena_bytes % 64 == 0
                    and (states_off, slots_off, arena_off, total)
                    == (STATES_OFF, *geometry(n_slots, slot_bytes, arena_bytes))
                    and total <= size):
                raise RingError("inconsistent ring header")
            sem_names = list(names["slot_sems"])
            if len(sem_names) != n_slots:
                raise RingError(f"{len(sem_names)} slot semaphores for {n_slots} slots")
            for nm in sem_names:
                self._sems.append(posix_ipc.Semaphore(nm))
        except BaseException:
            self._mm_close()
            raise
        self.n_slots, self.slot_bytes, self.arena_bytes = n_slots, slot_bytes, arena_bytes
        self._arena_off = arena_off
        self._slots = [_Slot(i, slots_off + i * slot_bytes, STATES_OFF + 4 * i) for i in range(n_slots)]
        self._hints_off = hints_off(n_slots)
        self._by_owner: dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._tick = 0
        self._ids = itertools.count(1)
        self._n_inflight = 0
        self._n_waiting = 0
        self._local_closed = False
        self.spin = Spin(spin_us, adaptive)
        return self

    # ------------------------------------------------------------ info
    @property
    def closed(self) -> bool:
        return self._local_closed or U32.unpack_from(self._mm, CLOSED_OFF)[0] != 0

    @property
    def buffer(self) -> mmap.mmap:
        """The mapped segment (e.g. for np.shares_memory checks)."""
        return self._mm

    def max_tokens(self, json_len: int = 0) -> int:
        """The most tokens a request with json_len bytes of json can carry."""
        return max(0, (self.slot_bytes - REQ_BODY_OFF - align(json_len, 8)) // 4)

    # ------------------------------------------------------------ slot claiming
    def _claim(self, tid: int) -> _Slot:
        """Slow path of slot claiming (the fast path, "my slot is idle", is inline in call)."""
        with self._cond:
            while True:
                if self.closed:
                    raise RingClosed("ring closed")
                s = self._by_owner.get(tid)
                if s is None or s.busy or s.lost:
                    s = self._pick(tid)
                if s is not None:
                    s.busy = True
                    self._tick += 1
                    s.last = self._tick
                    self._n_inflight += 1
                    return s
                self._n_waiting += 1
                try:
                    self._cond.wait(0.05)
                finally:
                    self._n_waiting -= 1

    def _pick(self, tid: int) -> _Slot | None:
        """An idle slot for thread tid: an unowned one first, else the least recently used."""
        best = None
        for s in self._slots:
            if s.lost:
                self._try_reclaim(s)
            if s.busy or s.lost:
                continue
            if s.owner is None:
                best = s
                break
            if best is None or s.last < best.last:
                best = s
        if best is not None:
            if best.owner is not None:
                self._by_owner.pop(best.owner, None)   # steal: the old owner's arena view dies
            old = self._by_owner.get(tid)
            if old is not None and old is not best:
                old.owner = None
            best.owner = tid
            self._by_owner[tid] = best
        return best

    def _try_reclaim(self, s: _Slot) -> None:
        if U32.unpack_from(self._mm, s.st_off)[0] == RESPONSE:   # the late answer: discard it
            U32.pack_into(self._mm, s.st_off, FREE)
            s.lost = False
            sem = self._sems[s.idx]
            while sem.value > 0:
                try:
                    sem.acquire(0)
                except posix_ipc.BusyError:
                    break

    # ------------------------------------------------------------ the call
    def call(self, op: int, json: bytes = b"", tokens: np.ndarray | None = None, flags: int = 0,
             timeout: float | None = None) -> Response:
        """Make one system call; blocks until the kernel answers.

        Raises ValueError (nothing written) if the request does not fit a slot,
        RingClosed if the ring is closed, TimeoutError after ``timeout`` seconds (the
        slot is then set aside until the late answer arrives).
        """
        if type(json) is not bytes:
            json = bytes(json)
        jl = len(json)
        tok_rel = REQ_BODY_OFF + ((jl + 7) & ~7)
        if tokens is None:
            nt = 0
        else:
            tokens = _as_tokens(tokens)
            nt = tokens.shape[0]
        if tok_rel + 4 * nt > self.slot_bytes:
            raise ValueError(f"request of {jl} json bytes + {nt} tokens does not fit a "
                             f"{self.slot_bytes}-byte slot")
        if not (0 <= op <= U32_MAX and 0 <= flags <= U32_MAX):
            raise ValueError("op and flags must fit in u32")
        mm = self._mm
        if self._local_closed or mm is None or U32.unpack_from(mm, CLOSED_OFF)[0]:
            raise RingClosed("ring closed")

        # claim a slot: fast path, this thread's own idle slot
        tid = _get_ident()
        lock = self._lock
        with lock:
            s = self._by_owner.get(tid)
            if s is not None and not s.busy and not s.lost:
                s.busy = True
                self._tick += 1
                s.last = self._tick
                self._n_inflight += 1
            else:
                s = None
        if s is None:
            s = self._claim(tid)
        try:
            off = s.off
            call_id = next(self._ids)
            if jl:
                mm[off + REQ_BODY_OFF:off + REQ_BODY_OFF + jl] = json
            if nt:
                mm[off + tok_rel:off + tok_rel + 4 * nt] = memoryview(tokens).cast("B")
            REQ_HDR.pack_into(mm, off, call_id, op, jl, nt, flags)
            U32.pack_into(mm, s.st_off, REQUEST)     # after the payload
            if self._bell is not None:
                try:
                    _eventfd_write(self._bell, 1)
                except OSError:           # EAGAIN: the counter is saturated, rung already
                    pass
            self._await(s, timeout)
            return self._read_response(s, call_id)
        finally:
            with lock:
                s.busy = False
                self._n_inflight -= 1
                if self._n_waiting:
                    self._cond.notify()

    def _await(self, s: _Slot, timeout: float | None) -> None:
        mm, st_off = self._mm, s.st_off
        unpack = U32.unpack_from
        spin = self.spin
        pc = time.perf_counter_ns
        t0 = pc()
        solo = self._n_inflight == 1             # only spin while no sibling thread needs the GIL
        budget = spin.budget() if solo else 0
        if budget:
            end = t0 + budget
            yld = spin.yielder()
            while True:
                if unpack(mm, st_off)[0] == RESPONSE:
                    spin.won(budget)
                    sem = self._sems[s.idx]
                    if sem.value > 0:            # the kernel's post, if it is there yet
                        try:
                            sem.acquire(0)
                        except posix_ipc.BusyError:
                            pass
                    return
                if pc() >= end:
                    break
                yld()
        sem = self._sems[s.idx]
        deadline = None if timeout is None else t0 + int(timeout * 1e9)
        hint_off, hinted, yld = self._hints_off + 8 * s.idx, False, spin.yielder()
        while unpack(mm, st_off)[0] != RESPONSE:  # re-checked after every wakeup: stale posts
            if self.closed:
                raise RingClosed("ring closed")
            chunk = _BLOCK_CHUNK_S
            now = pc()
            if deadline is not None:
                left = (deadline - now) / 1e9
                if left <= 0:
                    with self._lock:
                        s.lost = True
                    raise TimeoutError(f"no answer to the call in slot {s.idx} after {timeout} s")
                chunk = min(chunk, left)
            if solo:
                eta = U64.unpack_from(mm, hint_off)[0]
                if eta > t0:                     # the kernel's hint for this call (older: stale)
                    wake = eta - HINT_LEAD_NS - int((eta - t0) * HINT_LEAD_SHARE)
                    if now < wake:               # until shortly before it, a timed wait (an early
                        chunk = min(chunk, (wake - now) / 1e9)    # answer's post still wakes it)
                    elif now < eta + HINT_GRACE_NS + int((eta - t0) * HINT_GRACE_SHARE):
                        hinted = True            # then poll, leaving the core to others meanwhile
                        yld()
                        continue
            try:
                sem.acquire(chunk)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass
        if hinted and sem.value > 0:             # the answer's post, when polling saw it first
            try:
                sem.acquire(0)
            except posix_ipc.BusyError:
                pass
        if solo:
            spin.blocked(budget, pc() - t0, True)

    def _read_response(self, s: _Slot, call_id: int) -> Response:
        mm, off = self._mm, s.off
        try:
            rid, status, jl, kind, rows, cols = RESP_HDR.unpack_from(mm, off)
            if rid != call_id:
                raise RingError(f"slot {s.idx}: response for call {rid}, expected {call_id}")
            if jl > self.slot_bytes - RESP_BODY_OFF:
                raise RingError(f"slot {s.idx}: response json_len {jl} too large")
            json = mm[off + RESP_BODY_OFF:off + RESP_BODY_OFF + jl]
            if kind:
                dt = ARENA_DTYPES.get(kind)
                if dt is None or rows * cols * dt.itemsize > self.arena_bytes:
                    raise RingError(f"slot {s.idx}: bad arena {kind} {rows}x{cols}")
                arena = np.ndarray((rows, cols), dtype=dt, buffer=mm,
                                   offset=self._arena_off + s.idx * self.arena_bytes)
                arena.flags.writeable = False
                if kind == abi.ARENA_TOPK:
                    arena = _split_topk(arena, s.idx)
            else:
                arena = None
        finally:
            U32.pack_into(mm, s.st_off, FREE)
        return new_response((status, json, arena))

    # ------------------------------------------------------------ teardown
    def _mm_close(self) -> None:
        unmap(self._mm)
        self._mm = None
        close_sems(self._sems)
        if self._bell is not None:
            try:
                os.close(self._bell)
            except OSError:
                pass
            self._bell = None

    def close(self) -> None:
        """Detach (unmap, close the semaphores).  Calls in flight must have finished."""
        self._local_closed = True
        self._mm_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_get_ident = threading.get_ident


def _as_tokens(tokens) -> np.ndarray:
    """A contiguous little-endian int32 1-D array, or ValueError (ids must fit int32)."""
    if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1 \
            and tokens.flags.c_contiguous:
        return tokens
    tok = np.asarray(tokens)
    if tok.ndim != 1:
        raise ValueError("tokens must be a 1-D array")
    if tok.dtype != np.int32:
        if tok.size and tok.dtype.kind not in "iu":
            raise ValueError(f"tokens must be integers, got {tok.dtype}")
        conv = tok.astype(np.int32)
        if not np.array_equal(conv, tok):
            raise ValueError("token ids do not fit in int32")
        tok = conv
    return np.ascontiguousarray(tok, dtype="<i4")


def _split_topk(words: np.ndarray, slot: int) -> TopK:
    """An ARENA_TOPK arena, int32 words [2*rows, k], as (ids int32 [rows, k], logprobs float32 [rows, k])."""
    if words.shape[0] % 2:
        raise RingError(f"slot {slot}: a top-k arena has an even number of rows, got {words.shape[0]}")
    rows = words.shape[0] // 2
    return TopK(words[:rows], words[rows:].view(np.float32))

