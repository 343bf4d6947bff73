"""Answering a LIP's system call: a reply, an error, or -- when even that cannot
be written -- the LIP's end.

`Answers` is a part of `SyscallServer` (the syscall thread's), given the one
thing it needs in its constructor: how to ask for a LIP's end (``kill``).
`reply` writes a body into the call's slot, or keeps one larger than a slot
for the LIP to FETCH (replies.py); `error` writes an error, its message cut
to a bounded size (and its control characters escaped), so it always fits;
`lost` kills a LIP whose call cannot be answered at all (its thread would
wait forever).  None of them raises.
"""
from __future__ import annotations

import logging
from typing import Callable

import orjson

from symphony.engine.tp.group import TPFailure
from symphony.engine.engine import PredError
from symphony.engine.page_allocator import OutOfPages
from symphony.engine.sampler import SamplingError
from symphony.ipc import abi
from symphony.ipc.layout import RESP_BODY_OFF
from symphony.kvfs import KVFSError

from symphony.kernel.escape import printable
from symphony.kernel.failure import SyscallFailure, fail as _fail
from symphony.kernel.syscall.proc import Serving
from symphony.kernel.syscall.replies import truncate_message

log = logging.getLogger("symphony.syscalls")


class Answers:
    """Replies and errors to the LIPs' calls; ``kill(lip_id, reason)`` asks the
    event loop to end a LIP."""

    def __init__(self, kill: Callable[[int, str], None]):
        self.kill = kill

    def reply(self, lip, slot, call_id, body: dict, arena=(abi.ARENA_NONE, 0, 0)) -> None:
        """Answer a call with ``body``.  A body larger than the slot is kept for
        the LIP to FETCH in chunks (see replies.py); if even that fails, the
        call is answered with the error.  Never raises."""
        if lip.state not in (Serving.RUNNING, Serving.KILLING):
            return
        try:
            data = orjson.dumps(body)
            room = lip.ring.slot_bytes - RESP_BODY_OFF
            if len(data) > room:
                if arena[0] != abi.ARENA_NONE:
                    _fail("SyscallError", "EIO", f"a reply of {len(data)} bytes with an arena does not fit a slot")
                try:
                    rid = lip.replies.put(data)
                except OverflowError as e:
                    _fail("NoSpace", "ENOBUFS", str(e))
                lip.ring.respond(slot, call_id, abi.CHUNKED, orjson.dumps({"chunked": rid, "size": len(data)}))
                return
            lip.ring.respond(slot, call_id, abi.OK, data, *arena)
        except Exception as e:
            self.error(lip, slot, call_id, e)

    def error(self, lip, slot, call_id, e: BaseException) -> None:
        """Answer a call with the error ``e``; its message is cut to a bounded
        size, so it always fits the slot.  Never raises."""
        try:
            if isinstance(e, SyscallFailure):
                t, code, msg = e.type, e.code, str(e)
            elif isinstance(e, KVFSError):
                t, code, msg = type(e).__name__, e.code, str(e)
            elif isinstance(e, PredError):
                t, code, msg = "PredError", "EINVAL", str(e)
            elif isinstance(e, SamplingError):              # a sampling the device refused
                t, code, msg = "InvalidArgument", "EINVAL", str(e)
            elif isinstance(e, OutOfPages):
                t, code, msg = "NoSpace", "ENOSPC", str(e)
            elif isinstance(e, TPFailure):                  # the kernel is shutting down: say why
                t, code, msg = "SyscallError", "EIO", f"the model cannot run: {e}"
            else:
                log.error("LIP %d: system call failed unexpectedly", lip.id, exc_info=e)
                t, code, msg = "SyscallError", "EIO", f"internal error: {type(e).__name__}: {e}"
            if lip.state in (Serving.RUNNING, Serving.KILLING):
                body = {"error": str(code)[:32], "type": str(t)[:64], "message": truncate_message(printable(msg))}
                lip.ring.respond(slot, call_id, abi.ERR, orjson.dumps(body))
        except Exception as e2:
            self.lost(lip, slot, call_id, e2)

    def lost(self, lip, slot, call_id, e: BaseException) -> None:
        """A call could not be answered at all: its thread would wait forever, so
        the LIP is killed (a torn-down LIP is simply forgotten)."""
        try:
            if lip.state == Serving.RUNNING:
                log.error("LIP %d: no reply could be written to slot %s (call %s): %r", lip.id, slot, call_id, e)
                lip.state = Serving.KILLING
                self.kill(lip.id, "killed: a system call reply could not be written")
        except Exception:
            log.exception("LIP %d: could not be failed", getattr(lip, "id", -1))
