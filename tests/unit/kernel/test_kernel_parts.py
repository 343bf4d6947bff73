"""The kernel's event-loop parts built alone, without a kernel process.

  * OutputStreams: a detached LIP's output is kept up to its bound (oldest
    dropped) and credited at once; an attached client's output is credited
    once its transport has taken it; `forget` drops output and unread input;
  * Supervision: a failing task restarts, too many failures or a watchdog
    whose thing died fail the kernel loudly, once, with the first reason;
  * AdmissionControl's queue with a process table and a published snapshot:
    a spawn that may start starts through ``start``, one that may not waits
    and starts when a LIP exits; a queued LIP that leaves gets its exit event.
"""
import asyncio
import os
from types import SimpleNamespace

from symphony.ipc.protocol import encode_frame
from symphony.kernel.loop.admission import AdmissionControl, PendingStart
from symphony.kernel.loop.inflow import InputFlow
from symphony.kernel.loop.limits import LimitPolicy
from symphony.kernel.loop.output import OutputStreams
from symphony.kernel.loop.proctable import ProcessTable
from symphony.kernel.snapshot import ProcRow, ServingSnapshot
from symphony.kernel.states import LipState
from symphony.kernel.loop.supervisor import Supervision
from symphony.sched.admission import AdmissionLimits, Waiting


class Writer:
    """A client's stream as OutputStreams uses it: frames written, drained on demand."""

    def __init__(self):
        self.frames, self.drained = [], asyncio.Event()

    def write(self, frame):
        self.frames.append(frame)

    def is_closing(self):
        return False

    async def drain(self):
        await self.drained.wait()


def test_detached_output_is_bounded_and_credited_at_once_attached_output_once_taken():
    async def go():
        credits = []
        inflow = InputFlow(1 << 10)
        out = OutputStreams(inflow, 100, lambda lip, n: credits.append((lip, n)))
        ev = {"event": "out", "data": "x" * 30}
        size = len(encode_frame(ev))
        for _ in range(5):
            out.deliver(1, ev)                                   # nobody attached: kept
        assert credits == [(1, size)] * 5                          # and credited at once
        assert out.history_bytes[1] == size * (100 // size) and out.queued_bytes() == out.history_bytes[1]
        w = Writer()
        out.watch(2, w)
        out.deliver(2, ev)
        await asyncio.sleep(0.01)
        assert w.frames == [encode_frame(ev)] and (2, size) not in credits and out.owed[2] == size
        w.drained.set()                                          # the client took it
        await asyncio.sleep(0.01)
        assert credits[-1] == (2, size) and out.owed[2] == 0
        inflow.sent(2, 7)
        out.forget(2)
        assert 2 not in out.watchers and 2 not in out.owed and inflow.total() == 0
    asyncio.run(go())


def test_a_failing_task_restarts_until_it_fails_too_often_and_the_first_reason_wins():
    async def go():
        sup, runs = Supervision(), []

        async def flaky():
            runs.append(1)
            raise RuntimeError("boom")
        sup.supervise("flaky part", flaky, restarts=2)
        await asyncio.wait_for(sup.stopping.wait(), 5)
        assert len(runs) == 3 and sup.fatal == "the kernel's flaky part failed 3 times in a minute"
        sup.fail_loudly("later")
        assert sup.fatal.startswith("the kernel's flaky part")
        sup.cancel_all()

        sup, alive = Supervision(), [True]
        sup.watchdog("thread watchdog", lambda: alive[0], "the thread died")
        await asyncio.sleep(0.6)
        assert not sup.stopping.is_set()
        alive[0] = False
        await asyncio.wait_for(sup.stopping.wait(), 5)
        assert sup.fatal == "the thread died"
        sup.cancel_all()
    asyncio.run(go())


def test_admission_starts_what_fits_queues_the_rest_and_admits_it_when_a_lip_exits():
    async def go():
        procs, started, events = ProcessTable(), [], []
        served = SimpleNamespace(snapshot=ServingSnapshot(kv_pages_total=64, kv_pages_free=64, kv_device_free=64))
        output = SimpleNamespace(deliver=lambda lip, ev: events.append((lip, ev)), forget=lambda lip: None)

        def start(lip, p):
            started.append(lip)
            procs.admit(lip, ring=None)
        adm = AdmissionControl(AdmissionLimits(), procs, served, LimitPolicy(max_lips_per_user=8), output,
                               asyncio.Event(), start, max_lips=2, quotas=SimpleNamespace(limit_for=lambda u: None),
                               device_pages=64, page_size=16)

        def spawn(lip):
            key, pages = adm.estimate("alice", "print(1)", 32)
            adm.enqueue(Waiting(lip, "alice", 0, pages, 0.0, 8),
                        PendingStart("print(1)", "p.py", [], {}, {}, None, key, pages, 0.0),
                        ProcRow(lip, "alice", "p.py", LipState.QUEUED, 0, 0, 0.0, (), {}))
            return adm.start_now(lip)
        assert spawn(1) == {"event": "started", "lip": 1} and spawn(2)["event"] == "started"
        r = spawn(3)                                             # two LIP slots: the third waits
        assert r["event"] == "queued" and r["position"] == 1 and "too many LIPs" in r["waiting_for"]
        assert procs.get(3).state == LipState.QUEUED and 3 in adm and started == [1, 2]
        spawn(4)
        adm.leave(4, "killed by alice")                          # leaves the queue: exit event at once
        assert events[-1][0] == 4 and events[-1][1]["reason"] == "killed by alice" and 4 not in procs
        procs.exit_reported(1)
        procs.reclaimed(1, 0, 0, ServingSnapshot().counters(1))
        adm.exited(1, peak=3)                                    # a slot is free: the queue moves
        assert started == [1, 2, 3] and procs.get(3).state == LipState.STARTING
        assert events[-1][0] == 3 and events[-1][1]["event"] == "started" and "waited_s" in events[-1][1]
        assert adm.estimate("alice", "print(1)", None)[1] == 3   # its program's peak is the next estimate
    asyncio.run(go())


def test_hints_only_where_the_forward_pass_leaves_the_cores_free():
    """`hint_calls` (kernel/syscall/step.py): callers of a step are told when it should end only
    on a device that is not the host's CPU (a GPU, the simulated device) with steps on the
    device thread, at most one caller a core beyond the kernel's two threads (one at least)."""
    import torch

    from symphony.engine.engine import Engine
    from symphony.kernel.syscall.step import hint_calls

    def on_host(device, simulated=False):
        return Engine.computes_on_host.fget(SimpleNamespace(device=torch.device(device), simulated=simulated))

    cores = len(os.sched_getaffinity(0))
    cpu, sim, gpu = on_host("cpu"), on_host("cpu", True), on_host("cuda")
    assert (cpu, sim, gpu) == (True, False, False)
    assert hint_calls(cpu, True) == 0 and hint_calls(sim, False) == hint_calls(gpu, False) == 0
    assert hint_calls(sim, True) == hint_calls(gpu, True) == max(1, cores - 2)
