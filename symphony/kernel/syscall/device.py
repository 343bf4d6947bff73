"""The device thread: each step's forward pass, while the syscall thread goes on serving.

    syscall thread                              device thread
    --------------                              -------------
    job = Job(plan.step, sinks)     launch -->  out = engine.runner.run(job.step)
    ... polls the rings, answers calls          job.land(out): token ids in one copy to the
        that need no forward pass,                 host, logits rows into their arenas, top-k
        checks and queues preds ...                to host tensors; one wait for the device
                                    <-- done    doorbell rung
    job = device.take()
    commit, deliver the replies, plan the next step

One step is in flight at a time.  While it is, the device thread reads the step's `ModelStep`
and writes the KV pages it names and the arena rows of its calls; everything else -- KVFS, the
scheduler, the rings, the LIPs' records -- stays the syscall thread's, which touches no page of
the step until the step comes back (docs/design/ownership.md).  A step whose runner raises
comes back with the error (``job.error``): the syscall thread undoes its plan and fails its
calls.  This thread runs the model, so it is the one whose torch thread count
(``compute_threads``) and CPU kernel calibration count.

`InlineDevice` has the same interface and runs the step at once on the calling thread (the
kernel's ``--serial-steps``, and the in-process servers of tests): launch, then take.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from symphony.engine.runner import ModelStep, StepOutput

log = logging.getLogger("symphony.syscalls")


@dataclass(eq=False)
class Job:
    """One step on its way through the device: what to run, and where its results land."""

    step: ModelStep
    sinks: list                                # per call of the step, where its result lands (`land`)
    plan: Any = None                           # the syscall thread's own (KVFS's plan, the step's calls)
    out: Optional[StepOutput] = None           # set by the device
    landed: Optional[list] = None              # per call, its result on the host (`land`)
    error: Optional[BaseException] = None      # the runner (or landing) raised: nothing of it ran
    seconds: float = 0.0                       # the run and the landing, wall time
    cpu_s: float = 0.0                         # ... and the running thread's CPU time
    fault: bool = False                        # the test hook step_fault: its pass raises
    launched: float = field(default_factory=time.perf_counter)


class Device:
    """The device thread (see the module's docstring).  ``run`` is the engine's ``runner.run``;
    ``on_done()`` is called on this thread after each step (it rings the syscall thread's
    doorbell); ``setup()`` runs first on this thread (torch threads, kernel calibration)."""

    def __init__(self, run: Callable[[ModelStep], StepOutput], cuda: bool, on_done: Callable[[], None],
                 setup: Callable[[], None] = lambda: None):
        self._run, self.cuda, self._on_done, self._setup = run, cuda, on_done, setup
        self._fault = False
        self._jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._done: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        self.in_flight: Optional[Job] = None       # the syscall thread's view: launched, not yet taken
        self.ready = threading.Event()             # setup has run
        self.cpu_s = 0.0                           # this thread's CPU time in steps (read anywhere)
        self.thread = threading.Thread(target=self._body, name="symphony-device", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def fail_next(self) -> None:
        """A test hook: the next step's forward pass raises (syscall thread, before `launch`)."""
        self._fault = True

    # ------------------------------------------------------------------ the syscall thread's side
    def launch(self, job: Job) -> None:
        assert self.in_flight is None, "one step at a time"
        self.in_flight = job
        job.launched = time.perf_counter()
        job.fault, self._fault = self._fault, False
        self._jobs.put(job)

    def take(self) -> Optional[Job]:
        """The step in flight, once the device is done with it (None: none, or not yet)."""
        if self.in_flight is None:
            return None
        try:
            job = self._done.get_nowait()
        except queue.Empty:
            return None
        self.in_flight = None
        return job

    def done(self) -> bool:
        """Whether the step in flight is back (`take` returns it)."""
        return self.in_flight is not None and not self._done.empty()

    def wait(self, timeout: Optional[float] = None) -> Optional[Job]:
        """Block until the step in flight is done (shutdown); None after ``timeout``."""
        if self.in_flight is None:
            return None
        try:
            job = self._done.get(timeout=timeout)
        except queue.Empty:
            return None
        self.in_flight = None
        return job

    def stop(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        if self.thread.is_alive():
            self.thread.join(timeout)

    # ------------------------------------------------------------------ this thread
    def _body(self) -> None:
        try:
            self._setup()
        except Exception:
            log.exception("device thread: set-up failed; steps run with torch's defaults")
        self.ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            execute(job, self._run, self.cuda)
            self.cpu_s += job.cpu_s
            self._done.put(job)
            try:
                self._on_done()
            except Exception:
                log.exception("device thread: could not signal a finished step")


class InlineDevice:
    """`Device`'s interface, the step run at ``launch`` on the calling thread."""

    def __init__(self, run: Callable[[ModelStep], StepOutput], cuda: bool, setup: Callable[[], None] = lambda: None):
        self._run, self.cuda = run, cuda
        self.in_flight: Optional[Job] = None
        self.ready = threading.Event()
        self._setup = setup
        self.cpu_s = 0.0
        self._fault = False

    def start(self) -> None:
        self._setup()
        self.ready.set()

    def fail_next(self) -> None:
        self._fault = True

    def launch(self, job: Job) -> None:
        assert self.in_flight is None, "one step at a time"
        job.launched = time.perf_counter()
        job.fault, self._fault = self._fault, False
        execute(job, self._run, self.cuda)
        self.cpu_s += job.cpu_s
        self.in_flight = job

    def take(self) -> Optional[Job]:
        job, self.in_flight = self.in_flight, None
        return job

    def done(self) -> bool:
        return self.in_flight is not None

    wait = lambda self, timeout=None: self.take()      # noqa: E731 - the same, nothing to wait for

    def stop(self, timeout: float = 5.0) -> None:
        pass


class InjectedStepFault(RuntimeError):
    """The test hook ``step_fault`` (--test-hooks): a forward pass that raises."""


def execute(job: Job, run: Callable[[ModelStep], StepOutput], cuda: bool) -> None:
    """Run ``job``'s step and land its results; an exception becomes ``job.error``."""
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        if job.fault:
            raise InjectedStepFault("injected step fault (--test-hooks)")
        job.out = run(job.step)
        job.landed = land(job.out, job.sinks, cuda)
    except BaseException as e:                   # the syscall thread undoes the plan, fails the calls
        job.error = e
    job.seconds, job.cpu_s = time.perf_counter() - t0, time.thread_time() - c0


def land(out: StepOutput, sinks: list, cuda: bool) -> list:
    """Each call's result brought to the host.  ``sinks``, per call of the step: its output kind
    ("argmax", "sample", "topk"), a logits call's arena view [rows, vocab], None for a chunk that
    wants nothing, or the exception that keeps it from landing.  Returns, per call: its token ids
    (a list; every call's come in one copy), the number of logits rows copied into its arena, its
    top-k as host arrays (ids, log-probs), None, or the exception.  On a GPU the copies are
    queued, then waited for once."""
    landed: list = [None] * len(sinks)
    tokens = []                                  # (index, its token ids on the device)
    host_topk = []
    for i, (sink, r) in enumerate(zip(sinks, out.results)):
        if r.error is not None or sink is None:
            continue
        if isinstance(sink, BaseException):
            landed[i] = sink
        elif isinstance(sink, str) and sink != "topk":       # argmax, sample
            tokens.append((i, r.value))
        elif isinstance(sink, str):
            lp, ids = r.value
            host_topk.append((i, lp.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True)))
        else:                                    # a logits call's arena view [rows, vocab]
            try:
                value = r.value                  # [rows, vocab]
                torch.from_numpy(sink[: value.shape[0]]).copy_(value, non_blocking=True)
                landed[i] = value.shape[0]
            except Exception as e:
                landed[i] = e
    ids = None
    if tokens:
        ids = torch.cat([v.reshape(-1).long() for _, v in tokens]).to("cpu", non_blocking=True)
    if cuda:
        torch.cuda.current_stream().synchronize()
    if ids is not None:
        flat, off = ids.tolist(), 0
        for i, v in tokens:
            landed[i] = flat[off:off + v.numel()]
            off += v.numel()
    for i, lp, ids_h in host_topk:
        landed[i] = (ids_h.numpy(), lp.numpy())
    return landed


__all__ = ["Device", "InlineDevice", "Job", "execute", "land"]
