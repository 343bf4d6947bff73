"""The pred system call on the syscall thread: checked once, queued, answered by the step.

One call is one record, `PredCall` (a `sched.Call` that carries its LIP, its
slot and its `Stage`), from the ring entry to its reply.  It is checked once,
at submission (`PredCalls.pred`: the body against the vocabulary and the
arena, then `KVFS.check_pred`: handle, tokens, positions, length, quota), and
queued in the scheduler keyed by its file (two calls on one file never share a
step: their order matters).  The step that feeds and answers it is
kernel/syscall/step.py's `Stepper`.
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
from symphony.kernel.syscall.proc import LipProc

log = logging.getLogger("symphony.syscalls")

MAX_WANTS = 4096                # checked bodies kept (a body is a few fields: a few hundred KB at most)


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
    """pred(): submission.  Given the engine (the vocabulary), KVFS and the scheduler."""

    OPS = {abi.PRED: "pred"}
    ANYTIME = set(OPS)          # checked and queued while a step is on the device (the step feeds it)

    def __init__(self, engine, fs: KVFS, sched: BatchScheduler):
        self.fs, self.sched = fs, sched
        self.vocab = engine.model_config.vocab_size
        self._wants: dict = {}        # a checked body without mask or positions -> its Want (decode steps repeat it)

    # ------------------------------------------------------------------ submission
    def pred(self, lip, slot, cid, req: Pred, toks):
        """Check the call once, here, and queue it; answered when its last chunk ran."""
        n, n_mask, out = req.n_tokens, req.n_mask_words, req.output     # typed and bounded by the schema
        words = (self.vocab + 31) // 32
        if n_mask and n_mask != words:
            _fail("InvalidArgument", "EINVAL", f"a mask is {words} uint32 words, got {n_mask}")
        if toks.size != n + n_mask:
            _fail("InvalidArgument", "EINVAL", f"token array holds {toks.size} ids, body says {n}+{n_mask}")
        cacheable = not n_mask and req.positions is None and not req.logit_bias
        want = self._wants.get(req) if cacheable else None       # a decode step's body
        sampling = SamplingParams() if want is None else want.sampling                  # is the last one's
        if out == "sample" and want is None:         # fail before the forward pass, not after
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
        inode = self.fs.handles[req.kv].inode            # (the handle was just checked) its calls run in order
        if want is None:
            want = Want(out, k, mask, sampling, bias)
            if cacheable:
                if len(self._wants) >= MAX_WANTS:
                    self._wants.clear()
                self._wants[req] = want
        self.sched.add(PredCall(key=inode.ino, lip=lip.id, user=lip.user, n_tokens=n, context=inode.length,
                                priority=lip.priority, arrival=now, proc=lip, slot=slot, call_id=cid,
                                kv=req.kv, tokens=tokens, positions=positions, all_logits=req.all_logits,
                                want=want))
        lip.last_active = now
        return None


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
