"""The system-call layer: the syscall thread, which owns KVFS, the scheduler and the LIPs
it serves, and the device thread it hands each forward pass to (device.py).

Loop (never blocks on a LIP, never waits for the device):
    1. run control commands from the event loop (add/remove LIP, input, ...); while a
       step is on the device, only those marked ``anytime`` (they touch no KV page)
    2. poll every LIP's slots for requests; decode each body as its op's type
       (ipc/schema.py) and dispatch it to its handler (calls/: one part per
       interface, the table built from the schema): pred calls are checked and
       queued, message and capability calls, NOP, INFO and KV metadata answered at
       once -- also while a step is on the device; a call that changes KV files waits
       (`deferred`) until the step in flight is back, since the device is writing pages
    3. the step in flight is back (the device rang the doorbell): KVFS commits it and
       its calls are answered (step.py's `Stepper.finish`), then the deferred calls
       and commands run
    4. no step in flight and pred calls queued: plan one and hand it to the device
       (`Stepper.launch`: residency and the scheduler pick the chunks, KVFS prepares
       their pages) -- unless the last step's callers are coming back (`should_wait`)
    4b. run a slice of each user's slow call (a durable sync, a large listing:
       slowlane.py), between steps, so that no one call holds the thread
    5. publish what it serves (`snapshot`: counters, KV pages) for the event loop's
       ps/stats/admission: at most every PUBLISH_EVERY_S, and at once after every command
       the event loop awaits (`call_future`: a reclaim, kv ls/rm), so a snapshot is at
       most PUBLISH_EVERY_S old, and exact when a LIP's exit event goes out
    6. nothing to do: wait on the LIPs' and the device's doorbells (spin, then block; no spin while
       the CPU computes a step); the next pass polls the rings rung (all every FULL_POLL_S)

With ``overlap=False`` (``--serial-steps``) the step runs on this thread, start to end.

The LIPs it serves (`lips`, proc.ServedLips) are its own; the event loop hands each over
once (`add`) and learns about them only from `snapshot`.  Every request is hostile until
checked: a malformed ring entry is answered with EINVAL and counted; a LIP with too many
strikes is killed.  Errors are replied as {"error": code, "type": name, "message": text}.
"""
from __future__ import annotations

import logging
import threading
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from symphony.engine.tp.group import TPFailure
from symphony.ipc import schema
from symphony.ipc.layout import RingError
from symphony.kvfs import KVFS
from symphony.sched import BatchScheduler

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.syscall.calls import (CapCalls, InfoCalls, KvCalls, MessageCalls, PredCalls, anytime_ops,
                                           dispatch_table)
from symphony.kernel.syscall.calls.messages import MAX_MESSAGE_BYTES, MAX_QUEUED_OUTPUT
from symphony.kernel.syscall.calls.pred import pin_arena
from symphony.kernel.syscall.commands import Commands
from symphony.kernel.syscall.device import Device, InlineDevice
from symphony.kernel.syscall.step import Stepper
from symphony.kernel.capabilities import Capabilities
from symphony.kernel.failure import SyscallFailure
from symphony.kernel.syscall.proc import LipProc, ServedLips, Serving
from symphony.kernel.syscall.residency import KV_WAIT_S, Residency
from symphony.kernel.syscall.slowlane import RingThread, SlowLane, Writer
from symphony.kernel.snapshot import HostTimes, LipCounters
from symphony.kernel.syscall.publish import Publisher

log = logging.getLogger("symphony.syscalls")

MAX_STRIKES = 8

MAX_CRASHES = 20        # unexpected loop errors within CRASH_WINDOW_S before the kernel gives up
CRASH_WINDOW_S = 10.0
PUBLISH_EVERY_S = 0.005  # while busy, `snapshot` is at most this old
FULL_POLL_S = 0.01       # every ring is polled at least this often (else only those whose bell rang)


class InjectedFault(Exception):
    """Raised in the syscall loop by the --test-hooks ``syscall_crash`` hook."""


class SyscallServer:
    """The syscall thread (`thread`) and the state it owns: the engine, KVFS,
    the scheduler and the LIPs it serves (`lips`), and its parts, each built
    here with its collaborators: `answers` (replies), `residency` (device
    memory), `preds` (pred and the step), `kv`, `messages`, `caps` and `info`
    (the other calls, calls/).  Other threads reach it only through `submit` /
    `call_future` / `call` and read `snapshot`."""

    def __init__(self, engine, fs: KVFS, doorbell, emit: Callable[[int, dict], None],
                 kill: Callable[[int, str], None], max_batch_tokens: Optional[int] = None,
                 chunk_tokens: Optional[int] = None, caps: Optional[Capabilities] = None,
                 max_queued_output: int = MAX_QUEUED_OUTPUT,
                 on_fatal: Optional[Callable[[str], None]] = None, lips: Optional[ServedLips] = None,
                 kv_wait_s: float = KV_WAIT_S, compute_threads: Optional[int] = None,
                 on_input_read: Optional[Callable[[int, int], None]] = None, overlap: bool = True):
        """``emit``/``kill``/``on_fatal``/``on_input_read``: how this thread tells
        the event loop of a LIP's output, a LIP to kill, that it cannot go on, and
        that a LIP's recv() took so many bytes of input (each safe from any thread).  ``lips``: the LIP set whose `swap_out_first` and
        `running_ids` KVFS was built with (``KVFS(..., evict_first=
        lips.swap_out_first, pinned=lips.running_ids)``).  ``kv_wait_s``: how
        long calls may all wait for device pages that cannot move before the
        most important one fails with NoSpace (residency.py).  ``compute_threads``:
        torch's CPU threads in the thread that runs every forward pass (None:
        torch's default for a new thread).  ``overlap``: the forward pass runs on a
        device thread of its own while this one serves calls (False: on this thread)."""
        if compute_threads is not None and (not isinstance(compute_threads, int) or compute_threads < 1):
            raise ValueError(f"compute_threads must be None or an int >= 1, got {compute_threads!r}")
        self.compute_threads = compute_threads
        self.engine, self.fs, self.door = engine, fs, doorbell
        self.kill = kill
        self.on_fatal = on_fatal          # the thread cannot go on: shut the kernel down (any thread)
        self.crashes: deque = deque(maxlen=MAX_CRASHES)
        # tokens per forward pass (`Engine.step_tokens`: small on a CPU, where a prefill token costs ~100x
        # a decode step's share)
        self.max_batch_tokens = min(max_batch_tokens or engine.step_tokens, engine.config.max_batch_tokens)
        chunk_tokens = chunk_tokens or max(8, self.max_batch_tokens // 2)
        self.lips: ServedLips = lips if lips is not None else ServedLips()
        self.commands = Commands(self.door.ring, lambda: self._publish(), InjectedFault)
        self.sched = BatchScheduler(token_budget=self.max_batch_tokens, chunk_tokens=chunk_tokens,
                                    gather_s=0.003)
        self.stop = threading.Event()
        self.slow = SlowLane()            # syncs and listings, in slices, fairly across users
        self.writer = Writer(self.submit)  # durable files are written and fsynced off this thread
        self.rings = RingThread()          # arena pinning and ring unmapping, off this thread
        self.pin_arenas = engine.device.type == "cuda"
        # the parts, each given what it works with
        self.answers = Answers(kill)
        self.residency = Residency(fs, self.lips, self.sched, self.answers, kv_wait_s)
        cuda = engine.device.type == "cuda"
        self.device = (Device(engine.runner.run, cuda, self.door.ring, self._device_setup) if overlap
                       else InlineDevice(engine.runner.run, cuda, self._device_setup))
        self.stepper = Stepper(engine, fs, self.sched, self.residency, self.answers, self.device)
        self.preds = PredCalls(engine, fs, self.sched)
        self.messages = MessageCalls(self.lips, self.answers, emit, on_input_read or (lambda lip_id, n: None),
                                     max_queued_output)
        self.kv = KvCalls(fs, self.slow, self.writer, self.answers)
        self.caps = CapCalls(caps or Capabilities(max_bytes=MAX_MESSAGE_BYTES), self.answers, self.submit)
        self.info = InfoCalls(engine)
        self.dispatch = dispatch_table(self.info, self.preds, self.kv, self.messages, self.caps)
        self.anytime_ops = anytime_ops(self.info, self.preds, self.kv, self.messages, self.caps)
        self.deferred: deque = deque()    # (lip, slot, request) read while a step was on the device
        self._by_bell: dict = {}          # a served LIP's doorbell fd -> the LIP
        self._full_poll_at = float("-inf")
        self.host = HostTimes()
        self._dirty = False
        self.publisher = Publisher(engine, fs, self.lips, self.stepper, self.residency, self.slow, self.host)
        self._admitted = 0
        self._publish()                   # the first snapshot, before the thread starts
        self.thread = threading.Thread(target=self.run, name="symphony-syscalls", daemon=True)

    # ------------------------------------------------------------------ control (any thread)
    def submit(self, fn: Callable[[], None], anytime: bool = False) -> None:
        """Run ``fn`` on the syscall thread (it owns KVFS and the LIPs' records): between steps,
        or also while a step is on the device when ``anytime`` (``fn`` touches no KV page)."""
        self.commands.submit(fn, anytime)

    def call_future(self, fn: Callable[[], object], anytime: bool = False) -> Future:
        """Run ``fn`` on the syscall thread (as `submit`); a Future of its result (or error).
        Never blocks: the event loop awaits it with ``asyncio.wrap_future``."""
        return self.commands.call_future(fn, anytime)

    def call(self, fn: Callable[[], object], timeout: Optional[float] = 30.0):
        """Run ``fn`` on the syscall thread and wait for its result (not from
        the event loop).  A timeout raises TimeoutError in the caller only: the
        call still runs when the thread gets to it."""
        try:
            return self.call_future(fn).result(timeout)
        except TimeoutError:
            raise TimeoutError(f"kernel syscall thread did not answer in {timeout} s") from None

    def slow_call(self, user: str, make_job: Callable[[], object]) -> Future:
        """Run the job ``make_job()`` makes (slowlane.py) in the slow lane, charged
        to ``user``; a Future of its result.  Never blocks (the event loop awaits it)."""
        fut: Future = Future()

        def done(result, error):
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        def start():
            try:
                self.slow.submit(user, make_job(), done)
            except Exception as e:               # its checks failed: the caller's error
                done(None, e)
        self.submit(start)
        return fut

    def inject_fault(self) -> None:
        """Test hook: make the loop raise an unexpected exception once."""
        def boom():
            raise InjectedFault("injected fault (--test-hooks)")
        self.submit(boom)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """The thread's body: `_serve`, supervised.  An unexpected exception is
        logged with its traceback and the loop goes on with its state intact;
        too many in a short time and the kernel is shut down (``on_fatal``)."""
        torch.set_num_threads(1)            # this thread computes nothing: no OpenMP team of its own
        self.device.start()
        self.device.ready.wait()
        profile_to = os.environ.get("SYMPHONY_PROFILE_SYSCALLS")
        try:
            if profile_to:                  # a diagnosis aid: cProfile of this thread, written at stop
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
                try:
                    self._supervise()
                finally:
                    prof.disable()
                    prof.dump_stats(profile_to)
                    log.info("syscall thread profile written to %s", profile_to)
                return
            self._supervise()
        finally:
            self._drain()
            self.device.stop()
            self.rings.shutdown()           # the exited LIPs' rings unmapped before the thread ends

    def _device_setup(self) -> None:
        """On the thread that runs the model (device thread or this one): its torch threads, the kernels' timings."""
        if self.engine.device.type == "cuda":   # the current device is per thread: this one launches the steps
            torch.cuda.set_device(self.engine.device)
        if self.compute_threads is not None:
            torch.set_num_threads(self.compute_threads)   # per thread (OpenMP): this one runs the model
        self.compute_threads = torch.get_num_threads()
        log.info("%s running the model (%d compute threads)", threading.current_thread().name,
                 self.compute_threads)
        try:
            self.engine.calibrate_kernels()
        except Exception:                   # noqa: BLE001 - the rule of the ops still serves
            log.exception("calibrating the quantized kernels failed; their built-in rule decides")
        self.stepper.price_attention()      # the scheduler's price of a few tokens deep in a prompt
        self.engine.kv.start_commit()       # after the calibration's timings, which it would disturb

    def _drain(self) -> None:
        """Stopping: the step on the device comes back and its calls are answered (nothing is
        lost, no page leaks)."""
        job = self.device.wait(timeout=30.0)
        if job is None and self.stepper.in_flight:
            log.error("syscall thread: the step in flight did not come back within 30 s of the stop")
            return
        if job is not None:
            try:
                self.stepper.finish(job)
            except Exception:
                log.exception("syscall thread: the last step could not be finished")

    def _supervise(self) -> None:
        while not self.stop.is_set():
            try:
                self._serve()
            except TPFailure as e:            # a tensor-parallel rank is gone: the model cannot run;
                log.critical("syscall thread: %s", e)   # the kernel shuts down, this thread serves on
                if self.on_fatal is not None:           # (replies, the shutdown's commands) until then
                    self.on_fatal(str(e))
                for lip_id in self.sched.queued_lips():
                    for c in self.sched.fail_lip(lip_id):
                        c.fail(self.answers, e)
            except Exception as e:
                log.exception("syscall thread: unexpected error; the loop goes on")
                self.crashes.append(time.monotonic())
                if len(self.crashes) == MAX_CRASHES and self.crashes[-1] - self.crashes[0] < CRASH_WINDOW_S:
                    log.critical("syscall thread: %d unexpected errors in %.0f s; giving up",
                                 MAX_CRASHES, CRASH_WINDOW_S)
                    if self.on_fatal is not None:
                        self.on_fatal(f"the syscall thread keeps failing ({type(e).__name__}: {e})")
                    return
            except BaseException:
                log.exception("syscall thread: fatal error")
                if self.on_fatal is not None:
                    self.on_fatal("the syscall thread died")
                raise

    def _serve(self) -> None:
        while not self.stop.is_set():
            idle = self._serve_once()
            if idle is not None:
                self.stepper.wake_hinted()
                self.door.wait(*idle)
        log.info("syscall thread stopped")

    def _serve_once(self) -> Optional[tuple]:
        """One pass of the loop (the module's docstring); (seconds, ready) to wait on the
        doorbells when there is nothing to do, None to go on at once."""
        flight = self.stepper.in_flight
        if self.commands.run(between=not flight):
            self._dirty = True
        clock = self.host.clock
        t0 = clock()
        work = self._poll()
        for lip, slot in work:
            self._handle_safely(lip, slot)
        if work:
            self.host.add("handle", clock() - t0, len(work))
        job = self.device.take()
        if job is not None:                         # the step is back: commit, answer
            t0 = clock()
            self.stepper.finish(job)
            self.host.add("finish", clock() - t0)
            self._run_deferred()
            self.commands.run(between=True)
            self._dirty, flight = True, False
        busy, lane_s = bool(work) or job is not None, 0.0
        if not flight and len(self.slow):          # a slice of each user's slow call (slowlane.py)
            t0 = time.perf_counter()
            if self.slow.run():
                lane_s = time.perf_counter() - t0
        self._dirty = self._dirty or busy or bool(lane_s)
        if self._dirty and time.monotonic() - self.snapshot.at >= PUBLISH_EVERY_S:
            self._publish()
        if not flight and len(self.sched):
            left = self.sched.gather_left(time.perf_counter())
            if left:                           # the last step's callers are coming back: wait for their
                return left, self._has_calls   # bells (a spin, then epoll), leaving the CPU to them
            t0 = clock()
            launched = self.stepper.launch(time.monotonic())
            self.host.add("launch", clock() - t0)
            if launched:
                self._dirty = True
                return None
            # every queued call waits for device pages: idle until something changes
        if lane_s and not busy:            # slow calls alone: at most half of this thread, so that
            return lane_s, self._has_calls  # LIPs get the CPU it leaves (busy ones demoted to SCHED_IDLE)
        if busy:
            return None
        wait = 0.05                        # short: muted LIP bells are polled
        if self._dirty:                    # wake in time to publish what was done (and to count the reclaimable)
            wait = min(wait, max(0.0, self.publisher.due(PUBLISH_EVERY_S) - time.monotonic()))
        return wait, (None if flight and self.stepper.host_pass else self._has_work)   # None: no spin

    def _handle_safely(self, lip: LipProc, slot: int) -> None:
        """`_handle`, contained: an error it could not answer (a reply that does
        not fit, a bug in a handler's error path) kills that LIP, not the thread."""
        try:
            self._handle(lip, slot)
        except Exception as e:
            log.exception("LIP %d: system call could not be answered", lip.id)
            self._condemn(lip, f"killed: the kernel could not answer a system call ({type(e).__name__}: {e})")

    def _has_work(self) -> bool:
        return (self.slow.busy() and not self.stepper.in_flight) or self._has_calls()

    def _has_calls(self) -> bool:
        """A command or a finished step waits (a LIP's call rings its bell: the wait sees it)."""
        return self.device.done() or self.commands.pending(self.stepper.in_flight)

    def _run_deferred(self) -> None:
        """The calls that waited for the step in flight, in the order they came."""
        while self.deferred:
            lip, slot, req = self.deferred.popleft()
            if lip.state in (Serving.RUNNING, Serving.KILLING):
                try:
                    self._dispatch(lip, slot, req)
                except Exception as e:
                    log.exception("LIP %d: system call could not be answered", lip.id)
                    self._condemn(lip, f"killed: the kernel could not answer a system call "
                                       f"({type(e).__name__}: {e})")

    def _poll(self) -> list:
        """(LIP, slot) of every new request in the rings whose doorbells rang, or in every ring
        every FULL_POLL_S (a LIP whose bell is muted, or that does not ring, is served so)."""
        out = []
        rung = self.door.take_rung()
        now = time.monotonic()
        if now - self._full_poll_at >= FULL_POLL_S:
            self._full_poll_at = now
            lips = list(self.lips.values())
        else:
            by_bell = self._by_bell
            lips = [by_bell[fd] for fd in rung if fd in by_bell]
        for lip in lips:
            if lip.state != Serving.RUNNING:
                continue
            try:
                slots = lip.ring.poll()
            except RingError as e:
                self._strike(lip, str(e))
                continue
            out.extend((lip, s) for s in slots)
        return out

    # ------------------------------------------------------------------ LIP lifecycle (syscall thread)
    def pin_ring(self, ring) -> Future:
        """Register a new LIP's arena as pinned memory on the ring thread (any thread; a
        no-op off CUDA). Asked before the LIP is added, so it runs before the ring's release."""
        if not self.pin_arenas:
            done: Future = Future()
            done.set_result(None)
            return done
        base, size = ring.arena_range()
        return self.rings.submit(lambda: pin_arena(base, size, True))

    def add(self, lip: LipProc) -> None:
        """Take over ``lip`` (built on the event loop) and start serving it."""
        lip.state = Serving.RUNNING
        lip.admitted = self._admitted
        self._admitted += 1
        self.lips[lip.id] = lip           # (its arena was pinned before its worker forked: pin_ring)
        self._by_bell[lip.ring.bell_fd] = lip
        self._full_poll_at = float("-inf")   # it may have rung before: look at every ring next
        self._publish()

    def remove(self, lip_id: int) -> tuple[LipCounters, int]:
        """The LIP is gone: reclaim its handles, anonymous files and ring.
        Returns its last counters (for `ps`'s finished list) and the most KV
        pages it held at once (its program's next admission estimate)."""
        lip = self.lips.pop(lip_id, None)
        if lip is None:
            return LipCounters(), 0
        lip.state = Serving.EXITED
        self._by_bell.pop(lip.ring.bell_fd, None)
        self.sched.drop_lip(lip.id)
        self.residency.forget(lip.id)
        peak = self.fs.quotas.peak(lip.id)
        closed = self.fs.exit_process(lip.id)
        ring = lip.ring
        ring.unlink()
        arena = ring.arena_range() if self.pin_arenas and not ring.closed else None
        finish = ring.detach()                        # no more polling: the rest on the ring thread

        def release() -> None:
            if arena is not None:
                pin_arena(*arena, False)
            finish()
        self.rings.submit(release)
        log.info("LIP %d (%s) reclaimed: %d KV handles closed", lip.id, lip.filename, closed)
        return lip.counters, peak

    def give_input(self, lip_id: int, data: Optional[str]) -> None:
        lip = self.lips.get(lip_id)
        if lip is None:
            return
        if data is None:
            lip.eof = True
        else:
            lip.inbox.append(data)
        self.messages.serve_recv(lip)

    def credit_output(self, lip_id: int, n: int) -> None:
        """``n`` bytes of the LIP's output left the kernel (`MessageCalls.credit_output`)."""
        self.messages.credit_output(lip_id, n)

    def _strike(self, lip: LipProc, why: str) -> None:
        lip.strikes += 1
        log.warning("LIP %d: malformed ring entry (%s), strike %d", lip.id, why, lip.strikes)
        if lip.strikes >= MAX_STRIKES:
            self._condemn(lip, f"killed: {lip.strikes} malformed system calls ({why})")

    def _condemn(self, lip: LipProc, reason: str) -> None:
        """running -> killing: stop reading its calls and ask the event loop
        (the process table's owner) to kill it."""
        if lip.state == Serving.RUNNING:
            lip.state = Serving.KILLING
            self.kill(lip.id, reason)

    def _publish(self) -> None:
        """Replace `snapshot` with what this thread serves now (O(LIPs), publish.py)."""
        self.snapshot = self.publisher.snapshot()
        self._dirty = self.publisher.stale

    # ------------------------------------------------------------------ dispatch
    def _handle(self, lip: LipProc, slot: int) -> None:
        """Serve one request.  Nothing raised here reaches the loop: a call that
        fails is answered with its error, a reply that cannot be written fails
        the LIP (logged)."""
        try:
            req = lip.ring.read_request(slot)
        except RingError as e:
            self._strike(lip, str(e))
            self.answers.error(lip, slot, 0, SyscallFailure("InvalidArgument", "EINVAL",
                                                            f"malformed ring entry: {e}"))
            return
        except Exception as e:                     # e.g. the ring was torn down under us
            self.answers.lost(lip, slot, 0, e)
            return
        lip.calls += 1
        if self.stepper.in_flight and req.op not in self.anytime_ops:
            self.deferred.append((lip, slot, req))       # it may touch the pages the device is writing
            self.host.count("deferred")
            return
        self._dispatch(lip, slot, req)

    def _dispatch(self, lip: LipProc, slot: int, req) -> None:
        """Decode and run one request read from ``lip``'s ``slot``; its reply or error."""
        try:
            body = schema.decode(req.op, req.json)       # the op's typed body: the one shape check
            result = self.dispatch[req.op](lip, slot, req.call_id, body, req.tokens)
            if result is not None:
                self.answers.reply(lip, slot, req.call_id, result)
        except schema.SchemaError as e:
            if isinstance(e, schema.Undecodable):
                self._strike(lip, "bad JSON")
            code = "ENOSYS" if isinstance(e, schema.UnknownOp) else "EINVAL"
            self.answers.error(lip, slot, req.call_id, SyscallFailure("InvalidArgument", code, str(e)))
        except Exception as e:
            self.answers.error(lip, slot, req.call_id, e)
