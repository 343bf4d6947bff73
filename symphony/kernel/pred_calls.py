"""The pred system call, syscall side: ring entries become calls, checked once at
submission; the scheduler forms each step; KVFS and the engine's runner run it
(masks, top-k and sampling on the device, `symphony.engine.sampler`); the
replies are written here (the arena copies of logits and top-k).

`PredCalls` is a part of `SyscallServer` (the syscall thread owns everything it touches).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from symphony.engine.runner import Want
from symphony.engine.sampler import SamplingError, SamplingParams, check_sampling
from symphony.ipc import abi
from symphony.ipc.kernel_side import KernelSide
from symphony.ipc.schema import Pred
from symphony.kvfs import KVPred
from symphony.sched import Call

from .failure import SyscallFailure, fail as _fail
from .proc import LipProc

log = logging.getLogger("symphony.syscalls")


@dataclass
class _Pending:
    lip: LipProc
    slot: int
    call_id: int
    kv: int
    tokens: list                    # [n] token ids, checked
    positions: Optional[list]       # [n] or None: continue the file
    all_logits: bool
    want: Want


class PredCalls:
    """pred(): submission, steps, delivery (mixed into SyscallServer)."""

    def _pred(self, lip, slot, cid, req: Pred, toks):
        n, n_mask, out = req.n_tokens, req.n_mask_words, req.output     # typed and bounded by the schema
        words = (self.vocab + 31) // 32
        if n_mask and n_mask != words:
            _fail("InvalidArgument", "EINVAL", f"a mask is {words} uint32 words, got {n_mask}")
        if toks.size != n + n_mask:
            _fail("InvalidArgument", "EINVAL", f"token array holds {toks.size} ids, body says {n}+{n_mask}")
        sampling = SamplingParams()
        if out == "sample":                          # fail before the forward pass, not after
            try:
                sampling = check_sampling(*req.sampling)
            except SamplingError as e:
                _fail("InvalidArgument", "EINVAL", str(e))
        rows = n if req.all_logits else 1
        k = req.k
        if out in ("logits", "topk"):
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
        all_logits = req.all_logits
        # the one validation of the call: handle, tokens, positions, length limit, quota
        tokens, positions = self.fs.check_pred(lip.principal, req.kv, toks[:n], req.positions, all_logits)
        want = Want(out, k, mask, sampling)
        pend = _Pending(lip, slot, cid, req.kv, tokens, positions, all_logits, want)
        self.sched.add(Call(key=(lip.id, pend.kv), lip=lip.id, user=lip.user, n_tokens=n,
                            priority=lip.priority, payload=pend, arrival=time.monotonic()))
        lip.last_active = time.monotonic()
        return None

    def _run_step(self) -> bool:
        """Find the queued calls device pages (residency.py), run the
        scheduler's next step of them as one forward pass and reply to the
        calls it completes; False if no call could be scheduled (all wait for
        pages).  A call that fails is answered with its error (KVFS undid its
        earlier chunks); the others in the step are unaffected."""
        self._plan_memory()
        step = self.sched.schedule(time.monotonic())
        if step is None:
            self._memory_stalled()
            return False
        self._memory_moved()
        items = [(c, start, n) for c, start, n in step.items if c.payload.lip.state == "running"]
        if not items:
            return True
        calls = []
        for c, start, n in items:
            p: _Pending = c.payload
            final = start + n == c.n_tokens
            calls.append(KVPred(p.lip.principal, p.kv, p.tokens[start:start + n],
                                None if p.positions is None else p.positions[start:start + n],
                                p.all_logits and final, p.want if final else Want(), fed=start))
        t0 = time.perf_counter()
        results = self.fs.run_preds(calls)
        # wait for the last step's late callers at most a quarter of a forward pass (<= 50 ms)
        self.sched.gather_s = min(0.050, 0.25 * (time.perf_counter() - t0))
        self.batches += 1
        self.batch_calls += len(items)
        self.max_batch = max(self.max_batch, len(items))
        finals = []
        for (c, start, n), r in zip(items, results):
            p = c.payload
            if r.error is not None:
                self.sched.queue = [q for q in self.sched.queue if q is not c]   # drop its other chunks
                self._fail_call(p, r.error)
                continue
            if start + n < c.n_tokens:
                continue                       # more chunks to come
            p.lip.preds += 1
            p.lip.tokens += len(p.tokens)
            try:
                finals.append((p, self._deliver(p, r.value)))
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
        return True

    def _fail_call(self, p: _Pending, e: BaseException) -> None:
        """Answer one call with its error; if even that fails (a reply that
        does not fit, a broken ring), kill its LIP: never the thread."""
        if isinstance(e, SamplingError):
            e = SyscallFailure("InvalidArgument", "EINVAL", str(e))
        try:
            self._reply_error(p.lip, p.slot, p.call_id, e)
        except Exception as e2:
            log.exception("LIP %d: could not reply to a failed call", p.lip.id)
            if p.lip.state == "running":
                p.lip.state = "killing"
                self.kill(p.lip.id, f"killed: the kernel could not answer a system call ({e2})")

    def _deliver(self, p: _Pending, value):
        """Queue the copy of a call's result (computed on the device by the
        runner) to the host, into the LIP's arena where it is an array; returns
        the function that replies once the copies are done.  No call waits for
        the device on its own."""
        length = self.fs.handles[p.kv].inode.length
        out = p.want.output
        if out == "logits":
            rows = value.shape[0]                                 # value: [rows, vocab]
            view = p.lip.ring.arena(p.slot, rows, self.vocab)
            torch.from_numpy(view).copy_(value, non_blocking=True)   # a DMA into the pinned arena
            return lambda: self._reply(p.lip, p.slot, p.call_id, {"length": length},
                                       (abi.ARENA_LOGITS, rows, self.vocab))
        if out == "topk":
            lp, ids = value                                       # [rows, k] float32, [rows, k] int32
            rows, k = lp.shape
            lp_h, ids_h = lp.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True)

            def reply_topk():
                view = p.lip.ring.arena(p.slot, 2 * rows, k)
                view[:rows] = ids_h.numpy().view(np.float32)
                view[rows:] = lp_h.numpy()
                self._reply(p.lip, p.slot, p.call_id, {"length": length}, (abi.ARENA_TOPK, 2 * rows, k))
            return reply_topk
        toks_h = value.to("cpu", non_blocking=True)               # [rows] token ids

        def reply_tokens():
            toks = toks_h.tolist()
            self._reply(p.lip, p.slot, p.call_id, {"length": length, "token": toks[-1], "tokens": toks})
        return reply_tokens


def arena_range(ring: KernelSide) -> tuple[int, int]:
    """(address, bytes) of a LIP's arenas in this process."""
    return ring._u8.ctypes.data + ring._arena_off, ring.n_slots * ring.arena_bytes


def pin_arena(base: int, size: int, on: bool) -> None:
    """Register (or unregister) a LIP's arena as pinned host memory, so the
    device-to-host copy of logits is a DMA straight into the LIP's view. Slow
    (some milliseconds): the kernel runs it on its ring thread (RingThread)."""
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(base, size, 0) if on else cudart.cudaHostUnregister(base)
        if int(rc) != 0:
            log.warning("cudaHost%sregister of a LIP arena failed (%s)", "" if on else "Un", rc)
    except Exception as e:                       # pinning is an optimisation: never fatal
        log.warning("could not %spin a LIP arena: %s", "" if on else "un", e)
