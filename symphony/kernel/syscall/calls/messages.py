"""Messages between a LIP and its client: send and write_stream (output, with
back-pressure), recv (input), and fetch (the next chunk of a reply too large
for a slot, replies.py)."""
from __future__ import annotations

import time
from typing import Callable

import orjson

from symphony.ipc import abi
from symphony.ipc.layout import RESP_BODY_OFF
from symphony.ipc.protocol import encode_frame

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.failure import fail as _fail
from symphony.kernel.loop.inflow import input_bytes
from symphony.kernel.syscall.proc import LipProc, ServedLips, Serving

MAX_MESSAGE_BYTES = 1 << 20
MAX_QUEUED_OUTPUT = 1 << 20     # per LIP: output bytes not yet taken by its client before send() waits


class MessageCalls:
    """Output, input and chunked replies.  Given the served LIPs, the answers,
    ``emit(lip_id, event)`` (output to the client, via the event loop),
    ``on_input_read(lip_id, n)`` (a recv() took n bytes of input) and the
    output bytes a LIP may have queued before send() waits."""

    OPS = {abi.SEND: "send", abi.WRITE_STREAM: "write_stream", abi.RECV: "recv", abi.FETCH: "fetch"}
    ANYTIME = set(OPS)          # served while a step is on the device: they touch no KV page

    def __init__(self, lips: ServedLips, answers: Answers, emit: Callable[[int, dict], None],
                 on_input_read: Callable[[int, int], None], max_queued_output: int = MAX_QUEUED_OUTPUT):
        self.lips, self.answers, self.emit = lips, answers, emit
        self.on_input_read, self.max_queued_output = on_input_read, max_queued_output

    # ------------------------------------------------------------------ output
    def send(self, lip, slot, cid, body, toks):
        data = body.data
        if len(orjson.dumps(data)) > MAX_MESSAGE_BYTES:
            _fail("InvalidArgument", "EINVAL", f"message larger than {MAX_MESSAGE_BYTES} bytes")
        return self._emit_output(lip, slot, cid, {"event": "out", "data": data})

    def write_stream(self, lip, slot, cid, body, toks):
        return self._emit_output(lip, slot, cid, {"event": body.stream, "data": body.data[:MAX_MESSAGE_BYTES]})

    def credit_output(self, lip_id: int, n: int) -> None:
        """The event loop says ``n`` bytes of the LIP's output left the kernel
        (taken by the client, or dropped): wake parked senders if there is room."""
        lip = self.lips.get(lip_id)
        if lip is None:
            return
        lip.out_bytes = max(0, lip.out_bytes - n)
        while lip.parked_out and lip.out_bytes <= self.max_queued_output:
            slot, cid = lip.parked_out.popleft()
            self.answers.reply(lip, slot, cid, {})

    def _emit_output(self, lip, slot, cid, event: dict):
        """Hand ``event`` to the client and count its bytes as queued; past
        ``max_queued_output`` the call waits (parked, like recv) until the
        client has taken enough (`credit_output`)."""
        lip.out_bytes += len(encode_frame(event))      # the event loop credits the same frame size back
        self.emit(lip.id, event)
        if lip.out_bytes > self.max_queued_output:
            lip.parked_out.append((slot, cid))
            lip.blocked_since = time.monotonic()
            return None
        return {}

    # ------------------------------------------------------------------ input
    def recv(self, lip, slot, cid, body, toks):
        if lip.parked_recv is not None:
            _fail("InvalidArgument", "EBUSY", "another thread of this LIP is already in recv()")
        lip.parked_recv = (slot, cid)
        lip.blocked_since = time.monotonic()
        self.serve_recv(lip)
        return None

    def serve_recv(self, lip: LipProc) -> None:
        """Answer the LIP's parked recv() if input (or its end) is there."""
        if lip.parked_recv is None or not (lip.inbox or lip.eof):
            return
        slot, cid = lip.parked_recv
        lip.parked_recv = None
        if not lip.inbox:
            self.answers.reply(lip, slot, cid, {"eof": True})
            return
        data = lip.inbox.popleft()
        self.on_input_read(lip.id, input_bytes(data))     # its sender may send more (inflow.py)
        self.answers.reply(lip, slot, cid, {"data": data})

    # ------------------------------------------------------------------ chunked replies
    def fetch(self, lip, slot, cid, body, toks):
        """The next chunk of a reply too large for a slot: raw bytes, not JSON."""
        try:
            chunk = lip.replies.take(body.id, body.offset, lip.ring.slot_bytes - RESP_BODY_OFF)
        except (KeyError, IndexError) as e:
            _fail("InvalidArgument", "EINVAL", f"fetch: {e.args[0]}")
        if lip.state in (Serving.RUNNING, Serving.KILLING):
            lip.ring.respond(slot, cid, abi.OK, chunk)
        return None
