"""Which of Symphony's own CUDA kernels an engine on a GPU uses in place of torch's, decided when
the model is built.

A decode step at a small batch is bound by reading the weights once, but in torch it is also
some fifteen small kernels a layer: RMSNorm alone is several, RoPE through complex numbers four,
SwiGLU two, and cuBLAS runs a one-row product through kernels shaped for many rows.
``csrc/cuda/dense.cu`` has one kernel for each of the element-wise steps (``rms_norm``,
``add_rms_norm``, ``silu_mul``, ``rope_``) and a GEMV for 1 to 4 rows (``dense_gemv``).

* The element-wise kernels are checked once against torch on random data of the model's
  shapes; they are used when they agree (otherwise a warning, and torch's).
* The GEMV is timed against cuBLAS for each of the model's weight shapes and each row count
  (1, 2, 4; 3 takes 4's choice), and for the head's float32 logits, on the model's own weights,
  after the same kind of check: each candidate in turn after the L2 cache is flushed (a decode
  step reads every weight from memory), medians of several timings, interleaved. Ours is used
  where it is at least 3 % faster. The choice is made before CUDA graphs are captured, which
  then replay it.

``SYMPHONY_CUDA_KERNELS`` chooses: ``auto`` (the default, as above), ``off`` (torch's kernels
only) or ``on`` (ours wherever they apply, without timing; the checks still run). Every choice
is logged (logger ``symphony.engine``) and kept in `CudaKernels.choices` for benchmarks.
"""
from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import ops

log = logging.getLogger("symphony.engine")

MODES = ("auto", "off", "on")
GEMV_ROWS = (1, 2, 4)          # the row counts timed; 3 takes 4's choice
MIN_GAIN = 0.97                # ours is used when it takes at most this share of cuBLAS's time
FLUSH_BYTES = 256 << 20        # larger than any GPU's L2 cache


def mode_from_env() -> str:
    mode = os.environ.get("SYMPHONY_CUDA_KERNELS", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"SYMPHONY_CUDA_KERNELS must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@dataclass
class GemvTiming:
    """One shape's measurement: microseconds a call, ours and cuBLAS's (None: not timed)."""
    n: int
    k: int
    rows: int
    float_out: bool
    ours_us: Optional[float]
    torch_us: Optional[float]
    use: bool
    why: str = ""

    def line(self) -> str:
        what = f"{self.n}x{self.k} rows={self.rows}{' float32 out' if self.float_out else ''}"
        if self.ours_us is None:
            return f"{what}: {'ours' if self.use else 'cuBLAS'} ({self.why})"
        return (f"{what}: ours {self.ours_us:.1f} us, cuBLAS {self.torch_us:.1f} us -> "
                f"{'ours' if self.use else 'cuBLAS'}")


@dataclass
class CudaKernels:
    """The kernels chosen for one model on one device; `linear` and `head` dispatch on them."""
    mode: str = "off"
    elementwise: bool = False
    gemv: dict = field(default_factory=dict)     # (n, k, rows, float_out) -> bool
    choices: list = field(default_factory=list)  # GemvTiming, in the order measured
    notes: list = field(default_factory=list)    # what was checked and what failed

    @classmethod
    def build(cls, device: torch.device, dtype: torch.dtype, config, weights: list,
              head: Optional[torch.Tensor], head_torch: Callable, mode: Optional[str] = None,
              reps: int = 9) -> "CudaKernels":
        """Check and time our kernels for a model of ``config`` whose dense matrices are
        ``weights`` and ``head`` (the lm_head, None when quantized); ``head_torch(x, w)`` is the
        head's float32-logits product the model would use otherwise."""
        k = cls(mode=mode or mode_from_env())
        if k.mode == "off" or device.type != "cuda" or not ops.cuda_available():
            k.mode = "off"
            return k
        k.elementwise = k._check_elementwise(device, dtype, config)
        if dtype in (torch.float16, torch.bfloat16):
            k._choose_gemv(device, dtype, weights, head, head_torch, reps)
        for line in k.summary():
            log.info("cuda kernels: %s", line)
        return k

    def summary(self) -> list[str]:
        return [*self.notes, *(t.line() for t in self.choices)]

    # ------------------------------------------------------------------ dispatch
    def _gemv_ok(self, x: torch.Tensor, w: torch.Tensor, float_out: bool) -> bool:
        if x.dim() != 2 or not 1 <= x.shape[0] <= 4 or w.dim() != 2:
            return False
        rows = 4 if x.shape[0] == 3 else x.shape[0]
        return (self.gemv.get((w.shape[0], w.shape[1], rows, float_out), False)
                and x.dtype == w.dtype and x.is_contiguous() and x.data_ptr() % 16 == 0)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w^T`` in x's dtype (a dense w, no bias)."""
        if self._gemv_ok(x, w, False):
            return ops.dense_gemv(x, w, False)
        return F.linear(x, w)

    def head(self, x: torch.Tensor, w: torch.Tensor, head_torch: Callable) -> torch.Tensor:
        """float32 logits ``x @ w^T``."""
        if self._gemv_ok(x, w, True):
            return ops.dense_gemv(x, w, True)
        return head_torch(x, w)

    # ------------------------------------------------------------------ checks
    def _check_elementwise(self, device, dtype, c) -> bool:
        """Our element-wise kernels against torch's on random data of the model's shapes."""
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        def close(a, b, what):
            err = (a.float() - b.float()).abs().max().item()
            bound = 2e-2 * max(1.0, b.float().abs().max().item())
            if not err <= bound:                               # NaN fails too
                self.notes.append(f"element-wise kernels NOT used: {what} differs from torch's by "
                                  f"{err:.3g} (bound {bound:.3g})")
                log.warning("cuda kernels: %s", self.notes[-1])
                return False
            return True

        try:
            T, H, eps = 5, c.hidden_size, c.rms_eps
            x, r, w = rnd(T, H), rnd(T, H), torch.randn(H, generator=g).to(device)
            ref = F.rms_norm(x.float(), (H,), w, eps)
            ok = close(ops.rms_norm(x, w, eps), ref, "rms_norm")
            s, n = ops.add_rms_norm(x, r, w, eps)
            ok = ok and close(s, x + r, "add_rms_norm's sum") and close(
                n, F.rms_norm((x + r).float(), (H,), w, eps), "add_rms_norm")
            if ok and dtype != torch.float32:       # the model's float32 residual stream
                s, n = ops.add_rms_norm(x.float(), r, w, eps)
                ok = close(s, x.float() + r.float(), "add_rms_norm's float32 sum") and close(
                    n, F.rms_norm(x.float() + r.float(), (H,), w, eps), "add_rms_norm (float32 residual)")
            I = c.intermediate_size
            gu = rnd(T, 2 * I)
            ok = ok and close(ops.silu_mul(gu), F.silu(gu[:, :I].float()) * gu[:, I:].float(), "silu_mul")
            heads, hd = c.n_heads + c.n_kv_heads, c.head_dim
            qkv = rnd(T, (heads + c.n_kv_heads) * hd)
            pos = torch.randint(0, c.max_context, (T,), generator=g).to(device)
            ang = torch.rand(c.max_context, hd // 2, generator=g) * 6.28
            table = torch.stack([ang.cos(), ang.sin()], -1).to(device)
            got = qkv.clone()
            ops.rope_(got, pos, table, heads)
            qk = torch.view_as_complex(qkv[:, : heads * hd].float().reshape(T, heads, hd // 2, 2))
            rot = torch.view_as_complex(table[pos].unsqueeze(1).contiguous())
            want = torch.cat([torch.view_as_real(qk * rot).reshape(T, -1), qkv[:, heads * hd:].float()], 1)
            ok = ok and close(got, want, "rope_")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except RuntimeError as e:                              # a kernel that fails to run
            self.notes.append(f"element-wise kernels NOT used: {str(e).splitlines()[0][:200]}")
            log.warning("cuda kernels: %s", self.notes[-1])
            return False
        if ok:
            self.notes.append("element-wise kernels (rms_norm, add_rms_norm, silu_mul, rope_) "
                              "agree with torch's: used")
        return ok

    def _choose_gemv(self, device, dtype, weights, head, head_torch, reps) -> None:
        shapes: dict = {}
        for w in weights:
            if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == dtype and w.is_contiguous():
                shapes.setdefault((w.shape[0], w.shape[1], False), w)
        if isinstance(head, torch.Tensor) and head.dtype == dtype and head.is_contiguous():
            shapes.setdefault((head.shape[0], head.shape[1], True), head)
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if self.mode == "auto" else None
        g = torch.Generator(device="cpu").manual_seed(1)
        for (n, k, float_out), w in shapes.items():
            if k % 8 or w.data_ptr() % 16:
                continue
            for rows in GEMV_ROWS:
                x = torch.randn(rows, k, generator=g).to(device=device, dtype=dtype)
                ours = lambda: ops.dense_gemv(x, w, float_out)                      # noqa: E731
                theirs = ((lambda: head_torch(x, w)) if float_out                   # noqa: E731
                          else (lambda: F.linear(x, w)))
                t = GemvTiming(n, k, rows, float_out, None, None, False)
                try:
                    got, want = ours().float(), theirs().float()
                    ref = x.float() @ w.float().t()
                    err = (got - ref).abs().max().item()
                    bound = 4 * (want - ref).abs().max().item() + 1e-3 * ref.abs().max().item() + 1e-6
                    if not err <= bound:
                        t.why = f"differs from the float32 product by {err:.3g} (bound {bound:.3g})"
                        log.warning("cuda kernels: gemv %dx%d rows=%d NOT used: %s", n, k, rows, t.why)
                    elif self.mode == "on":
                        t.use, t.why = True, "SYMPHONY_CUDA_KERNELS=on"
                    else:
                        t.ours_us, t.torch_us = _time_pair(ours, theirs, flush, reps, device)
                        t.use = t.ours_us <= MIN_GAIN * t.torch_us
                except RuntimeError as e:
                    t.why = f"failed: {str(e).splitlines()[0][:200]}"
                    log.warning("cuda kernels: gemv %dx%d rows=%d NOT used: %s", n, k, rows, t.why)
                self.gemv[(n, k, rows, float_out)] = t.use
                self.choices.append(t)
        del flush
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _time_pair(a: Callable, b: Callable, flush: torch.Tensor, reps: int, device) -> tuple[float, float]:
    """Median microseconds of one call of ``a`` and of ``b``, each timed after the L2 cache is
    flushed, the two interleaved; after two warm-up calls each."""
    for _ in range(2):
        a(), b()
    stream = torch.cuda.current_stream(device)
    times: dict = {0: [], 1: []}
    for _ in range(reps):
        for i, fn in enumerate((a, b)):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])
