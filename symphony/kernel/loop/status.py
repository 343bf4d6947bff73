"""What `ps` and `stats` answer: the kernel's state, from published snapshots only.

`KernelStatus` is a part of `daemon.Kernel` on the event loop.  It owns no
state but one request: the pending "publish now" command it has queued for
the syscall thread (`FreshSnapshots`).  It reads the process table's snapshot
(event loop), the syscall thread's serving snapshot (snapshot.py), and the
event loop's own counters (the admission queue, output and input held, the
connection table) -- never another thread's live state.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from symphony.kernel.loop.admission import AdmissionControl
from symphony.kernel.loop.bounds import Connections
from symphony.kernel.loop.inflow import InputFlow
from symphony.kernel.loop.output import OutputStreams
from symphony.kernel.loop.proctable import ProcessTable
from symphony.kernel.states import LipState

FRESH_SNAPSHOT_WAIT_S = 0.25   # stats: how long to wait for the syscall thread to publish (a stall is not waited out)


class FreshSnapshots:
    """Asks the syscall thread to publish what it serves now, one request at a time."""

    def __init__(self, sys_server):
        """``sys_server``: anything with the syscall thread's ``call_future(fn)``."""
        self.sys = sys_server
        self._request: Optional[asyncio.Future] = None

    async def wait(self, wait_s: float = FRESH_SNAPSHOT_WAIT_S) -> None:
        """Have the syscall thread publish what it serves now (an awaited command
        publishes), so that `stats` reflects every call whose reply or output the
        client already saw.  A stalled thread is not waited for beyond ``wait_s``:
        the last published snapshot is served then.  Concurrent callers share one
        request, so a flood of `stats` during a stall queues one command, not many."""
        pending = self._request
        if pending is None or pending.done():
            pending = self._request = asyncio.wrap_future(self.sys.call_future(lambda: None, anytime=True))
        try:
            await asyncio.wait_for(asyncio.shield(pending), wait_s)   # a timeout leaves it for the others
        except (asyncio.TimeoutError, RuntimeError):
            pass


class KernelStatus:
    """The `ps` and `stats` replies (event loop)."""

    def __init__(self, procs: ProcessTable, admission: AdmissionControl, sys_server, output: OutputStreams,
                 inflow: InputFlow, conns: Connections, engine, instance: str):
        """``sys_server``: the syscall thread's server (its snapshot, its thread
        count); ``engine``: for the model's fixed description; ``instance``:
        this kernel's instance name."""
        self.procs, self.admission, self.sys, self.output = procs, admission, sys_server, output
        self.inflow, self.conns, self.engine, self.instance = inflow, conns, engine, instance
        self.fresh = FreshSnapshots(sys_server)

    def ps(self, viewer: Optional[str] = None) -> dict:
        """The `ps` reply, from the published snapshots only: the process
        table's rows (event loop) and the syscall thread's counters.  A
        running LIP the memory manager suspended shows state "suspended".
        ``viewer``: the user asking (others' LIPs come without their
        arguments, limits and why they wait: that names their user's KV use);
        None: an administrator, who sees everything."""
        (rows, finished, _), served = self.procs.snapshot, self.sys.snapshot
        full = lambda r: viewer is None or r.user == viewer  # noqa: E731
        queued = self.admission.queued_views()         # position, waited_s of each queued LIP
        for lip, pages in served.suspended.items():    # running, but swapped out for a more important LIP
            queued.setdefault(lip, {}).update(state=LipState.SUSPENDED, suspended_pages=pages)

        def row(r):
            q = queued.get(r.lip, {})
            if not full(r):
                q = {k: v for k, v in q.items() if k != "waiting_for"}
            return dict(r.ps(served.counters(r.lip), full(r)), **q)
        return {"lips": [row(r) for r in rows],
                "finished": [dict(r.ps(r.final, full(r)), **e) for r, e in finished[-20:]]}

    async def fresh_stats(self) -> dict:
        """`stats` once the syscall thread has published (or `FRESH_SNAPSHOT_WAIT_S` passed)."""
        await self.fresh.wait()
        return self.stats()

    def stats(self) -> dict:
        """The `stats` reply, from the published snapshots only."""
        served, engine = self.sys.snapshot, self.engine
        d = {"lips": sum(r.state != LipState.QUEUED for r in self.procs.snapshot.rows)}
        d.update(served.as_stats())
        d.update(self.admission.stats())
        d["instance"] = self.instance
        d["model"] = getattr(engine, "model_id", None) or engine.model_config.name or "default"
        d["model_name"] = engine.model_config.name
        d["page_size"] = engine.page_size
        d["context"] = engine.max_seq_len
        d["compute_threads"] = self.sys.compute_threads
        d["output_queued_bytes"] = self.output.queued_bytes()
        d["input_queued_bytes"] = self.inflow.total()
        d["connections"] = len(self.conns)
        d["connections_refused"] = self.conns.refused
        return d
