"""The capability calls (http, read_file, list_dir): run on the capability
pool (policy, per-LIP share, deadline: see kernel/capabilities/), answered
from the syscall thread."""
from __future__ import annotations

import time
from typing import Callable

import msgspec

from symphony.ipc import abi

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.capabilities import Capabilities


class CapCalls:
    """Capability calls; given the capabilities, the answers, and ``submit``
    (runs a function on the syscall thread: the pool's threads answer through it)."""

    OPS = {abi.CAP_HTTP: "http", abi.CAP_READ_FILE: "read_file", abi.CAP_LIST_DIR: "list_dir"}
    ANYTIME = set(OPS)          # served while a step is on the device: they touch no KV page

    def __init__(self, caps: Capabilities, answers: Answers, submit: Callable[[Callable[[], None]], None]):
        self.caps, self.answers, self.submit = caps, answers, submit

    def http(self, lip, slot, cid, body, toks):
        return self._start(lip, slot, cid, "http", body)

    def read_file(self, lip, slot, cid, body, toks):
        return self._start(lip, slot, cid, "read", body)

    def list_dir(self, lip, slot, cid, body, toks):
        return self._start(lip, slot, cid, "list", body)

    def _start(self, lip, slot, cid, op: str, body) -> None:
        def done(res, err):
            def reply():
                lip.caps_in_flight -= 1
                if err is None:
                    self.answers.reply(lip, slot, cid, res)
                else:
                    self.answers.error(lip, slot, cid, err)
            self.submit(reply, anytime=True)
        lip.caps_in_flight += 1
        lip.blocked_since = time.monotonic()
        args = {k: v for k, v in msgspec.structs.asdict(body).items() if v is not None}   # absent: policy default
        self.caps.submit(lip, op, args, done)
        return None
