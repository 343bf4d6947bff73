"""The system-call ring's layout: one shared-memory segment per LIP, plus POSIX semaphores.

The ring is four modules: this one (names, memory layout, slot state machine,
records), `wait` (doorbells, the kernel's WaitSet, spin-then-block),
`kernel_side` (KernelSide: the kernel's end, hostile input) and `lip_side`
(LipSide: the LIP's end, arena lifetime).  Op numbers, status codes and
arena kinds are declared in `abi`.

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
    | 8   version      u32  2
    | 12  n_slots      u32
    | 16  slot_bytes   u32  (multiple of 64)
    | 20  closed       u32  0, or 1 once the kernel tears the LIP down
    | 24  arena_bytes  u64  bytes per arena region (multiple of 64)
    | 32  states_off   u64  = 64
    | 40  slots_off    u64
    | 48  arena_off    u64
    | 56  total_bytes  u64
    64                          4 * n_slots          state array: one u32 per slot
    hints_off = align8(64 + 4*n_slots)
                                8 * n_slots          hints: one u64 per slot (below)
    slots_off = align64(hints_off + 8*n_slots)
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
             16  n_tokens u32                 16  arena_kind u32  abi.ARENA_*
             20  flags    u32                 20  arena_rows u32
             24  json bytes                   24  arena_cols u32
             24 + align8(json_len)            28  (pad)
                 n_tokens x int32             32  json bytes

A request fits iff ``24 + align8(json_len) + 4*n_tokens <= slot_bytes``; a
response body iff ``32 + json_len <= slot_bytes``; an arena result iff
``rows*cols*4 <= arena_bytes``.

A slot's hint is written by the kernel alone, while the slot is BUSY: when it
hands the slot's call to the device in a step it expects to end at a known time
and cores are spare for a LIP to wait actively, it stores that time (u64
nanoseconds of CLOCK_MONOTONIC, which every process on the machine shares) and
posts the slot's semaphore once.  A waiting LIP woken so reads the hint and
sleeps (a timed wait on the same semaphore, so an early response still wakes
it) until shortly before that time, then polls its state word: the response is
read without a wake-up on its path.  The kernel clears a hint with the answer
(before the state word); a LIP also ignores one older than its call.  The
kernel never reads hints back.

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
"""
from __future__ import annotations

import functools
import mmap
import re
import secrets
import struct
from typing import NamedTuple

import numpy as np
import posix_ipc

from . import abi

__all__ = [
    "FREE", "REQUEST", "BUSY", "RESPONSE", "HEADER_BYTES", "STATES_OFF", "REQ_BODY_OFF", "RESP_BODY_OFF",
    "RingError", "RingClosed", "Request", "Response", "TopK",
]

# ----------------------------------------------------------------- constants
MAGIC = b"SYMRING\0"
VERSION = 2

FREE, REQUEST, BUSY, RESPONSE = 0, 1, 2, 3

ARENA_DTYPES = {kind: np.dtype(dt) for kind, dt in abi.ARENA_DTYPES.items()}   # numpy dtype of each kind

HDR = struct.Struct("<8sIIIIQQQQQ")          # 64 bytes
REQ_HDR = struct.Struct("<QIIII")            # 24 bytes
RESP_HDR = struct.Struct("<QiIIII")          # 28 bytes
assert HDR.size == 64 and REQ_HDR.size == 24 and RESP_HDR.size == 28

HEADER_BYTES = 64
STATES_OFF = HEADER_BYTES
REQ_BODY_OFF = 24
RESP_BODY_OFF = 32
CLOSED_OFF = 20
REQUEST_WORD = struct.pack("<I", REQUEST)
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")

MAX_SLOTS = 4096
MAX_SLOT_BYTES = 1 << 30
MAX_ARENA_BYTES = 1 << 40
U32_MAX = (1 << 32) - 1
U64_MASK = (1 << 64) - 1
PREFIX_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


def align(n: int, a: int) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def hints_off(n_slots: int) -> int:
    """Where the slots' hints (one u64 each) start."""
    return align(STATES_OFF + 4 * n_slots, 8)


def geometry(n_slots: int, slot_bytes: int, arena_bytes: int) -> tuple[int, int, int]:
    """(slots_off, arena_off, total_bytes)."""
    slots_off = align(hints_off(n_slots) + 8 * n_slots, 64)
    arena_off = align(slots_off + n_slots * slot_bytes, 64)
    return slots_off, arena_off, arena_off + n_slots * arena_bytes


def new_name(prefix: str) -> str:
    """A fresh, unguessable POSIX name ``/{prefix}-{32 hex digits}``."""
    return f"/{prefix}-{secrets.token_hex(16)}"


def check_prefix(prefix: str) -> None:
    """ValueError unless ``prefix`` is 1-64 characters of [A-Za-z0-9_.]."""
    if not isinstance(prefix, str) or not PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must match {PREFIX_RE.pattern}, got {prefix!r}")


def unlink_shm(name: str) -> None:
    """Remove a segment's name; one already gone is fine."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def unlink_sem(name: str) -> None:
    """Remove a semaphore's name; one already gone is fine."""
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def map_segment(shm: posix_ipc.SharedMemory, size: int) -> mmap.mmap:
    """Map ``size`` bytes of ``shm`` and close its descriptor (the mapping keeps it alive)."""
    try:
        return mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()


def close_sems(sems: list) -> None:
    """Close every semaphore of ``sems`` (this process's handles; names stay)."""
    for s in sems:
        try:
            s.close()
        except posix_ipc.Error:
            pass


def unmap(mm: mmap.mmap | None) -> None:
    """Close a mapping; while NumPy views still hold it, it lives on until they go."""
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
    """A request as the kernel copied it out of a slot."""
    call_id: int
    op: int
    json: bytes
    tokens: np.ndarray   # int32, a private read-only copy
    flags: int


class TopK(NamedTuple):
    """The arena of an ``abi.ARENA_TOPK`` reply, split: two zero-copy views of it."""
    ids: np.ndarray        # int32 [rows, k], token ids, best first
    logprobs: np.ndarray   # float32 [rows, k], their log-probabilities


class Response(NamedTuple):
    """A reply as the LIP reads it from its slot."""
    status: int
    json: bytes
    arena: "np.ndarray | TopK | None"   # zero-copy read-only view(s) into the segment, or None


# tuple.__new__ skips the NamedTuple's Python-level __new__ (a hot path)
new_request = functools.partial(tuple.__new__, Request)
new_response = functools.partial(tuple.__new__, Response)
NO_TOKENS = np.empty(0, dtype=np.int32)      # shared, read-only: nothing to mutate
NO_TOKENS.flags.writeable = False
