"""The system-call ring: one shared-memory segment per LIP, plus POSIX semaphores.

A LIP (an untrusted program, a separate process) talks to the kernel process
through ONE shared-memory segment of its own.  The kernel creates it
(``KernelSide.create``) and hands the LIP a dict of names (``KernelSide.names``);
the LIP maps it (``LipSide.attach``) and makes calls from any number of threads
(``LipSide.call``).  The kernel serves all its LIPs from one thread: it sleeps in
a ``WaitSet`` (one epoll) on every LIP's *own* doorbell, an eventfd
(``KernelSide.bell_fd``, handed to the LIP as a file descriptor), which the LIP
rings after publishing a request, plus one private eventfd for its own commands.

Names
-----
Every shared-memory object and semaphore is named ``/{prefix}-{token}`` where
``token = secrets.token_hex(16)`` is drawn fresh for *each* object, so names are
unique per kernel instance and per LIP and cannot be guessed by another LIP.
All objects are created with ``O_CREX`` (never opening something a third party
planted) and mode ``0o600``.  Under Linux they appear in ``/dev/shm`` as
``{prefix}-{token}`` (segments) and ``sem.{prefix}-{token}`` (semaphores).

Memory layout (all integers little-endian)
------------------------------------------
::

    offset                      size                 contents
    0                           64                   header
    | 0   magic        8s   b"SYMRING\\0"
    | 8   version      u32  1
    | 12  n_slots      u32
    | 16  slot_bytes   u32  (multiple of 64)
    | 20  closed       u32  0, or 1 once the kernel tears the LIP down
    | 24  arena_bytes  u64  bytes per arena region (multiple of 64)
    | 32  states_off   u64  = 64
    | 40  slots_off    u64
    | 48  arena_off    u64
    | 56  total_bytes  u64
    64                          4 * n_slots          state array: one u32 per slot
    slots_off = align64(64 + 4*n_slots)
                                n_slots * slot_bytes slots; slot i at slots_off + i*slot_bytes
    arena_off = align64(slots_off + n_slots*slot_bytes)
                                n_slots * arena_bytes arena; region i (owned by slot i)
                                                     at arena_off + i*arena_bytes
    total_bytes = arena_off + n_slots*arena_bytes

Every slot and arena region starts on a 64-byte boundary (the mapping itself is
page-aligned), so float32 / int32 views of the arena are aligned.

A slot holds a request, and later the response written over it::

    request   0  call_id  u64        response  0  call_id    u64  (echoed)
              8  op       u32                  8  status     i32
             12  json_len u32                 12  json_len   u32
             16  n_tokens u32                 16  arena_kind u32  0 none, 1 f32, 2 i32
             20  flags    u32                 20  arena_rows u32
             24  json bytes                   24  arena_cols u32
             24 + align8(json_len)            28  (pad)
                 n_tokens x int32             32  json bytes

A request fits iff ``24 + align8(json_len) + 4*n_tokens <= slot_bytes``; a
response body iff ``32 + json_len <= slot_bytes``; an arena result iff
``rows*cols*4 <= arena_bytes``.

Slot state machine
------------------
::

            LIP: payload, then state            kernel: poll() takes it
    FREE(0) ------------------------> REQUEST(1) ---------------------> BUSY(2)
      ^        (then rings doorbell)                                      |
      |                                                                   | kernel: payload,
      |          LIP: copies the json out, then state                     | then state, then
      +-------------------------------------------------- RESPONSE(3) <---+ posts the slot sem

Every state has exactly one writer in the honest protocol: the LIP owns a slot
in FREE and RESPONSE (and writes REQUEST / FREE), the kernel owns it in REQUEST
and BUSY (and writes BUSY / RESPONSE).  A writer always stores the payload
(body, then header) *before* the state word, and a reader loads the state word
*before* the payload.  That ordering is sufficient because

* the stores are separate C calls (memcpy / ``struct.pack_into`` / a numpy
  store), which the compiler cannot reorder, and x86-64 is TSO: stores become
  visible to other cores in program order, and loads are not reordered with
  other loads.  The 4-byte state word is aligned, so its store is atomic.
* ``sem_post`` / ``sem_wait`` are full barriers (locked instructions), so a
  waiter woken by the semaphore sees everything written before the post.

Spin, then block
----------------
Both sides wait the same way: first spin, polling a cheap check (the kernel:
``ready()`` = "some LIP slot is in REQUEST"; the LIP: "my slot is in
RESPONSE") for up to ``spin_us`` microseconds; if that fails, block on the
semaphore / epoll.  The poster *always* posts (the LIP always rings its doorbell, the
kernel always posts the slot semaphore): a conditional "post only if the
waiter sleeps" protocol would need a store-load fence that Python cannot
issue, and would lose wakeups.  The price is stale posts when the spin wins:

* the kernel's ``WaitSet.wait`` returns on any bell's edge (the epoll is
  edge-triggered: every write to an eventfd is one wake-up, nothing is read or
  drained), and the caller polls *after* that, so the request stored before
  the ring is seen by that poll; a stale ring costs one spurious poll;
* the LIP, after a winning spin, takes at most one pending post off its slot
  semaphore; one that arrives later stays, and is harmless because after *every*
  wakeup the waiter re-checks the state word and goes back to sleep unless it
  reads RESPONSE.  A stale post never passes for a response.

Each spin iteration calls ``sched_yield()``: on a 2-core box shared with other
work, a spinner that does not yield sits on the very core its peer needs (a
measured 75-125 us round trip instead of ~20), and the yield also drops the
GIL for the spinner's sibling threads.

The spin budget adapts (``_Spin``): a spin that wins, or a block woken within
the maximum budget (a longer spin would have won), grows it (x2 + 1 us); two
failed spins in a row (the block then waited longer, or timed out) halve it,
to 0 below 1 us; at 0, every 8th wait probes with a full-budget spin so the
budget can recover after a burst of load.  A LIP thread spins only while it is
the sole call in flight in its process (a spinning thread holds the GIL its
sibling threads need).  An idle kernel is blocked in ``epoll_wait``: it
burns no CPU.

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

Hostile input (kernel side)
---------------------------
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
  bodies are *copied* out (``bytes``, a fresh int32 array) before use, so later
  scribbling cannot change what the kernel validated;
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

Arena lifetime (LIP side)
-------------------------
``Response.arena`` is a zero-copy, read-only NumPy view into arena region i of
the slot the call used.  A thread keeps reusing "its" slot, so that view stays
valid until *the same thread's* next call.  Only when more threads than slots
use the ring is the slot of the thread idle longest taken over by another
thread, which overwrites that arena: copy (``arena.copy()``) results you keep.
"""
from __future__ import annotations

import functools
import itertools
import mmap
import os
import re
import secrets
import select
import struct
import threading
import time
from typing import NamedTuple

import numpy as np
import posix_ipc

__all__ = [
    "FREE", "REQUEST", "BUSY", "RESPONSE",
    "ARENA_NONE", "ARENA_F32", "ARENA_I32",
    "RingError", "RingClosed", "Request", "Response",
    "KernelSide", "LipSide", "WaitSet", "new_bell", "ring_bell",
]

# ----------------------------------------------------------------- constants
MAGIC = b"SYMRING\0"
VERSION = 1

FREE, REQUEST, BUSY, RESPONSE = 0, 1, 2, 3

ARENA_NONE, ARENA_F32, ARENA_I32 = 0, 1, 2
_ARENA_DTYPES = {ARENA_F32: np.dtype("<f4"), ARENA_I32: np.dtype("<i4")}

_HDR = struct.Struct("<8sIIIIQQQQQ")          # 64 bytes
_REQ_HDR = struct.Struct("<QIIII")            # 24 bytes
_RESP_HDR = struct.Struct("<QiIIII")          # 28 bytes
assert _HDR.size == 64 and _REQ_HDR.size == 24 and _RESP_HDR.size == 28

HEADER_BYTES = 64
STATES_OFF = HEADER_BYTES
REQ_BODY_OFF = 24
RESP_BODY_OFF = 32
_CLOSED_OFF = 20
_REQUEST_WORD = struct.pack("<I", REQUEST)
_U32 = struct.Struct("<I")

_MAX_SLOTS = 4096
_MAX_SLOT_BYTES = 1 << 30
_MAX_ARENA_BYTES = 1 << 40
_U32_MAX = (1 << 32) - 1
_U64 = (1 << 64) - 1
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")

_BLOCK_CHUNK_S = 0.5   # a blocked LIP re-checks `closed` at least this often


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _geometry(n_slots: int, slot_bytes: int, arena_bytes: int) -> tuple[int, int, int]:
    """(slots_off, arena_off, total_bytes)."""
    slots_off = _align(STATES_OFF + 4 * n_slots, 64)
    arena_off = _align(slots_off + n_slots * slot_bytes, 64)
    return slots_off, arena_off, arena_off + n_slots * arena_bytes


def _new_name(prefix: str) -> str:
    return f"/{prefix}-{secrets.token_hex(16)}"


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")


def _unlink_shm(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def _unlink_sem(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def _map(shm: posix_ipc.SharedMemory, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()


def _unmap(mm: mmap.mmap | None) -> None:
    if mm is None:
        return
    try:
        mm.close()
    except BufferError:
        # Someone still holds a NumPy view into the segment; the mapping goes away
        # when the last view does.
        pass


# ----------------------------------------------------------------- errors, records
class RingError(Exception):
    """A malformed ring entry (bad lengths, bad header, unexpected call id)."""


class RingClosed(Exception):
    """The kernel has closed this LIP's ring (or the LIP closed its side)."""


class Request(NamedTuple):
    call_id: int
    op: int
    json: bytes
    tokens: np.ndarray   # int32, a private copy
    flags: int


class Response(NamedTuple):
    status: int
    json: bytes
    arena: np.ndarray | None   # zero-copy read-only view into the segment, or None


# tuple.__new__ skips the NamedTuple's Python-level __new__ (a hot path)
_new_request = functools.partial(tuple.__new__, Request)
_new_response = functools.partial(tuple.__new__, Response)
_NO_TOKENS = np.empty(0, dtype=np.int32)      # shared, read-only: nothing to mutate
_NO_TOKENS.flags.writeable = False


# ----------------------------------------------------------------- adaptive spin
_sched_yield = getattr(os, "sched_yield", lambda: None)   # releases the GIL, too
_eventfd_write = os.eventfd_write


def _noop() -> None:
    pass


class _Spin:
    """An adaptive spin budget in nanoseconds, in [0, max_ns].

    ``budget()`` is what the next wait spins for; the wait then reports ``won(used)``
    (the condition came true while spinning) or ``blocked(used, waited_ns, woken)``.

    * a win grows the budget (x2 + 1 us, up to max);
    * a block woken within max_ns of the start of the wait grows it too (a longer
      spin would have won);
    * otherwise the spin failed: two failures in a row halve it, to 0 below 1 us;
    * at 0, every ``PROBE_EVERY``-th wait spins the full max_ns as a probe, so a
      budget that collapsed under a burst of load can come back.
    """

    PROBE_EVERY = 8
    __slots__ = ("max_ns", "cur_ns", "adaptive", "yield_cpu", "_fails", "_skipped")

    def __init__(self, spin_us: float, adaptive: bool = True, yield_cpu: bool = True):
        if spin_us < 0:
            raise ValueError("spin_us must be >= 0")
        self.max_ns = int(spin_us * 1000)
        self.cur_ns = self.max_ns
        self.adaptive = adaptive
        self.yield_cpu = yield_cpu
        self._fails = 0
        self._skipped = 0

    def budget(self) -> int:
        if self.cur_ns or not self.adaptive or not self.max_ns:
            return self.cur_ns
        self._skipped += 1
        if self._skipped >= self.PROBE_EVERY:
            self._skipped = 0
            return self.max_ns
        return 0

    def _grow(self, used: int) -> None:
        self._fails = 0
        self.cur_ns = min(self.max_ns, 2 * max(self.cur_ns, used) + 1000)

    def won(self, used: int) -> None:
        if self.adaptive:
            self._grow(used)

    def blocked(self, used: int, waited_ns: int, woken: bool) -> None:
        if not self.adaptive or not self.max_ns:
            return
        if woken and waited_ns <= self.max_ns:
            self._grow(used)
        elif used:
            self._fails += 1
            if self._fails >= 2:
                c = self.cur_ns // 2
                self.cur_ns = c if c >= 1000 else 0


# ----------------------------------------------------------------- doorbells
_EV_IN = select.EPOLLIN | select.EPOLLET


def new_bell() -> int:
    """A fresh doorbell: a non-blocking, close-on-exec eventfd (counter 0)."""
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def ring_bell(fd: int) -> None:
    """Add 1 to the eventfd ``fd``; a saturated counter (EAGAIN) is already rung."""
    try:
        _eventfd_write(fd, 1)
    except (BlockingIOError, OSError):
        pass


class _Bell:
    __slots__ = ("ring", "fd", "seen", "strikes", "level")

    def __init__(self, ring: "KernelSide"):
        self.ring, self.fd = ring, ring.bell_fd
        self.seen = ring.taken      # requests taken when this bell was last checked
        self.strikes = 0            # consecutive rings that brought no request
        self.level = 0              # how many mutes in a row (each twice as long)


class WaitSet:
    """The kernel's wake-up channel: its own private eventfd (``ring()``, for its
    own commands) plus every LIP's *own* doorbell eventfd (``KernelSide.bell_fd``),
    all watched by one edge-triggered epoll.

    ``wait(timeout, ready)`` spins on ``ready()`` for up to the (adaptive) spin
    budget, then blocks in ``epoll_wait``; call ``ready`` / poll the rings *after*
    it returns.  The kernel never reads a LIP's eventfd (edge-triggered epoll
    reports every write without a read), so no value a LIP stores there, nor its
    reading it, nor making it blocking, can block or confuse the kernel: it only
    decides whether *that* LIP's bell wakes the kernel.  A bell that rings
    ``MUTE_AFTER`` times in a row with no request in its ring and none taken since
    its last ring is muted (left out of the epoll set) for ``MUTE_S`` seconds,
    doubling per repeat up to ``MUTE_MAX_S``: that LIP's calls are then seen by the
    spin and the periodic poll only, which delays nobody else.
    """

    MUTE_AFTER = 32
    MUTE_S = 0.02
    MUTE_MAX_S = 0.5

    def __init__(self, spin_us: float = 50.0, adaptive: bool = True):
        self._ep = select.epoll()
        self._own = new_bell()
        self._ep.register(self._own, _EV_IN)
        self._lock = threading.Lock()
        self._bells: dict[int, _Bell] = {}
        self._muted: dict[int, float] = {}        # fd -> monotonic time to unmute
        self.mutes = 0                            # bells muted so far (statistics)
        self.spin = _Spin(spin_us, adaptive)

    @property
    def spin_us(self) -> float:
        """The current spin budget, in microseconds."""
        return self.spin.cur_ns / 1000.0

    def ring(self) -> None:
        """Wake the waiter (the kernel's own commands; any thread)."""
        ring_bell(self._own)

    def add(self, ring: "KernelSide") -> None:
        """Watch ``ring``'s doorbell (KernelSide.create does this)."""
        b = _Bell(ring)
        with self._lock:
            self._bells[b.fd] = b
            self._ep.register(b.fd, _EV_IN)

    def discard(self, ring: "KernelSide") -> None:
        """Stop watching ``ring``'s doorbell (KernelSide.close does this)."""
        with self._lock:
            b = self._bells.get(ring.bell_fd)
            if b is None or b.ring is not ring:
                return
            del self._bells[b.fd]
            self._muted.pop(b.fd, None)
            try:
                self._ep.unregister(b.fd)
            except (OSError, ValueError):
                pass

    def _unmute(self, now: float) -> float | None:
        """Re-arm bells whose mute is over; the next unmute time, or None."""
        nxt = None
        for fd, until in list(self._muted.items()):
            if until <= now:
                del self._muted[fd]
                try:
                    self._ep.modify(fd, _EV_IN)     # fires at once if written meanwhile
                except (OSError, ValueError):
                    pass
            elif nxt is None or until < nxt:
                nxt = until
        return nxt

    def _check(self, b: _Bell, now: float) -> None:
        r = b.ring
        if r.taken != b.seen or r.pending():
            b.seen, b.strikes, b.level = r.taken, 0, 0
            return
        b.strikes += 1
        if b.strikes >= self.MUTE_AFTER:
            b.strikes = 0
            self._muted[b.fd] = now + min(self.MUTE_MAX_S, self.MUTE_S * (1 << min(b.level, 16)))
            b.level += 1
            self.mutes += 1
            try:
                self._ep.modify(b.fd, 0)
            except (OSError, ValueError):
                pass

    def wait(self, timeout: float | None = None, ready=None) -> bool:
        """Wait for work.  True if ``ready()`` turned true or a bell rang; False on timeout.

        ``timeout`` None blocks forever; ``ready`` None skips the spin phase.
        """
        spin = self.spin
        t0 = time.perf_counter_ns()
        budget = 0
        if ready is not None:
            if ready():
                return True
            budget = spin.budget()
            if budget:
                end = t0 + budget
                pc = time.perf_counter_ns
                yld = _sched_yield if spin.yield_cpu else _noop
                while pc() < end:
                    if ready():
                        spin.won(budget)
                        return True
                    yld()
        now = time.monotonic()
        deadline = None if timeout is None else now + max(0.0, timeout)
        while True:                                # re-arm muted bells as their time comes
            with self._lock:
                nxt = self._unmute(now) if self._muted else None
            t = -1 if deadline is None else max(0.0, deadline - now)
            if nxt is not None:
                t = nxt - now if t < 0 else min(t, nxt - now)
            events = self._ep.poll(t)
            now = time.monotonic()
            if events or nxt is None or (deadline is not None and now >= deadline):
                break
        woken = bool(events)
        if events:
            with self._lock:
                for fd, _ in events:
                    b = self._bells.get(fd)
                    if b is not None:
                        self._check(b, now)
        if ready is not None:
            spin.blocked(budget, time.perf_counter_ns() - t0, woken)
        if woken:
            return True
        return bool(ready()) if ready is not None else False

    def close(self) -> None:
        """Close the epoll and the private eventfd (the LIPs' bells belong to their rings)."""
        for fd in (self._ep, self._own):
            try:
                fd.close() if fd is self._ep else os.close(fd)
            except OSError:
                pass


# ----------------------------------------------------------------- kernel side
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
        _check_prefix(prefix)
        if not isinstance(n_slots, int) or not 1 <= n_slots <= _MAX_SLOTS:
            raise ValueError(f"n_slots must be an int in [1, {_MAX_SLOTS}]")
        if not isinstance(slot_bytes, int) or not 64 <= slot_bytes <= _MAX_SLOT_BYTES:
            raise ValueError(f"slot_bytes must be an int in [64, {_MAX_SLOT_BYTES}]")
        if not isinstance(arena_bytes, int) or not 0 <= arena_bytes <= _MAX_ARENA_BYTES:
            raise ValueError("arena_bytes must be an int >= 0")
        slot_bytes = _align(slot_bytes, 64)
        arena_bytes = _align(arena_bytes, 64)
        slots_off, arena_off, total = _geometry(n_slots, slot_bytes, arena_bytes)

        self = object.__new__(cls)
        self.n_slots, self.slot_bytes, self.arena_bytes = n_slots, slot_bytes, arena_bytes
        self._slots_off, self._arena_off, self.total_bytes = slots_off, arena_off, total
        self._mm = None
        self._states = None
        self._sems: list[posix_ipc.Semaphore] = []
        self._closed = False
        self._inflight = [False] * n_slots
        self._seg_name = _new_name(prefix)
        self._seg_created = False          # unlink only what this instance created
        self._sem_names: list[str] = []
        self.taken = 0                     # requests poll() has taken (WaitSet's bell check)
        self.bell_fd = -1
        self._waitset = None
        try:
            self.bell_fd = new_bell()
            shm = posix_ipc.SharedMemory(self._seg_name, posix_ipc.O_CREX, mode=0o600, size=total)
            self._seg_created = True
            self._mm = _map(shm, total)
            for _ in range(n_slots):
                name = _new_name(prefix)
                self._sems.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
                self._sem_names.append(name)
        except BaseException:
            self.close()
            self.unlink()
            raise
        _HDR.pack_into(self._mm, 0, MAGIC, VERSION, n_slots, slot_bytes, 0, arena_bytes,
                       STATES_OFF, slots_off, arena_off, total)
        self._states = np.ndarray((n_slots,), dtype="<u4", buffer=self._mm, offset=STATES_OFF)
        self._u8 = np.ndarray((total,), dtype=np.uint8, buffer=self._mm)
        self._st_lo, self._st_hi = STATES_OFF, STATES_OFF + 4 * n_slots
        self._req_room = slot_bytes - REQ_BODY_OFF
        self._resp_room = slot_bytes - RESP_BODY_OFF
        if waitset is not None:
            waitset.add(self)
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
    def pending(self) -> bool:
        """Cheap check: is some slot in REQUEST that the kernel has not taken?"""
        if self._closed:
            return False
        # A C-speed byte search for the REQUEST word; unaligned hits are skipped.
        find, lo, hi, inflight = self._mm.find, self._st_lo, self._st_hi, self._inflight
        pos = find(_REQUEST_WORD, lo, hi)
        while pos >= 0:
            rel = pos - lo
            if not rel & 3 and not inflight[rel >> 2]:
                return True
            pos = find(_REQUEST_WORD, pos + 1, hi)
        return False

    def poll(self) -> list[int]:
        """Slots in REQUEST state; each is marked BUSY and is the kernel's until respond()."""
        out = []
        if self._closed:
            return out
        mm, lo, hi, inflight = self._mm, self._st_lo, self._st_hi, self._inflight
        find = mm.find
        pos = find(_REQUEST_WORD, lo, hi)
        while pos >= 0:
            rel = pos - lo
            if rel & 3:
                pos = find(_REQUEST_WORD, pos + 1, hi)
                continue
            i = rel >> 2
            if not inflight[i]:           # else a LIP re-flipped a slot the kernel holds
                inflight[i] = True
                _U32.pack_into(mm, pos, BUSY)
                out.append(i)
            pos = find(_REQUEST_WORD, pos + 4, hi)
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
        call_id, op, json_len, n_tokens, flags = _REQ_HDR.unpack_from(mm, off)
        room = self._req_room
        if json_len > room or n_tokens > room >> 2 or ((json_len + 7) & ~7) + 4 * n_tokens > room:
            raise RingError(f"slot {slot}: json_len {json_len} + {n_tokens} tokens do not fit "
                            f"the {self.slot_bytes}-byte slot")
        body = off + REQ_BODY_OFF
        json = mm[body:body + json_len]                        # bytes: a copy
        if n_tokens:
            t0 = body + ((json_len + 7) & ~7)
            tokens = self._u8[t0:t0 + 4 * n_tokens].view("<i4").astype(np.int32, copy=True)
        else:
            tokens = _NO_TOKENS
        return _new_request((call_id, op, json, tokens, flags))

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

    def respond(self, slot: int, call_id: int, status: int, json: bytes = b"",
                arena_kind: int = ARENA_NONE, rows: int = 0, cols: int = 0) -> None:
        """Write the response into ``slot``, set RESPONSE, post the slot's semaphore."""
        if type(slot) is not int or not 0 <= slot < self.n_slots:
            slot = self._check_slot(slot)
        n = len(json)
        if n > self._resp_room:
            raise ValueError(f"response json of {n} bytes > {self._resp_room}")
        if not -0x80000000 <= status <= 0x7FFFFFFF:
            raise ValueError("status must fit in int32")
        if arena_kind:
            dt = _ARENA_DTYPES.get(arena_kind)
            if dt is None:
                raise ValueError(f"unknown arena_kind {arena_kind}")
            if not (0 <= rows <= _U32_MAX and 0 <= cols <= _U32_MAX) or rows * cols * dt.itemsize > self.arena_bytes:
                raise ValueError(f"arena {rows}x{cols} does not fit {self.arena_bytes} bytes")
        else:
            rows = cols = 0
        mm = self._mm
        off = self._slots_off + slot * self.slot_bytes
        if n:
            mm[off + RESP_BODY_OFF:off + RESP_BODY_OFF + n] = json
        _RESP_HDR.pack_into(mm, off, call_id & _U64, status, n, arena_kind, rows, cols)
        _U32.pack_into(mm, self._st_lo + 4 * slot, RESPONSE)   # after the payload (TSO order)
        self._inflight[slot] = False
        try:
            self._sems[slot].release()         # full barrier; wakes the waiter if it blocks
        except OSError:
            pass                               # EOVERFLOW: the LIP saturated its own semaphore

    # ------------------------------------------------------------ teardown
    def mark_closed(self) -> None:
        """Set the header's ``closed`` flag and wake every waiter: their calls raise RingClosed."""
        self._closed = True
        if self._mm is not None and not self._mm.closed:
            struct.pack_into("<I", self._mm, _CLOSED_OFF, 1)
        for s in self._sems:
            try:
                s.release()
            except (posix_ipc.Error, OSError):
                pass

    def close(self) -> None:
        """Unmap the segment, close the semaphores and the doorbell (this process only)."""
        self._closed = True
        if self._waitset is not None:
            self._waitset.discard(self)
            self._waitset = None
        if self.bell_fd >= 0:
            try:
                os.close(self.bell_fd)
            except OSError:
                pass
            self.bell_fd = -1
        self._states = None
        self._u8 = None
        _unmap(self._mm)
        self._mm = None
        for s in self._sems:
            try:
                s.close()
            except posix_ipc.Error:
                pass

    def unlink(self) -> None:
        """Remove the segment and the slot semaphores' names.  Idempotent; never raises."""
        if self._seg_created:
            _unlink_shm(self._seg_name)
        for name in self._sem_names:
            _unlink_sem(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.unlink()


# ----------------------------------------------------------------- LIP side
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
            self._mm = _map(shm, size)
            if size < HEADER_BYTES:
                raise RingError("segment smaller than its header")
            (magic, version, n_slots, slot_bytes, _closed, arena_bytes,
             states_off, slots_off, arena_off, total) = _HDR.unpack_from(self._mm, 0)
            if magic != MAGIC or version != VERSION:
                raise RingError(f"bad magic/version {magic!r}/{version}")
            if not (1 <= n_slots <= _MAX_SLOTS and 64 <= slot_bytes <= _MAX_SLOT_BYTES
                    and slot_bytes % 64 == 0 and arena_bytes % 64 == 0
                    and (states_off, slots_off, arena_off, total)
                    == (STATES_OFF, *_geometry(n_slots, slot_bytes, arena_bytes))
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
        self._by_owner: dict[int, _Slot] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._tick = 0
        self._ids = itertools.count(1)
        self._n_inflight = 0
        self._n_waiting = 0
        self._local_closed = False
        self.spin = _Spin(spin_us, adaptive)
        return self

    # ------------------------------------------------------------ info
    @property
    def closed(self) -> bool:
        return self._local_closed or _U32.unpack_from(self._mm, _CLOSED_OFF)[0] != 0

    @property
    def buffer(self) -> mmap.mmap:
        """The mapped segment (e.g. for np.shares_memory checks)."""
        return self._mm

    def max_tokens(self, json_len: int = 0) -> int:
        """The most tokens a request with json_len bytes of json can carry."""
        return max(0, (self.slot_bytes - REQ_BODY_OFF - _align(json_len, 8)) // 4)

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
        if _U32.unpack_from(self._mm, s.st_off)[0] == RESPONSE:   # the late answer: discard it
            _U32.pack_into(self._mm, s.st_off, FREE)
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
        if not (0 <= op <= _U32_MAX and 0 <= flags <= _U32_MAX):
            raise ValueError("op and flags must fit in u32")
        mm = self._mm
        if self._local_closed or mm is None or _U32.unpack_from(mm, _CLOSED_OFF)[0]:
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
            _REQ_HDR.pack_into(mm, off, call_id, op, jl, nt, flags)
            _U32.pack_into(mm, s.st_off, REQUEST)     # after the payload
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
        unpack = _U32.unpack_from
        spin = self.spin
        pc = time.perf_counter_ns
        t0 = pc()
        solo = self._n_inflight == 1             # only spin while no sibling thread needs the GIL
        budget = spin.budget() if solo else 0
        if budget:
            end = t0 + budget
            yld = _sched_yield if spin.yield_cpu else _noop
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
        while unpack(mm, st_off)[0] != RESPONSE:  # re-checked after every wakeup: stale posts
            if self.closed:
                raise RingClosed("ring closed")
            chunk = _BLOCK_CHUNK_S
            if deadline is not None:
                left = (deadline - pc()) / 1e9
                if left <= 0:
                    with self._lock:
                        s.lost = True
                    raise TimeoutError(f"no answer to the call in slot {s.idx} after {timeout} s")
                chunk = min(chunk, left)
            try:
                sem.acquire(chunk)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass
        if solo:
            spin.blocked(budget, pc() - t0, True)

    def _read_response(self, s: _Slot, call_id: int) -> Response:
        mm, off = self._mm, s.off
        try:
            rid, status, jl, kind, rows, cols = _RESP_HDR.unpack_from(mm, off)
            if rid != call_id:
                raise RingError(f"slot {s.idx}: response for call {rid}, expected {call_id}")
            if jl > self.slot_bytes - RESP_BODY_OFF:
                raise RingError(f"slot {s.idx}: response json_len {jl} too large")
            json = mm[off + RESP_BODY_OFF:off + RESP_BODY_OFF + jl]
            if kind:
                dt = _ARENA_DTYPES.get(kind)
                if dt is None or rows * cols * dt.itemsize > self.arena_bytes:
                    raise RingError(f"slot {s.idx}: bad arena {kind} {rows}x{cols}")
                arena = np.ndarray((rows, cols), dtype=dt, buffer=mm,
                                   offset=self._arena_off + s.idx * self.arena_bytes)
                arena.flags.writeable = False
            else:
                arena = None
        finally:
            _U32.pack_into(mm, s.st_off, FREE)
        return _new_response((status, json, arena))

    # ------------------------------------------------------------ teardown
    def _mm_close(self) -> None:
        _unmap(self._mm)
        self._mm = None
        for sem in self._sems:
            try:
                sem.close()
            except posix_ipc.Error:
                pass
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
