"""The kernel's end of a LIP's ring (`KernelSide`); the layout is in `layout`.

The kernel loop is::

    while running:
        waitset.wait(timeout, ready=lambda: any(r.pending() for r in rings))
        for r in rings:
            for slot in r.poll():             # REQUEST -> BUSY
                try:
                    req = r.read_request(slot)
                except RingError:
                    r.respond(slot, 0, -22, b"")
                    continue
                ...                           # (possibly later) r.respond(slot, req.call_id, ...)

Hostile input
-------------
A LIP can write anything anywhere in its own segment at any time, including
between two reads of the kernel.  Therefore the kernel

* never reads the header back: it keeps its own copy of the geometry, the
  ``closed`` flag and which slots it has taken;
* treats a state value other than REQUEST as "nothing to do" (values like 7 are
  ignored), and takes a slot at most once until it has answered it (a slot
  flipped back to REQUEST while the kernel holds it is ignored);
* reads a request header once, into locals, and bounds-checks it against its
  own ``slot_bytes`` with Python integers (no overflow): ``json_len``,
  ``n_tokens`` and ``json_len + tokens`` beyond the slot raise ``RingError``;
  bodies are *copied* out (``bytes``, a read-only int32 array over a bytes copy) before use, so
  later scribbling cannot change what the kernel validated;
* never unpickles anything: bodies are orjson bytes and raw int32 arrays (the
  caller parses the json, and must treat a parse error like a ``RingError``).

The kernel should answer a ``RingError`` with an error status
(``respond(slot, 0, -22, b"")``) so the slot is given back.  A LIP that keeps
re-posting REQUEST only spends its own share of the kernel's time; rate
limiting is the scheduler's business.

Each LIP has its own doorbell, so whatever it does with it (read it, never
ring it, saturate the counter, make it blocking) touches no other LIP's
wake-ups, and the kernel never reads it, so it can never block on it.  A LIP
that rings without requests is muted for a while (``WaitSet``), so it cannot
keep the kernel spinning either; its own calls are then served by the spin
and the periodic poll.  The names are unguessable, but they are not access
control: the objects are 0600 and owned by the kernel's uid, opened by the
worker before it drops to its own uid.

The LIP side trusts the segment's header (the kernel wrote it), but still
checks lengths in responses so that a bug reads as ``RingError``, not garbage.
"""
from __future__ import annotations

import os
import struct
from typing import Callable

import numpy as np
import posix_ipc

from . import abi
from .layout import (ARENA_DTYPES, BUSY, CLOSED_OFF, HDR, MAGIC, MAX_ARENA_BYTES, MAX_SLOT_BYTES, MAX_SLOTS,
                     NO_TOKENS, REQ_BODY_OFF, REQ_HDR, REQUEST_WORD, RESP_BODY_OFF, RESP_HDR, RESPONSE,
                     STATES_OFF, U32, U32_MAX, U64, U64_MASK, VERSION, Request, RingError, TopK, align, check_prefix,
                     close_sems, geometry, hints_off, map_segment, new_name, new_request, unlink_sem, unlink_shm, unmap)
from .wait import WaitSet, new_bell

__all__ = ["KernelSide"]


class KernelSide:
    """The kernel's end of one LIP's ring.  Not thread-safe: one kernel thread uses it."""

    def __init__(self):   # use KernelSide.create
        raise TypeError("use KernelSide.create(prefix, ...)")

    @classmethod
    def create(cls, prefix: str, n_slots: int = 8, slot_bytes: int = 64 * 1024,
               arena_bytes: int = 1 << 20, waitset: "WaitSet | None" = None) -> "KernelSide":
        """Create the segment, the slot semaphores and the LIP's own doorbell.

        ``slot_bytes`` and ``arena_bytes`` (per slot) are rounded up to multiples of 64.
        The doorbell is a fresh eventfd (``bell_fd``: hand it to the LIP, e.g. over
        SCM_RIGHTS); with a ``waitset`` it is watched there until ``close()``.
        """
        check_prefix(prefix)
        if not isinstance(n_slots, int) or not 1 <= n_slots <= MAX_SLOTS:
            raise ValueError(f"n_slots must be an int in [1, {MAX_SLOTS}]")
        if not isinstance(slot_bytes, int) or not 64 <= slot_bytes <= MAX_SLOT_BYTES:
            raise ValueError(f"slot_bytes must be an int in [64, {MAX_SLOT_BYTES}]")
        if not isinstance(arena_bytes, int) or not 0 <= arena_bytes <= MAX_ARENA_BYTES:
            raise ValueError("arena_bytes must be an int >= 0")
        slot_bytes = align(slot_bytes, 64)
        arena_bytes = align(arena_bytes, 64)
        slots_off, arena_off, total = geometry(n_slots, slot_bytes, arena_bytes)

        self = object.__new__(cls)
        self.n_slots, self.slot_bytes, self.arena_bytes = n_slots, slot_bytes, arena_bytes
        self._slots_off, self._arena_off, self.total_bytes = slots_off, arena_off, total
        self._mm = None
        self._states = None
        self._sems: list[posix_ipc.Semaphore] = []
        self._closed = False
        self._inflight = [False] * n_slots
        self._hinted = [False] * n_slots   # a hint is set (`hint`), cleared by the answer
        self._seg_name = new_name(prefix)
        self._seg_created = False          # unlink only what this instance created
        self._sem_names: list[str] = []
        self.taken = 0                     # requests poll() has taken (WaitSet's bell check)
        self.bell_fd = -1
        self._waitset = None
        try:
            self.bell_fd = new_bell()
            shm = posix_ipc.SharedMemory(self._seg_name, posix_ipc.O_CREX, mode=0o600, size=total)
            self._seg_created = True
            self._mm = map_segment(shm, total)
            for _ in range(n_slots):
                name = new_name(prefix)
                self._sems.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
                self._sem_names.append(name)
        except BaseException:
            self.close()
            self.unlink()
            raise
        HDR.pack_into(self._mm, 0, MAGIC, VERSION, n_slots, slot_bytes, 0, arena_bytes,
                       STATES_OFF, slots_off, arena_off, total)
        self._states = np.ndarray((n_slots,), dtype="<u4", buffer=self._mm, offset=STATES_OFF)
        self._u8 = np.ndarray((total,), dtype=np.uint8, buffer=self._mm)
        self._st_lo, self._st_hi = STATES_OFF, STATES_OFF + 4 * n_slots
        self._hints_off = hints_off(n_slots)
        self._req_room = slot_bytes - REQ_BODY_OFF
        self._resp_room = slot_bytes - RESP_BODY_OFF
        if waitset is not None:
            waitset.add(self.bell_fd, self._taken, self.pending)
            self._waitset = waitset
        return self

    # ------------------------------------------------------------ info
    @property
    def names(self) -> dict:
        """What the LIP must open (JSON-serialisable): segment, slot_sems.  Its
        doorbell is a file descriptor (``bell_fd``), passed separately."""
        return {"segment": self._seg_name, "slot_sems": list(self._sem_names)}

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def states(self) -> np.ndarray:
        """The live u32 state array (a view into the segment: LIP-writable, so hostile)."""
        return self._states

    def _check_slot(self, slot) -> int:
        if isinstance(slot, (int, np.integer)) and 0 <= slot < self.n_slots:
            return int(slot)
        raise IndexError(f"slot {slot!r} out of range [0, {self.n_slots})")

    # ------------------------------------------------------------ polling
    def _taken(self) -> int:
        return self.taken

    def pending(self) -> bool:
        """Cheap check: is some slot in REQUEST that the kernel has not taken?"""
        if self._closed:
            return False
        # A C-speed byte search for the REQUEST word; unaligned hits are skipped.
        find, lo, hi, inflight = self._mm.find, self._st_lo, self._st_hi, self._inflight
        pos = find(REQUEST_WORD, lo, hi)
        while pos >= 0:
            rel = pos - lo
            if not rel & 3 and not inflight[rel >> 2]:
                return True
            pos = find(REQUEST_WORD, pos + 1, hi)
        return False

    def poll(self) -> list[int]:
        """Slots in REQUEST state; each is marked BUSY and is the kernel's until respond()."""
        out = []
        if self._closed:
            return out
        mm, lo, hi, inflight = self._mm, self._st_lo, self._st_hi, self._inflight
        find = mm.find
        pos = find(REQUEST_WORD, lo, hi)
        while pos >= 0:
            rel = pos - lo
            if rel & 3:
                pos = find(REQUEST_WORD, pos + 1, hi)
                continue
            i = rel >> 2
            if not inflight[i]:           # else a LIP re-flipped a slot the kernel holds
                inflight[i] = True
                U32.pack_into(mm, pos, BUSY)
                out.append(i)
            pos = find(REQUEST_WORD, pos + 4, hi)
        if out:
            self.taken += len(out)
        return out

    def read_request(self, slot: int) -> Request:
        """Copy out and validate the request in ``slot``.  Raises RingError if malformed."""
        if type(slot) is not int or not 0 <= slot < self.n_slots:
            slot = self._check_slot(slot)
        off = self._slots_off + slot * self.slot_bytes
        mm = self._mm
        # One read of the header, into locals; everything below uses only these
        # (Python ints: no overflow), checked against the kernel's own slot size.
        call_id, op, json_len, n_tokens, flags = REQ_HDR.unpack_from(mm, off)
        room = self._req_room
        if json_len > room or n_tokens > room >> 2 or ((json_len + 7) & ~7) + 4 * n_tokens > room:
            raise RingError(f"slot {slot}: json_len {json_len} + {n_tokens} tokens do not fit "
                            f"the {self.slot_bytes}-byte slot")
        body = off + REQ_BODY_OFF
        json = mm[body:body + json_len]                        # bytes: a copy
        if n_tokens:
            t0 = body + ((json_len + 7) & ~7)
            tokens = np.frombuffer(mm[t0:t0 + 4 * n_tokens], "<i4")    # over a bytes copy: read-only
        else:
            tokens = NO_TOKENS
        return new_request((call_id, op, json, tokens, flags))

    # ------------------------------------------------------------ responding
    def arena(self, slot: int, rows: int, cols: int, dtype=np.float32) -> np.ndarray:
        """A writable (rows, cols) view of slot's arena region (bounds-checked).

        The LIP can write this memory too: the kernel only ever writes it, and never
        decides anything on what it reads back.
        """
        slot = self._check_slot(slot)
        dt = np.dtype(dtype)
        if not (isinstance(rows, (int, np.integer)) and isinstance(cols, (int, np.integer))) \
                or rows < 0 or cols < 0:
            raise ValueError("rows and cols must be ints >= 0")
        need = int(rows) * int(cols) * dt.itemsize
        if need > self.arena_bytes:
            raise ValueError(f"arena {rows}x{cols} {dt} needs {need} bytes > {self.arena_bytes}")
        return np.ndarray((int(rows), int(cols)), dtype=dt, buffer=self._mm,
                          offset=self._arena_off + slot * self.arena_bytes)

    def arena_range(self) -> tuple[int, int]:
        """(address, bytes) of all the slots' arenas in this process's mapping, one block."""
        return self._u8.ctypes.data + self._arena_off, self.n_slots * self.arena_bytes

    def topk_arena(self, slot: int, rows: int, k: int) -> TopK:
        """Writable views for a top-k reply in slot's arena: ids int32 [rows, k] and
        logprobs float32 [rows, k]; answer with ``respond(..., abi.ARENA_TOPK, 2 * rows, k)``."""
        words = self.arena(slot, 2 * rows, k, np.int32)     # [2*rows, k]: the ids, then the log-probs
        return TopK(words[:rows], words[rows:].view(np.float32))

    def respond(self, slot: int, call_id: int, status: int, json: bytes = b"",
                arena_kind: int = abi.ARENA_NONE, rows: int = 0, cols: int = 0) -> None:
        """Write the response into ``slot``, set RESPONSE, post the slot's semaphore."""
        if type(slot) is not int or not 0 <= slot < self.n_slots:
            slot = self._check_slot(slot)
        n = len(json)
        if n > self._resp_room:
            raise ValueError(f"response json of {n} bytes > {self._resp_room}")
        if not -0x80000000 <= status <= 0x7FFFFFFF:
            raise ValueError("status must fit in int32")
        if arena_kind:
            dt = ARENA_DTYPES.get(arena_kind)
            if dt is None:
                raise ValueError(f"unknown arena_kind {arena_kind}")
            if not (0 <= rows <= U32_MAX and 0 <= cols <= U32_MAX) or rows * cols * dt.itemsize > self.arena_bytes:
                raise ValueError(f"arena {rows}x{cols} does not fit {self.arena_bytes} bytes")
        else:
            rows = cols = 0
        mm = self._mm
        off = self._slots_off + slot * self.slot_bytes
        if n:
            mm[off + RESP_BODY_OFF:off + RESP_BODY_OFF + n] = json
        RESP_HDR.pack_into(mm, off, call_id & U64_MASK, status, n, arena_kind, rows, cols)
        if self._hinted[slot]:                 # the slot's next call starts with no hint
            self._hinted[slot] = False
            U64.pack_into(mm, self._hints_off + 8 * slot, 0)
        U32.pack_into(mm, self._st_lo + 4 * slot, RESPONSE)   # after the payload (TSO order)
        self._inflight[slot] = False
        try:
            self._sems[slot].release()         # full barrier; wakes the waiter if it blocks
        except OSError:
            pass                               # EOVERFLOW: the LIP saturated its own semaphore

    def hint(self, slot: int, eta_ns: int) -> bool:
        """Tell the LIP waiting on ``slot`` (BUSY: its call is on the device) that its answer is
        expected at ``eta_ns`` (CLOCK_MONOTONIC nanoseconds); `wake` it then, once, to read that:
        it waits actively from shortly before (layout.py, "hints").  False: the slot is not the
        kernel's (answered already) or the ring is gone."""
        if type(slot) is not int or not 0 <= slot < self.n_slots:
            slot = self._check_slot(slot)
        if not self._inflight[slot] or self._mm is None:
            return False
        U64.pack_into(self._mm, self._hints_off + 8 * slot, eta_ns & U64_MASK)
        self._hinted[slot] = True
        return True

    def wake(self, slot: int) -> None:
        """Post ``slot``'s semaphore while its call is still the kernel's (its waiter re-checks
        the state word, finds no answer, and reads its hint)."""
        slot = self._check_slot(slot)
        if self._inflight[slot] and self._sems:
            try:
                self._sems[slot].release()
            except (posix_ipc.Error, OSError):
                pass

    # ------------------------------------------------------------ teardown
    def mark_closed(self) -> None:
        """Set the header's ``closed`` flag and wake every waiter: their calls raise RingClosed."""
        self._closed = True
        if self._mm is not None and not self._mm.closed:
            struct.pack_into("<I", self._mm, CLOSED_OFF, 1)
        for s in self._sems:
            try:
                s.release()
            except (posix_ipc.Error, OSError):
                pass

    def close(self) -> None:
        """Unmap the segment, close the semaphores and the doorbell (this process only)."""
        self.detach()()

    def detach(self) -> Callable[[], None]:
        """The quick part of `close`: the ring is closed to this side (no more polling, its
        doorbell closed and out of the wait set); returns the slow part, unmapping the
        segment and closing the semaphores, for any thread to run once."""
        self._closed = True
        if self._waitset is not None:
            self._waitset.discard(self.bell_fd)
            self._waitset = None
        if self.bell_fd >= 0:
            try:
                os.close(self.bell_fd)
            except OSError:
                pass
            self.bell_fd = -1
        self._states = None
        self._u8 = None
        mm, sems, self._mm, self._sems = self._mm, self._sems, None, []

        def finish() -> None:
            unmap(mm)
            close_sems(sems)
        return finish

    def unlink(self) -> None:
        """Remove the segment and the slot semaphores' names.  Idempotent; never raises."""
        if self._seg_created:
            unlink_shm(self._seg_name)
        for name in self._sem_names:
            unlink_sem(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.unlink()

