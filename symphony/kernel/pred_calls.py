"""The pred system call: validated at submission, batched by the scheduler, one forward pass
per step, results computed where the logits are (masks, top-k, sampling) and replied.

`PredCalls` is a part of `SyscallServer` (the syscall thread owns everything it touches).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Optional

import msgspec
import numpy as np
import torch

from symphony.ipc import abi
from symphony.ipc.abi import MAX_TEMPERATURE, MIN_TEMPERATURE
from symphony.ipc.kernel_side import KernelSide
from symphony.ipc.schema import Pred
from symphony.kvfs import KVPred
from symphony.sched import Call

from .failure import fail as _fail
from .proc import LipProc

log = logging.getLogger("symphony.syscalls")


@dataclass
class _Pending:
    lip: LipProc
    slot: int
    call_id: int
    body: dict
    tokens: np.ndarray
    mask: Optional[np.ndarray]
    orig_len: int = -1          # the file's length before the first chunk (rollback)


class PredCalls:
    """pred(): submission, steps, delivery (mixed into SyscallServer)."""

    def _pred(self, lip, slot, cid, req: Pred, toks):
        n, n_mask, out = req.n_tokens, req.n_mask_words, req.output     # typed and bounded by the schema
        words = (self.vocab + 31) // 32
        if n_mask and n_mask != words:
            _fail("InvalidArgument", "EINVAL", f"a mask is {words} uint32 words, got {n_mask}")
        if toks.size != n + n_mask:
            _fail("InvalidArgument", "EINVAL", f"token array holds {toks.size} ids, body says {n}+{n_mask}")
        rows = n if req.all_logits else 1
        if out in ("logits", "topk"):
            need = rows * (2 * req.k if out == "topk" else self.vocab) * 4
            if need > lip.ring.arena_bytes:
                _fail("InvalidArgument", "EINVAL", f"{rows} rows of {out} need {need} bytes; the arena "
                      f"holds {lip.ring.arena_bytes} (ask for fewer rows, or top-k)")
        mask = None
        if n_mask:                                   # bit i of the words: token i allowed
            bits = np.unpackbits(np.ascontiguousarray(toks[n:]).view(np.uint8), bitorder="little")
            mask = bits[: self.vocab].astype(bool)
            if not mask.any():
                _fail("InvalidArgument", "EINVAL", "the mask allows no token")
        self.fs.check_pred(lip.principal, req.kv, toks[:n], req.positions, req.all_logits)
        body = msgspec.structs.asdict(req)           # what follows reads the call's fields as a dict
        pend = _Pending(lip, slot, cid, body, toks[:n], mask)
        self.sched.add(Call(key=(lip.id, req.kv), lip=lip.id, user=lip.user, n_tokens=n,
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
