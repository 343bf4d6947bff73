"""The system-call layer: one thread that owns the engine and KVFS.

Loop (never blocks on a LIP):
    1. run control commands from the event loop (add/remove LIP, input, ...)
    2. poll every LIP's slots for requests; validate and dispatch each:
       KVFS and message calls are answered at once, pred calls are queued,
       capability calls go to a thread pool, recv waits for input
    3. if pred calls are queued, run them as one batch (one forward pass)
    4. nothing to do: wait on the LIPs' doorbells (spin briefly, then block)

Every request is hostile until checked: a malformed ring entry is answered
with EINVAL and counted; a LIP with too many strikes is killed.  Errors are
replied as {"error": code, "type": name, "message": text}.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import orjson
import torch

from symphony.ipc import abi
from .capabilities import Capabilities
from .failure import SyscallFailure, fail as _fail
from symphony.engine.engine import PredError
from symphony.kvfs import KVFS, KVFSError, KVPred, Principal
from symphony.engine.page_allocator import OutOfPages
from symphony.ipc.protocol import encode_frame
from .replies import ReplyStore, truncate_message
from symphony.sched import BatchScheduler, Call, LipView, swap_out_order
from symphony.ipc.shm import RESP_BODY_OFF, KernelSide, RingError

log = logging.getLogger("symphony.syscalls")

MAX_STRIKES = 8
MAX_MESSAGE_BYTES = 1 << 20
MAX_QUEUED_OUTPUT = 1 << 20     # per LIP: output bytes not yet taken by its client before send() waits
# sampling parameters a pred(output="sample") may ask for
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-4, 100.0

MAX_CRASHES = 20        # unexpected loop errors within CRASH_WINDOW_S before the kernel gives up
CRASH_WINDOW_S = 10.0


class InjectedFault(Exception):
    """Raised in the syscall loop by the --test-hooks ``syscall_crash`` hook."""




@dataclass
class LipProc:
    """The kernel's record of one LIP."""

    id: int
    user: str
    filename: str
    args: list
    ring: KernelSide
    grants: dict
    limits: dict
    pid: int = 0
    priority: int = 0
    owner_uid: int = -1         # the submitting user's Unix identity, for file capabilities
    owner_gid: int = -1         # (-1: unknown -> they read as nobody)
    owner_groups: tuple = ()
    caps_in_flight: int = 0
    last_active: float = field(default_factory=time.monotonic)
    blocked_since: float = 0.0
    state: str = "starting"
    started: float = field(default_factory=time.time)
    inbox: deque = field(default_factory=deque)
    eof: bool = False
    parked_recv: Optional[tuple] = None
    strikes: int = 0
    calls: int = 0
    preds: int = 0
    tokens: int = 0
    replies: ReplyStore = field(default_factory=ReplyStore)   # chunked replies awaiting FETCH
    out_bytes: int = 0              # output emitted to the client, not yet taken (back-pressure)
    parked_out: deque = field(default_factory=deque)          # (slot, call_id) of sends waiting for room

    @property
    def principal(self) -> Principal:
        return Principal(self.user, self.id)


@dataclass
class _Pending:
    lip: LipProc
    slot: int
    call_id: int
    body: dict
    tokens: np.ndarray
    mask: Optional[np.ndarray]
    orig_len: int = -1          # the file's length before the first chunk (rollback)


class SyscallServer:
    def __init__(self, engine, fs: KVFS, doorbell, emit: Callable[[int, dict], None],
                 kill: Callable[[int, str], None], max_batch_tokens: Optional[int] = None,
                 chunk_tokens: Optional[int] = None, caps: Optional[Capabilities] = None,
                 max_queued_output: int = MAX_QUEUED_OUTPUT,
                 on_fatal: Optional[Callable[[str], None]] = None):
        self.engine, self.fs, self.door = engine, fs, doorbell
        self.emit, self.kill = emit, kill
        self.max_queued_output = max_queued_output
        self.on_fatal = on_fatal          # the thread cannot go on: shut the kernel down (any thread)
        self.crashes: deque = deque(maxlen=MAX_CRASHES)
        self.vocab = engine.model_config.vocab_size
        # tokens per forward pass: on a CPU a prefill token costs ~100x a decode
        # step's share, so a small budget keeps every step (and every decoder) short
        default = 256 if engine.device.type == "cpu" else 2048
        self.max_batch_tokens = min(max_batch_tokens or default, engine.config.max_batch_tokens)
        chunk_tokens = chunk_tokens or max(8, self.max_batch_tokens // 2)
        self.lips: dict[int, LipProc] = {}
        self.commands: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self.sched = BatchScheduler(token_budget=self.max_batch_tokens, chunk_tokens=chunk_tokens,
                                    gather_s=0.003)
        fs.evict_first = self._blocked_pids
        self.caps = caps or Capabilities(max_bytes=MAX_MESSAGE_BYTES)
        self.stop = threading.Event()
        self.batches = 0
        self.batch_calls = 0
        self.max_batch = 0
        self.thread = threading.Thread(target=self.run, name="symphony-syscalls", daemon=True)

    # ------------------------------------------------------------------ control (any thread)
    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the syscall thread (it owns the engine and KVFS)."""
        self.commands.put(fn)
        self.door.ring()

    def call_future(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on the syscall thread; a Future of its result (or error).
        Never blocks: the event loop awaits it with ``asyncio.wrap_future``."""
        fut: Future = Future()

        def run():
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as e:       # handed back to the caller
                fut.set_exception(e)
        self.submit(run)
        return fut

    def call(self, fn: Callable[[], object], timeout: Optional[float] = 30.0):
        """Run ``fn`` on the syscall thread and wait for its result (not from
        the event loop).  A timeout raises TimeoutError in the caller only: the
        call still runs when the thread gets to it."""
        try:
            return self.call_future(fn).result(timeout)
        except TimeoutError:
            raise TimeoutError(f"kernel syscall thread did not answer in {timeout} s") from None

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
        log.info("syscall thread running")
        while not self.stop.is_set():
            try:
                self._serve()
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
            self._run_commands()
            work = self._poll()
            for lip, slot in work:
                self._handle_safely(lip, slot)
            if len(self.sched):
                if self.sched.should_wait(time.perf_counter()):
                    continue                   # the last step's callers are coming back: poll again
                self._run_step()
                continue
            if not work:
                self.door.wait(0.05, self._has_work)      # short: muted LIP bells are polled
        log.info("syscall thread stopped")

    def _handle_safely(self, lip: LipProc, slot: int) -> None:
        """`_handle`, contained: an error it could not answer (a reply that does
        not fit, a bug in a handler's error path) kills that LIP, not the thread."""
        try:
            self._handle(lip, slot)
        except Exception as e:
            log.exception("LIP %d: system call could not be answered", lip.id)
            if lip.state == "running":
                lip.state = "killing"
                self.kill(lip.id, f"killed: the kernel could not answer a system call ({type(e).__name__}: {e})")

    def _has_work(self) -> bool:
        if not self.commands.empty():
            return True
        return any(l.ring.pending() for l in self.lips.values() if l.state == "running")

    def _run_commands(self) -> None:
        while True:
            try:
                fn = self.commands.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except InjectedFault:
                raise
            except Exception:
                log.exception("kernel command failed")

    def _poll(self) -> list:
        out = []
        for lip in list(self.lips.values()):
            if lip.state != "running":
                continue
            try:
                slots = lip.ring.poll()
            except RingError as e:
                self._strike(lip, str(e))
                continue
            out.extend((lip, s) for s in slots)
        return out

    # ------------------------------------------------------------------ LIP lifecycle (syscall thread)
    def add(self, lip: LipProc) -> None:
        self.lips[lip.id] = lip
        if self.engine.device.type == "cuda":
            _pin(lip.ring, True)


    def remove(self, lip_id: int) -> None:
        """The LIP is gone: reclaim its handles, anonymous files and ring."""
        lip = self.lips.pop(lip_id, None)
        if lip is None:
            return
        lip.state = "exited"
        self.sched.drop_lip(lip.id)
        closed = self.fs.exit_process(lip.id)
        if self.engine.device.type == "cuda":
            _pin(lip.ring, False)
        lip.ring.unlink()
        lip.ring.close()
        log.info("LIP %d (%s) reclaimed: %d KV handles closed", lip.id, lip.filename, closed)

    def give_input(self, lip_id: int, data: Optional[str]) -> None:
        lip = self.lips.get(lip_id)
        if lip is None:
            return
        if data is None:
            lip.eof = True
        else:
            lip.inbox.append(data)
        self._serve_recv(lip)

    def _strike(self, lip: LipProc, why: str) -> None:
        lip.strikes += 1
        log.warning("LIP %d: malformed ring entry (%s), strike %d", lip.id, why, lip.strikes)
        if lip.strikes >= MAX_STRIKES and lip.state == "running":
            lip.state = "killing"
            self.kill(lip.id, f"killed: {lip.strikes} malformed system calls ({why})")

    # ------------------------------------------------------------------ dispatch
    def _handle(self, lip: LipProc, slot: int) -> None:
        """Serve one request.  Nothing raised here reaches the loop: a call that
        fails is answered with its error, a reply that cannot be written fails
        the LIP (logged)."""
        try:
            req = lip.ring.read_request(slot)
        except RingError as e:
            self._strike(lip, str(e))
            self._reply_error(lip, slot, 0, SyscallFailure("InvalidArgument", "EINVAL",
                                                           f"malformed ring entry: {e}"))
            return
        except Exception as e:                     # e.g. the ring was torn down under us
            self._lost(lip, slot, 0, e)
            return
        lip.calls += 1
        try:
            body = orjson.loads(req.json) if req.json else {}
            if not isinstance(body, dict):
                _fail("InvalidArgument", "EINVAL", "a system call body must be a JSON object")
            handler = self._handlers.get(req.op)
            if handler is None:
                _fail("InvalidArgument", "ENOSYS", f"unknown system call {req.op}")
            result = handler(self, lip, slot, req.call_id, body, req.tokens)
            if result is not None:
                self._reply(lip, slot, req.call_id, result)
        except orjson.JSONDecodeError as e:
            self._strike(lip, "bad JSON")
            self._reply_error(lip, slot, req.call_id, SyscallFailure("InvalidArgument", "EINVAL",
                                                                     f"malformed JSON body: {e}"))
        except Exception as e:
            self._reply_error(lip, slot, req.call_id, e)

    def _reply(self, lip, slot, call_id, body: dict, arena=(abi.ARENA_NONE, 0, 0)) -> None:
        """Answer a call with ``body``.  A body larger than the slot is kept for
        the LIP to FETCH in chunks (see replies.py); if even that fails, the
        call is answered with the error.  Never raises."""
        if lip.state not in ("running", "killing"):
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
            self._reply_error(lip, slot, call_id, e)

    def _reply_error(self, lip, slot, call_id, e: BaseException) -> None:
        """Answer a call with the error ``e``; its message is cut to a bounded
        size, so it always fits the slot.  Never raises."""
        try:
            if isinstance(e, SyscallFailure):
                t, code, msg = e.type, e.code, str(e)
            elif isinstance(e, KVFSError):
                t, code, msg = type(e).__name__, e.code, str(e)
            elif isinstance(e, PredError):
                t, code, msg = "PredError", "EINVAL", str(e)
            elif isinstance(e, OutOfPages):
                t, code, msg = "NoSpace", "ENOSPC", str(e)
            else:
                log.error("LIP %d: system call failed unexpectedly", lip.id, exc_info=e)
                t, code, msg = "SyscallError", "EIO", f"internal error: {type(e).__name__}: {e}"
            if lip.state in ("running", "killing"):
                body = {"error": str(code)[:32], "type": str(t)[:64], "message": truncate_message(str(msg))}
                lip.ring.respond(slot, call_id, abi.ERR, orjson.dumps(body))
        except Exception as e2:
            self._lost(lip, slot, call_id, e2)

    def _lost(self, lip, slot, call_id, e: BaseException) -> None:
        """A call could not be answered at all: its thread would wait forever, so
        the LIP is killed (a torn-down LIP is simply forgotten)."""
        try:
            if lip.state == "running":
                log.error("LIP %d: no reply could be written to slot %s (call %s): %r", lip.id, slot, call_id, e)
                lip.state = "killing"
                self.kill(lip.id, "killed: a system call reply could not be written")
        except Exception:
            log.exception("LIP %d: could not be failed", getattr(lip, "id", -1))

    # ------------------------------------------------------------------ handlers
    def _nop(self, lip, slot, cid, body, toks):
        return {}

    def _info(self, lip, slot, cid, body, toks):
        c = self.engine.model_config
        return {"lip": lip.id, "user": lip.user, "grants": lip.grants, "limits": lip.limits,
                "vocab_size": c.vocab_size, "max_context": c.max_context,
                "eos_ids": list(self.engine.tokenizer.eos_ids) if self.engine.tokenizer else []}

    def _pred(self, lip, slot, cid, body, toks):
        n = _int(body.get("n_tokens"), "n_tokens", 1, abi.MAX_TOKENS_PER_CALL)
        n_mask = _int(body.get("n_mask_words", 0), "n_mask_words", 0, (self.vocab + 31) // 32)
        if n_mask and n_mask != (self.vocab + 31) // 32:
            _fail("InvalidArgument", "EINVAL", f"a mask is {(self.vocab + 31) // 32} uint32 words, got {n_mask}")
        if toks.size != n + n_mask:
            _fail("InvalidArgument", "EINVAL", f"token array holds {toks.size} ids, body says {n}+{n_mask}")
        out = body.get("output", "logits")
        if out not in abi.OUTPUTS:
            _fail("InvalidArgument", "EINVAL", f"output must be one of {abi.OUTPUTS}")
        if out == "sample":
            check_sampling(body)                     # fail before the forward pass, not after
        rows = n if body.get("all_logits") else 1
        if out in ("logits", "topk"):
            k = _int(body.get("k", 20), "k", 1, 1024) if out == "topk" else self.vocab
            need = rows * (2 * k if out == "topk" else self.vocab) * 4
            if need > lip.ring.arena_bytes:
                _fail("InvalidArgument", "EINVAL", f"{rows} rows of {out} need {need} bytes; the arena "
                      f"holds {lip.ring.arena_bytes} (ask for fewer rows, or top-k)")
        mask = None
        if n_mask:                                   # bit i of the words: token i allowed
            bits = np.unpackbits(np.ascontiguousarray(toks[n:]).view(np.uint8), bitorder="little")
            mask = bits[: self.vocab].astype(bool)
            if not mask.any():
                _fail("InvalidArgument", "EINVAL", "the mask allows no token")
        positions = body.get("positions")
        self.fs.check_pred(lip.principal, body.get("kv"), toks[:n], positions, bool(body.get("all_logits")))
        if positions is not None and len(positions) != n:
            _fail("InvalidArgument", "EINVAL", "positions and tokens differ in length")
        pend = _Pending(lip, slot, cid, body, toks[:n], mask)
        self.sched.add(Call(key=(lip.id, body.get("kv")), lip=lip.id, user=lip.user, n_tokens=n,
                            priority=lip.priority, payload=pend, arrival=time.monotonic()))
        lip.last_active = time.monotonic()
        return None

    def _run_step(self) -> None:
        """Run the scheduler's next step as one forward pass; reply to the calls
        it completes.  A call that fails is answered with its error (its
        earlier chunks rolled back); the others in the step are unaffected."""
        step = self.sched.schedule(time.monotonic())
        if step is None:
            return
        items = [(c, start, n) for c, start, n in step.items if c.payload.lip.state == "running"]
        if not items:
            return
        calls = []
        for c, start, n in items:
            p: _Pending = c.payload
            if start == 0:
                p.orig_len = self.fs.handles[p.body["kv"]].inode.length if p.body["kv"] in self.fs.handles else 0
            pos = p.body.get("positions")
            final = start + n == c.n_tokens
            calls.append(KVPred(p.lip.principal, p.body.get("kv"), p.tokens[start:start + n],
                                None if pos is None else pos[start:start + n],
                                bool(p.body.get("all_logits")) and final))
        t0 = time.perf_counter()
        try:
            outs = self.fs.pred_batch(calls)
            results = [(it, o, None) for it, o in zip(items, outs)]
            # wait for the last step's late callers at most a quarter of a forward pass (<= 50 ms)
            self.sched.gather_s = min(0.050, 0.25 * (time.perf_counter() - t0))
        except Exception:
            results = []                       # find the culprit(s): run each alone
            for it, kc in zip(items, calls):
                try:
                    results.append((it, self.fs.pred_batch([kc])[0], None))
                except Exception as e:
                    results.append((it, None, e))
        self.batches += 1
        self.batch_calls += len(items)
        self.max_batch = max(self.max_batch, len(items))
        finals = []
        for (c, start, n), logits, err in results:
            p = c.payload
            if err is not None:
                self._abandon(c, err)
                continue
            if start + n < c.n_tokens:
                continue                       # more chunks to come
            p.lip.preds += 1
            p.lip.tokens += int(p.tokens.size)
            try:
                finals.append((p, self._deliver(p, logits)))
            except Exception as e:
                self._fail_call(p, e)
        # every call's copies to the host are queued: wait for them once, not once a call
        if finals and self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()
        for p, reply in finals:
            try:
                reply()
            except Exception as e:
                self._fail_call(p, e)

    def _fail_call(self, p: _Pending, e: BaseException) -> None:
        """Answer one call with its error; if even that fails (a reply that
        does not fit, a broken ring), kill its LIP: never the thread."""
        try:
            self._reply_error(p.lip, p.slot, p.call_id, e)
        except Exception as e2:
            log.exception("LIP %d: could not reply to a failed call", p.lip.id)
            if p.lip.state == "running":
                p.lip.state = "killing"
                self.kill(p.lip.id, f"killed: the kernel could not answer a system call ({e2})")

    def _abandon(self, c: Call, err: BaseException) -> None:
        """A call failed: drop its remaining chunks, undo its fed ones, reply."""
        p: _Pending = c.payload
        self.sched.queue = [q for q in self.sched.queue if q is not c]
        if p.orig_len >= 0 and c.done > 0:
            try:
                inode = self.fs.handles[p.body["kv"]].inode
                if inode.length > p.orig_len:
                    self.fs.truncate(p.lip.principal, p.body["kv"], p.orig_len)
            except Exception:
                log.exception("LIP %d: rollback of a failed chunked pred failed", p.lip.id)
        self._fail_call(p, err)

    def _blocked_pids(self) -> list[int]:
        views = [LipView(l.id, l.priority, l.parked_recv is not None or l.caps_in_flight > 0,
                         l.blocked_since, l.last_active, 1) for l in self.lips.values()]
        blocked = {v.id for v in views if v.blocked}
        return [i for i in swap_out_order(views) if i in blocked]

    def _deliver(self, p: _Pending, logits: torch.Tensor):
        """Compute what the call asked for where the logits are (the GPU on a
        GPU engine) and queue its copy to the host; returns the function that
        replies once the copies are done.  Only what the call asked for crosses
        to the host, and no call waits for the device on its own."""
        b = p.body
        x = (logits if logits.dim() == 2 else logits.unsqueeze(0)).float()   # [rows, vocab]
        if p.mask is not None:
            x = x.masked_fill(~torch.from_numpy(p.mask).to(x.device), float("-inf"))
        length = self.fs.handles[b["kv"]].inode.length
        out = b.get("output", "logits")
        rows = x.shape[0]
        if out == "logits":
            view = p.lip.ring.arena(p.slot, rows, self.vocab)
            torch.from_numpy(view).copy_(x, non_blocking=True)   # a DMA into the pinned arena
            return lambda: self._reply(p.lip, p.slot, p.call_id, {"length": length},
                                       (abi.ARENA_LOGITS, rows, self.vocab))
        if out == "topk":
            k = int(b.get("k", 20))
            lp, ids = torch.log_softmax(x, dim=-1).topk(k, dim=-1)
            lp_h = lp.to("cpu", non_blocking=True)
            ids_h = ids.to(torch.int32).to("cpu", non_blocking=True)

            def reply_topk():
                view = p.lip.ring.arena(p.slot, 2 * rows, k)
                view[:rows] = ids_h.numpy().view(np.float32)
                view[rows:] = lp_h.numpy()
                self._reply(p.lip, p.slot, p.call_id, {"length": length}, (abi.ARENA_TOPK, 2 * rows, k))
            return reply_topk
        toks_h = (x.argmax(-1) if out == "argmax" else _sample(x, b)).to("cpu", non_blocking=True)

        def reply_tokens():
            toks = toks_h.tolist()
            self._reply(p.lip, p.slot, p.call_id, {"length": length, "token": toks[-1], "tokens": toks})
        return reply_tokens

    def _kv(self, fn):
        def h(self, lip, slot, cid, body, toks):
            return fn(self, lip.principal, body)
        return h

    def _send(self, lip, slot, cid, body, toks):
        if "data" not in body:
            _fail("InvalidArgument", "EINVAL", "send needs data")
        data = body["data"]
        if len(orjson.dumps(data)) > MAX_MESSAGE_BYTES:
            _fail("InvalidArgument", "EINVAL", f"message larger than {MAX_MESSAGE_BYTES} bytes")
        return self._emit_output(lip, slot, cid, {"event": "out", "data": data})

    def _write_stream(self, lip, slot, cid, body, toks):
        stream, data = body.get("stream"), body.get("data")
        if stream not in ("stdout", "stderr") or not isinstance(data, str):
            _fail("InvalidArgument", "EINVAL", "bad stream write")
        return self._emit_output(lip, slot, cid, {"event": stream, "data": data[:MAX_MESSAGE_BYTES]})

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

    def credit_output(self, lip_id: int, n: int) -> None:
        """The event loop says ``n`` bytes of the LIP's output left the kernel
        (taken by the client, or dropped): wake parked senders if there is room."""
        lip = self.lips.get(lip_id)
        if lip is None:
            return
        lip.out_bytes = max(0, lip.out_bytes - n)
        while lip.parked_out and lip.out_bytes <= self.max_queued_output:
            slot, cid = lip.parked_out.popleft()
            self._reply(lip, slot, cid, {})

    def _fetch(self, lip, slot, cid, body, toks):
        """The next chunk of a reply too large for a slot: raw bytes, not JSON."""
        rid = _int(body.get("id"), "id", 1, 1 << 62)
        off = _int(body.get("offset"), "offset", 0, 1 << 62)
        try:
            chunk = lip.replies.take(rid, off, lip.ring.slot_bytes - RESP_BODY_OFF)
        except (KeyError, IndexError) as e:
            _fail("InvalidArgument", "EINVAL", f"fetch: {e.args[0]}")
        if lip.state in ("running", "killing"):
            lip.ring.respond(slot, cid, abi.OK, chunk)
        return None

    def _recv(self, lip, slot, cid, body, toks):
        if lip.parked_recv is not None:
            _fail("InvalidArgument", "EBUSY", "another thread of this LIP is already in recv()")
        lip.parked_recv = (slot, cid)
        lip.blocked_since = time.monotonic()
        self._serve_recv(lip)
        return None

    def _serve_recv(self, lip: LipProc) -> None:
        if lip.parked_recv is None or not (lip.inbox or lip.eof):
            return
        slot, cid = lip.parked_recv
        lip.parked_recv = None
        self._reply(lip, slot, cid, {"data": lip.inbox.popleft()} if lip.inbox else {"eof": True})

    def _cap(self, op: str):
        """A capability call: run on the capability pool (policy, per-LIP share,
        deadline: see capabilities/), answered from the syscall thread."""
        def h(self, lip, slot, cid, body, toks):
            def done(res, err):
                def reply():
                    lip.caps_in_flight -= 1
                    if err is None:
                        self._reply(lip, slot, cid, res)
                    else:
                        self._reply_error(lip, slot, cid, err)
                self.submit(reply)
            lip.caps_in_flight += 1
            lip.blocked_since = time.monotonic()
            self.caps.submit(lip, op, body, done)
            return None
        return h

    _handlers: dict = {}


def _pin(ring: KernelSide, on: bool) -> None:
    """Register (or unregister) a LIP's arena as pinned host memory, so the
    device-to-host copy of logits is a DMA straight into the LIP's view."""
    try:
        cudart = torch.cuda.cudart()
        base = ring._u8.ctypes.data + ring._arena_off
        size = ring.n_slots * ring.arena_bytes
        rc = cudart.cudaHostRegister(base, size, 0) if on else cudart.cudaHostUnregister(base)
        if int(rc) != 0:
            log.warning("cudaHost%sregister of a LIP arena failed (%s)", "" if on else "Un", rc)
    except Exception as e:                       # pinning is an optimisation: never fatal
        log.warning("could not %spin a LIP arena: %s", "" if on else "un", e)


# ---------------------------------------------------------------- KVFS calls
def _path(body, key="path", optional=False):
    v = body.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        _fail("InvalidArgument", "EINVAL", f"{key} must be a string path")
    return v


def _int(v, name, lo, hi):
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        _fail("InvalidArgument", "EINVAL", f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def check_sampling(b: dict) -> tuple:
    """Validate a pred call's sampling parameters: (temperature, top_p, top_k, seed).
    InvalidArgument (a SyscallFailure) names the bad one."""
    t = b.get("temperature", 1.0)
    top_p, top_k, seed = b.get("top_p", 1.0), b.get("top_k", 0), b.get("seed")
    if not _number(t) or not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):
        _fail("InvalidArgument", "EINVAL", f"temperature must be 0 (greedy) or a number in "
              f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t!r}")
    if not _number(top_p) or not 0 < top_p <= 1:
        _fail("InvalidArgument", "EINVAL", f"top_p must be a number in (0, 1], got {top_p!r}")
    if top_k is None:
        top_k = 0
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= 1 << 31:
        _fail("InvalidArgument", "EINVAL", f"top_k must be an int >= 0 (0: no top-k), got {top_k!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        _fail("InvalidArgument", "EINVAL", f"seed must be an int or null, got {seed!r}")
    return t, top_p, top_k, seed


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sample(x: torch.Tensor, b: dict) -> torch.Tensor:
    """Sample one token per row of ``x`` [rows, vocab] (masked logits, -inf where
    disallowed) with the call's temperature / top_k / top_p / seed."""
    t, top_p, top_k, seed = check_sampling(b)
    if t == 0:
        return x.argmax(-1)
    x = x / t                                           # [rows, vocab]
    if 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]    # [rows, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)                    # [rows, vocab]
    if top_p < 1:
        sp, si = probs.sort(dim=-1, descending=True)
        drop = sp.cumsum(-1) - sp >= top_p            # the smallest set holding top_p
        sp = sp.masked_fill(drop, 0)
        probs = torch.zeros_like(probs).scatter(-1, si, sp)
    bad = ~torch.isfinite(probs).all(-1) | ~(probs.sum(-1) > 0)     # [rows]
    if x.device.type == "cpu":
        if bool(bad.any()):
            _fail("InvalidArgument", "EINVAL", "the logits give no valid distribution to sample from "
                  "(non-finite after temperature and masking): use another temperature, or argmax")
    else:                                               # no device sync per call: such rows go greedy
        greedy = torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(probs.dtype)
        probs = torch.where(bad.unsqueeze(-1), greedy, torch.nan_to_num(probs, nan=0.0))
    g = torch.Generator(device=x.device)
    if seed is not None:
        g.manual_seed(seed & 0xFFFFFFFFFFFF)
    else:
        g.seed()
    return torch.multinomial(probs, 1, generator=g).squeeze(-1)


def _kv_create(s, who, b):
    h = s.fs.create(who, _path(b, optional=True), b.get("mode"))      # None: KVFS default (0600)
    return {"handle": h}


def _kv_open(s, who, b):
    h = s.fs.open(who, _path(b), b.get("mode", "r"))
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_close(s, who, b):
    s.fs.close(who, b.get("kv"))
    return {}


def _kv_fork(s, who, b):
    h = s.fs.fork(who, b.get("kv"), _path(b, optional=True), b.get("mode"))
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_truncate(s, who, b):
    s.fs.truncate(who, b.get("kv"), b.get("n"))
    return {"length": s.fs.handles[b["kv"]].inode.length}


def _kv_extract(s, who, b):
    h = s.fs.extract(who, b.get("kv"), b.get("ranges"), _path(b, optional=True), b.get("mode"))
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_merge(s, who, b):
    kvs = b.get("kvs")
    h = s.fs.merge(who, kvs, _path(b, optional=True), b.get("mode"))
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_stat(s, who, b):
    return s.fs.stat(who, b["kv"] if "kv" in b else _path(b))


def _kv_list(s, who, b):
    return {"entries": s.fs.list(who, _path(b))}


def _kv_advise(s, who, b):
    s.fs.advise(who, b.get("kv"), b.get("hint"), b.get("seconds"))
    return {}


def _kv_simple(method, *keys):
    def h(s, who, b):
        getattr(s.fs, method)(who, *[(_path(b, k) if k in ("path", "old", "new") else b.get(k)) for k in keys])
        return {}
    return h


S = SyscallServer
S._handlers = {
    abi.NOP: S._nop, abi.INFO: S._info, abi.PRED: S._pred,
    abi.KV_CREATE: S._kv(S, _kv_create), abi.KV_OPEN: S._kv(S, _kv_open),
    abi.KV_CLOSE: S._kv(S, _kv_close), abi.KV_FORK: S._kv(S, _kv_fork),
    abi.KV_TRUNCATE: S._kv(S, _kv_truncate), abi.KV_EXTRACT: S._kv(S, _kv_extract),
    abi.KV_MERGE: S._kv(S, _kv_merge), abi.KV_STAT: S._kv(S, _kv_stat), abi.KV_LIST: S._kv(S, _kv_list),
    abi.KV_ADVISE: S._kv(S, _kv_advise), abi.KV_REMOVE: S._kv(S, _kv_simple("remove", "path")),
    abi.KV_RENAME: S._kv(S, _kv_simple("rename", "old", "new")),
    abi.KV_SYNC: S._kv(S, _kv_simple("sync", "kv")),
    abi.KV_MKDIR: S._kv(S, lambda s, who, b: s.fs.mkdir(who, _path(b), b.get("mode")) or {}),
    abi.KV_RMDIR: S._kv(S, _kv_simple("rmdir", "path")),
    abi.SEND: S._send, abi.RECV: S._recv, abi.WRITE_STREAM: S._write_stream, abi.FETCH: S._fetch,
    abi.CAP_HTTP: S._cap(S, "http"), abi.CAP_READ_FILE: S._cap(S, "read"),
    abi.CAP_LIST_DIR: S._cap(S, "list"),
}
