"""The pred system call on the syscall thread: submission, the step, delivery.

One call is one record, `PredCall` (a `sched.Call` that carries its LIP, its
slot and its `Stage`), from the ring entry to its reply.  It is checked once,
at submission (`PredCalls.pred`: the body against the vocabulary and the
arena, then `KVFS.check_pred`: handle, tokens, positions, length, quota), and
queued in the scheduler.  Each step is one walk (`PredCalls.step`):

    wait = residency.plan(sched.next_chunks())  who waits for pages; suspend, resume (residency.py)
    sched.hold(wait)                            (sched/batch.py)
    batch = sched.schedule(now)                 the chunks of this forward pass
    plan = fs.prepare(chunks)                   page tables: swap-ins, copy-on-write, charges (kvfs/)
    out = engine.runner.run(plan.step)          one forward pass; masks, top-k, sampling on the device
    done = fs.commit(plan, out)                 keep what succeeded, undo what failed (fs.undo if it raised)
    deliver(done)                               copy results into the LIPs' arenas, reply

(a step that writes one file through two handles runs as two passes of the
prepare / run / commit, `KVFS.passes`).  The in-process engine and KVFS's
`pred_batch` use the same pieces (`engine.runner.run_planned`).
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from symphony.engine.runner import Want
from symphony.engine.sampler import SamplingError, SamplingParams, check_sampling
from symphony.ipc import abi
from symphony.ipc.schema import Pred
from symphony.kvfs import KVFS, KVPred
from symphony.sched import BatchScheduler, Call

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.failure import fail as _fail
from symphony.kernel.syscall.proc import LipProc, Serving
from symphony.kernel.syscall.residency import Residency

log = logging.getLogger("symphony.syscalls")


class Stage(enum.Enum):
    """Where a pred call is."""

    QUEUED = "queued"           # checked, in the scheduler, nothing fed yet
    FEEDING = "feeding"         # some chunks fed (chunked prefill), more to come
    REPLYING = "replying"       # fully fed: its result is on its way to the LIP
    DONE = "done"               # answered
    FAILED = "failed"           # answered with its error (KVFS undid its chunks)


@dataclass(eq=False)
class PredCall(Call):
    """One pred() call of a LIP: what the scheduler orders (`sched.Call`), what
    KVFS feeds (`chunk`), where the reply goes, and its `Stage`."""

    proc: Optional[LipProc] = None
    slot: int = 0
    call_id: int = 0
    kv: int = 0                                     # the LIP's KV handle
    tokens: list = field(default_factory=list)      # [n] token ids, checked
    positions: Optional[list] = None                # [n] or None: continue the file
    all_logits: bool = False
    want: Want = Want()
    stage: Stage = Stage.QUEUED

    def chunk(self, start: int, n: int) -> KVPred:
        """Its tokens [start, start + n) as KVFS feeds them; the last chunk asks
        for the call's rows and result, earlier ones for nothing."""
        final = start + n == self.n_tokens
        return KVPred(self.proc.principal, self.kv, self.tokens[start:start + n],
                      None if self.positions is None else self.positions[start:start + n],
                      self.all_logits and final, self.want if final else Want(), fed=start)

    def fail(self, answers: Answers, e: BaseException) -> None:
        """Answer it with its error (never raises: a reply that cannot be
        written ends its LIP, `Answers.lost`)."""
        self.stage = Stage.FAILED
        answers.error(self.proc, self.slot, self.call_id, e)


class PredCalls:
    """pred(): submission, steps, delivery.  Given the engine (its runner runs
    each step), KVFS, the scheduler, residency and the answers; owns the step
    counters (`batches`, `batch_calls`, `max_batch`)."""

    OPS = {abi.PRED: "pred"}

    def __init__(self, engine, fs: KVFS, sched: BatchScheduler, residency: Residency, answers: Answers):
        self.engine, self.fs, self.sched, self.residency, self.answers = engine, fs, sched, residency, answers
        self.vocab = engine.model_config.vocab_size
        self.sync_device = engine.device.type == "cuda"
        self.batches = 0
        self.batch_calls = 0
        self.max_batch = 0

    # ------------------------------------------------------------------ submission
    def pred(self, lip, slot, cid, req: Pred, toks):
        """Check the call once, here, and queue it; answered when its last chunk ran."""
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
        bias = _logit_bias(req.logit_bias, self.vocab) if req.logit_bias else None
        # the rest of the check is KVFS's: handle, tokens, positions, length limit, quota
        tokens, positions = self.fs.check_pred(lip.principal, req.kv, toks[:n], req.positions, req.all_logits)
        now = time.monotonic()
        self.sched.add(PredCall(key=(lip.id, req.kv), lip=lip.id, user=lip.user, n_tokens=n,
                                priority=lip.priority, arrival=now, proc=lip, slot=slot, call_id=cid,
                                kv=req.kv, tokens=tokens, positions=positions, all_logits=req.all_logits,
                                want=Want(out, k, mask, sampling, bias)))
        lip.last_active = now
        return None

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """One forward pass of the queued calls and the replies of those it
        completes; False if no call could be scheduled (all wait for pages).
        A call that fails is answered with its error (KVFS undid its earlier
        chunks); the others in the step are unaffected."""
        self.sched.hold(self.residency.plan(self.sched.next_chunks()))
        batch = self.sched.schedule(time.monotonic())
        if batch is None:
            self.residency.stalled()
            return False
        self.residency.moved()
        items = [(c, start, n) for c, start, n in batch.items if c.proc.state == Serving.RUNNING]
        if not items:
            return True
        t0 = time.perf_counter()
        done = self._run([c.chunk(start, n) for c, start, n in items])
        self.sched.took(time.perf_counter() - t0)
        self.batches += 1
        self.batch_calls += len(items)
        self.max_batch = max(self.max_batch, len(items))
        self._deliver_all(items, done)
        return True

    def _run(self, chunks: list[KVPred]) -> list:
        """KVFS prepares, the runner runs, KVFS commits (or, if the runner
        raised, undoes): once per pass (`KVFS.passes`: a file written twice
        runs in two); a result per chunk."""
        results: list = [None] * len(chunks)
        for idx in self.fs.passes(chunks):
            plan = self.fs.prepare([chunks[i] for i in idx])
            try:
                out = self.engine.runner.run(plan.step)
            except BaseException:
                self.fs.undo(plan)
                raise
            for i, r in zip(idx, self.fs.commit(plan, out)):
                results[i] = r
        return results

    # ------------------------------------------------------------------ delivery
    def _deliver_all(self, items: list, results: list) -> None:
        """Fail what failed, advance what has more chunks, reply to the rest:
        every call's copies to the host are queued first, then waited for once."""
        finals, tokens = [], []                  # tokens: (call, its token ids on the device)
        for (c, start, n), r in zip(items, results):
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
            if c.want.output in ("argmax", "sample"):
                tokens.append((c, r.value))
                continue
            try:
                finals.append((c, self._copy_out(c, r.value)))
            except Exception as e:
                c.fail(self.answers, e)
        if tokens:                               # every call's token ids in one copy to the host
            try:
                ids = torch.cat([v.reshape(-1).long() for _, v in tokens]).to("cpu", non_blocking=True)
            except Exception as e:
                for c, _ in tokens:
                    c.fail(self.answers, e)
                tokens = []
            off = 0
            for c, v in tokens:
                finals.append((c, self._reply_tokens(c, ids, off, v.numel())))
                off += v.numel()
        if finals and self.sync_device:
            torch.cuda.current_stream(self.engine.device).synchronize()
        for c, reply in finals:
            try:
                reply()
                c.stage = Stage.DONE
            except Exception as e:
                c.fail(self.answers, e)

    def _copy_out(self, c: PredCall, value):
        """Queue the copy of a logits or top-k call's result (computed on the
        device by the runner) into the LIP's arena; returns the function that
        replies once the copies are done.  No call waits for the device on its
        own (token ids: `_deliver_all` copies every call's at once)."""
        lip, slot, cid = c.proc, c.slot, c.call_id
        length = self.fs.handles[c.kv].inode.length
        out = c.want.output
        if out == "logits":
            rows = value.shape[0]                                 # value: [rows, vocab]
            view = lip.ring.arena(slot, rows, self.vocab)
            torch.from_numpy(view).copy_(value, non_blocking=True)   # a DMA into the pinned arena
            return lambda: self.answers.reply(lip, slot, cid, {"length": length},
                                              (abi.ARENA_LOGITS, rows, self.vocab))
        lp, ids = value                                           # topk: [rows, k] float32, [rows, k] int32
        rows, k = lp.shape
        lp_h, ids_h = lp.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True)

        def reply_topk():
            view = lip.ring.arena(slot, 2 * rows, k)
            view[:rows] = ids_h.numpy().view(np.float32)
            view[rows:] = lp_h.numpy()
            self.answers.reply(lip, slot, cid, {"length": length}, (abi.ARENA_TOPK, 2 * rows, k))
        return reply_topk

    def _reply_tokens(self, c: PredCall, ids: torch.Tensor, off: int, n: int):
        """The reply of an argmax or sample call whose ``n`` token ids are ``ids[off:off + n]`` on
        the host (once the copies are done)."""
        lip, slot, cid = c.proc, c.slot, c.call_id
        length = self.fs.handles[c.kv].inode.length

        def reply_tokens():
            toks = ids[off:off + n].tolist()
            self.answers.reply(lip, slot, cid, {"length": length, "token": toks[-1], "tokens": toks})
        return reply_tokens


def _logit_bias(pairs: list, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64, values float32) of a pred's logit_bias, checked: ids in the
    vocabulary and each once, values finite (the schema bounded the count and range)."""
    ids = np.fromiter((t for t, _ in pairs), dtype=np.int64, count=len(pairs))
    values = np.fromiter((v for _, v in pairs), dtype=np.float32, count=len(pairs))
    if ids.max() >= vocab:
        _fail("InvalidArgument", "EINVAL", f"logit_bias names token {int(ids.max())}; the vocabulary is [0, {vocab})")
    if np.unique(ids).size != ids.size:
        _fail("InvalidArgument", "EINVAL", "logit_bias names a token more than once")
    if not np.isfinite(values).all() or np.abs(values).max() > abi.MAX_LOGIT_BIAS_VALUE:
        _fail("InvalidArgument", "EINVAL", f"logit_bias values must be finite, in "
              f"[-{abi.MAX_LOGIT_BIAS_VALUE}, {abi.MAX_LOGIT_BIAS_VALUE}]")
    return ids, values


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


__all__ = ["PredCall", "PredCalls", "Stage", "pin_arena"]
