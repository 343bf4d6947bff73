"""The step: one forward pass over the queued pred calls, in five typed calls.

    batch = residency.schedule(now)         the chunks of this pass: who waits for device pages
                                            (residency.py), then the scheduler's pick, fair within
                                            the token budget, one call a file        (sched/batch.py)
    plan = fs.prepare(chunks)               page tables: swap-ins, copy-on-write, charges (kvfs/)
    device.launch(Job(plan.step, land))     the forward pass on the device thread, its results
    ... the syscall thread serves on ...    landed on the host (device.py)
    done = fs.commit(plan, job.out)         keep what succeeded, undo what failed (kvfs/)
    deliver(batch, done, job.landed)        replies; a chunked prefill stays queued

`Stepper.launch` is the first three, `Stepper.finish` the last two; `Stepper.step` is all five
on the calling thread (an `InlineDevice`: the kernel's ``--serial-steps`` and in-process tests).
A step whose runner raises comes back with its error: its plan is undone and each of its calls
answered with the error, never lost; a tensor-parallel failure then goes on up (the kernel
shuts down).  Delivery needs nothing of KVFS but what `commit` left in the plan (each file's
new length): replies go out the moment the step's results are on the host.
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from symphony.engine.tp.group import TPFailure
from symphony.ipc import abi
from symphony.kvfs import KVFS
from symphony.kvfs.data import Placement
from symphony.sched import BatchScheduler

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.syscall.calls.pred import PredCall, Stage
from symphony.kernel.syscall.device import InlineDevice, Job
from symphony.kernel.syscall.proc import Serving
from symphony.kernel.syscall.residency import Residency

log = logging.getLogger("symphony.syscalls")

MAX_HINT_S = 1.0        # a step predicted longer gets no hints: its callers block as usual


def hint_calls(on_host: bool, overlap: bool) -> int:
    """In a step of at most this many calls the callers are told when it should end (step.py's
    `Stepper.hint`), so that they wait actively: where the forward pass leaves the host's cores
    free (a GPU, the simulated device) and steps run on the device thread, one core each beyond
    the syscall and device threads' two (one at least); never where the model computes on the
    host's cores (``on_host``: `Engine.computes_on_host`; a waiting LIP would take cores from
    the forward pass)."""
    if on_host or not overlap:
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 2)


class Stepper:
    """Runs steps: given the engine (the vocabulary), KVFS, the scheduler, residency, the answers and the device (`device.Device` or
    `InlineDevice`); owns the step counters (`batches`, `batch_calls`, `max_batch`)."""

    def __init__(self, engine, fs: KVFS, sched: BatchScheduler, residency: Residency, answers: Answers, device):
        self.fs, self.sched, self.residency, self.answers, self.device = fs, sched, residency, answers, device
        # the forward pass computes on the host's cores: a thread that spins while it runs takes
        # a core from its thread team, which then waits for it at every barrier
        self.host_pass = engine.computes_on_host
        # in a step of at most this many calls, each caller is told when it should end (`hint`)
        self.hint_calls = hint_calls(self.host_pass, not isinstance(device, InlineDevice))
        self._hinted: list = []                 # (ring, slot) told by `hint`, not yet woken
        self._timed = (None, 0.0)               # (calls, tokens) of the last step back, launch to answers (s)
        self._around = 0.0                      # ... of which not its forward pass (handing over, commit)
        self.vocab = engine.model_config.vocab_size
        self.read_pairs = engine.attention_read_pairs
        self.batches = 0
        self.batch_calls = 0
        self.max_batch = 0

    def price_attention(self) -> None:
        """Give the scheduler's cost model what reading a key costs the attention, in pairs
        (`Engine.attention_read_pairs`, timed on this thread, the one that runs the model)."""
        try:
            self.sched.cost.set_read_pairs(self.read_pairs())
            log.info("attention: reading a key costs %.1f query-key pairs", self.sched.cost.read_pairs)
        except Exception:                   # noqa: BLE001 - priced by pairs alone
            log.exception("timing the attention failed; the step-cost model prices its pairs alone")

    @property
    def in_flight(self) -> bool:
        return self.device.in_flight is not None

    # ------------------------------------------------------------------ schedule, prepare, run
    def launch(self, now: float) -> bool:
        """Schedule and prepare the next step and hand it to the device; False if no call could
        be scheduled (all wait for device pages)."""
        batch = self.residency.schedule(now)
        if batch is None:
            return False
        items = [(c, start, n) for c, start, n in batch.items if c.proc.state == Serving.RUNNING]
        if not items:
            return True
        plan = self.fs.prepare([c.chunk(start, n) for c, start, n in items])
        sinks = self._sinks(items, plan)
        self.device.launch(Job(plan.step, sinks, plan=(items, plan)))
        if len(items) <= self.hint_calls:
            self.hint(items)
        self.batches += 1
        self.batch_calls += len(items)
        self.max_batch = max(self.max_batch, len(items))
        return True

    def hint(self, items: list) -> None:
        """Tell each caller answered by the step just launched when the cost model expects it
        back (ipc/layout.py, "hints"): with a core spare, a LIP then waits actively from shortly
        before, and its answer reaches it without a wake-up (~50 us a call on a VM)."""
        self._hinted = []                               # (the last step's, if never woken: answered by now)
        if _shape(items) == self._timed[0]:             # as the last step: launch to answers (a decode loop)
            predicted = self._timed[1]
        else:                                           # else the cost model (a fit: ~10 us) and the
            predicted = self.sched.predicted_seconds()  # last step's time beside its pass
            predicted = None if predicted is None else predicted + self._around
        if predicted is None or not 0.0 < predicted < MAX_HINT_S:
            return
        eta = time.perf_counter_ns() + int(predicted * 1e9)       # CLOCK_MONOTONIC, as the LIPs read it
        for c, start, n in items:
            if start + n == c.n_tokens:                 # its last chunk: answered when the step is back
                try:
                    if c.proc.ring.hint(c.slot, eta):
                        self._hinted.append((c.proc.ring, c.slot))
                except Exception:                       # noqa: BLE001 - a ring gone: its call fails on landing
                    pass

    def wake_hinted(self) -> None:
        """Wake the callers `hint` told, to read their hints: called once the thread has nothing
        else to do, so that their wake-ups do not delay the step's start on the device."""
        if not self._hinted:
            return
        hinted, self._hinted = self._hinted, []
        for ring, slot in hinted:
            try:
                ring.wake(slot)
            except Exception:                           # noqa: BLE001 - a ring gone meanwhile
                pass

    def step(self) -> bool:
        """One whole step on this thread (an `InlineDevice`); False if nothing could be scheduled."""
        assert isinstance(self.device, InlineDevice), "a step on its own needs the inline device"
        if not self.launch(time.monotonic()):
            return False
        job = self.device.take()
        if job is not None:
            self.finish(job)
        return True

    # ------------------------------------------------------------------ commit, deliver
    def finish(self, job: Job) -> None:
        """The step ``job`` is back from the device: commit it and answer its calls."""
        items, plan = job.plan
        self.sched.took(job.seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d: %.1f ms, %s; cost model (ms: base, token, call, kpair, kread) %s", self.batches,
                      1e3 * job.seconds, _composition(items),
                      " ".join(f"{1e3 * x:.3g}" for x in self.sched.cost.coefficients()))
        if job.error is not None:
            self.fs.undo(plan)
            for c, _, _ in items:
                self.sched.drop(c)
                c.fail(self.answers, job.error)
            if isinstance(job.error, TPFailure):
                raise job.error
            log.error("a step of %d calls failed: %s: %s", len(items), type(job.error).__name__, job.error)
            return
        self.deliver(items, plan, self.fs.commit(plan, job.out), job.landed)
        took = time.perf_counter() - job.launched       # launch to answers: what a hint predicts
        self._timed, self._around = (_shape(items), took), max(0.0, took - job.seconds)

    def deliver(self, items: list, plan, results: list, landed: list) -> None:
        """Fail what failed, advance what has more chunks, reply to the rest.  ``landed``: per
        placed call, its result on the host (or the error that kept it from landing)."""
        host = iter(landed)
        for (c, start, n), placed, r in zip(items, plan.placed, results):
            value = next(host) if isinstance(placed, Placement) else None
            if r.error is None and isinstance(value, BaseException):
                r.error = value
            if r.error is not None:
                self.sched.drop(c)                   # its other chunks never run
                c.fail(self.answers, r.error)
                continue
            if start + n < c.n_tokens:
                c.stage = Stage.FEEDING
                continue
            c.stage = Stage.REPLYING
            c.proc.preds += 1
            c.proc.tokens += len(c.tokens)
            try:
                self._reply(c, placed.inode.length, value)
                c.stage = Stage.DONE
            except Exception as e:
                c.fail(self.answers, e)

    def _reply(self, c: PredCall, length: int, value) -> None:
        lip, slot, cid, out = c.proc, c.slot, c.call_id, c.want.output
        if out in ("argmax", "sample"):                                 # value: the token ids, a list
            self.answers.reply(lip, slot, cid, {"length": length, "token": value[-1], "tokens": value})
        elif out == "logits":                                           # value: the rows, in the arena
            self.answers.reply(lip, slot, cid, {"length": length}, (abi.ARENA_LOGITS, value, self.vocab))
        else:                                                           # topk: host arrays
            ids, lp = value
            rows, k = lp.shape
            view = lip.ring.arena(slot, 2 * rows, k)
            view[:rows] = ids.view(np.float32)
            view[rows:] = lp
            self.answers.reply(lip, slot, cid, {"length": length}, (abi.ARENA_TOPK, 2 * rows, k))

    def _sinks(self, items: list, plan) -> list:
        """Per placed call, where the device lands its result: a logits call's arena rows (a view
        made here, on the syscall thread, which owns the ring), else its output kind."""
        out = []
        for (c, start, n), placed in zip(items, plan.placed):
            if not isinstance(placed, Placement):
                continue
            kind = c.want.output if start + n == c.n_tokens else None
            if kind == "logits":
                rows = n if c.all_logits else 1
                try:
                    kind = c.proc.ring.arena(c.slot, rows, self.vocab)
                except Exception as e:               # the ring is gone: the call fails when it lands
                    kind = e
            out.append(kind)
        return out


__all__ = ["Stepper", "hint_calls"]


def _shape(items: list) -> tuple[int, int]:
    """A step's (calls, tokens): steps of one shape take alike (a decode loop's)."""
    return len(items), sum(n for _, _, n in items)


def _composition(items: list) -> str:
    """A step's calls by user: "alice 3 calls 96 tokens (deepest 2900), bob 1 call 1 token"."""
    users: dict = {}
    for c, start, n in items:
        u = users.setdefault(c.proc.user, [0, 0, 0])
        u[0] += 1
        u[1] += n
        u[2] = max(u[2], c.context + start)
    return ", ".join(f"{u} {k} calls {t} tokens (deepest {d})" for u, (k, t, d) in sorted(users.items()))
