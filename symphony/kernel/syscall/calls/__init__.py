"""The system-call handlers, one module per interface (as the ABI groups them):

    info.py      nop, info                          (InfoCalls)
    pred.py      pred: checked and queued           (PredCalls, PredCall, Stage; the step: ../step.py)
    kv.py        the KV file calls                  (KvCalls)
    messages.py  send, write_stream, recv, fetch    (MessageCalls)
    caps.py      http, read_file, list_dir          (CapCalls)

Each part is an object that owns its state and is given its collaborators in
its constructor; its ``OPS`` maps the ABI ops it serves to its handler
methods, each ``handler(lip, slot, call_id, body, tokens)`` with ``body``
already decoded as the op's type (`symphony.ipc.schema`).  A handler returns
the reply body, or None when the call is answered later (or already was).
Its ``ANYTIME`` names the ops it may serve while a step is on the device (they
touch no KV page the device may be writing); the others wait for the step.

`dispatch_table` builds the syscall thread's op -> handler table from
`schema.REQUESTS`, the one table of ops and their body types: an op without a
handler, a handler without an op, or an op served twice is an error when the
table is built (and `handled_ops` lets a test check it without a kernel).
"""
from __future__ import annotations

from typing import Callable

from symphony.ipc import abi, schema

from symphony.kernel.syscall.calls.caps import CapCalls
from symphony.kernel.syscall.calls.info import InfoCalls
from symphony.kernel.syscall.calls.kv import KvCalls
from symphony.kernel.syscall.calls.messages import MessageCalls
from symphony.kernel.syscall.calls.pred import PredCall, PredCalls, Stage

PARTS = (InfoCalls, PredCalls, KvCalls, MessageCalls, CapCalls)

Handler = Callable[..., object]


def handled_ops(parts=PARTS) -> dict[int, str]:
    """op -> "Part.method" for every op the parts serve; raises on an op served twice."""
    out: dict[int, str] = {}
    for part in parts:
        for op, name in part.OPS.items():
            if op in out:
                raise ValueError(f"op {abi.OP_NAMES.get(op, op)} is served by {out[op]} and {part.__name__}.{name}")
            out[op] = f"{part.__name__}.{name}"
    return out


def anytime_ops(*parts) -> frozenset:
    """The ops the part objects ``parts`` serve while a step is on the device (each part's
    ``ANYTIME``, a subset of its ``OPS``)."""
    out = set()
    for p in parts:
        extra = set(p.ANYTIME) - set(p.OPS)
        if extra:
            raise ValueError(f"{type(p).__name__}.ANYTIME names ops it does not serve: {sorted(extra)}")
        out |= set(p.ANYTIME)
    return frozenset(out)


def dispatch_table(*parts) -> dict[int, Handler]:
    """op -> bound handler of the part objects ``parts``, for exactly the ops of
    `schema.REQUESTS` (anything else raises ValueError)."""
    handled_ops([type(p) for p in parts])
    table = {op: getattr(p, name) for p in parts for op, name in p.OPS.items()}
    missing, extra = set(schema.REQUESTS) - set(table), set(table) - set(schema.REQUESTS)
    if missing or extra:
        raise ValueError(f"system-call table drifted from the schema: no handler for "
                         f"{sorted(abi.OP_NAMES.get(o, o) for o in missing)}, no op for "
                         f"{sorted(abi.OP_NAMES.get(o, o) for o in extra)}")
    return {op: table[op] for op in schema.REQUESTS}


__all__ = ["CapCalls", "InfoCalls", "KvCalls", "MessageCalls", "PARTS", "PredCall", "PredCalls", "Stage",
           "anytime_ops", "dispatch_table", "handled_ops"]
