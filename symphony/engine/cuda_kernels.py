"""Which of Symphony's own CUDA kernels an engine on a GPU uses in place of torch's, decided when
the model is built.

A decode step at a small batch is bound by reading the weights once, but in torch it is also
some fifteen small kernels a layer: RMSNorm alone is several, RoPE through complex numbers four,
SwiGLU two, and cuBLAS runs a one-row product through kernels shaped for many rows.
``csrc/cuda/dense.cu`` has one kernel for each of the element-wise steps (``rms_norm``,
``add_rms_norm``, ``silu_mul``, ``rope_``) and a GEMV for 1 to 4 rows (``dense_gemv``);
``csrc/cuda/gemv_tc.cu`` a GEMV on tensor cores for 1 to 8 rows with split-K
(``dense_gemv_tc``); ``csrc/cuda/attention_tiled.cu`` a query-tiled prefill and a split-key
decode attention (``paged_attention_tiled``).

* The element-wise kernels are checked once against torch on random data of the model's
  shapes; they are used when they agree (otherwise a warning, and torch's).
* The GEMVs are timed against cuBLAS for each of the model's weight shapes and each row count
  (1, 2, 4, 8; 3 takes 4's choice and 5-7 take 8's), and for the head's float32 logits, on the
  model's own weights, after the same kind of check: each candidate (cuBLAS, ``dense_gemv`` up
  to 4 rows, ``dense_gemv_tc`` with 1, 2, 4 and 8 warps a row group) after the L2 cache is
  flushed (a decode step reads every weight from memory), medians of several timings,
  interleaved. The fastest of ours is used where it takes at most 97 % of cuBLAS's time.
* The attention kernels are checked against ``paged_attention``'s on random paged K/V of the
  model's head shape (a prompt into a non-empty file beside decode rows of several lengths), and
  each part (the prefill kernel, the decode kernel) is used where it agrees and is at least 3 %
  faster on a prompt of 512 tokens into a file of 512, and a decode at a context of 512.

The choices are made before CUDA graphs are captured, which then replay them.

``SYMPHONY_CUDA_KERNELS`` chooses: ``auto`` (the default, as above), ``off`` (torch's kernels
and ``paged_attention`` only) or ``on`` (ours wherever they apply, without timing; the checks
still run), optionally followed by parts left out, e.g. ``auto,-attention,-gemv_tc`` (parts:
``elementwise``, ``gemv``, ``gemv_tc``, ``attention``). Every choice is logged (logger
``symphony.engine``) and kept in `CudaKernels.choices` for benchmarks.
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
PARTS = ("elementwise", "gemv", "gemv_tc", "attention")
GEMV_ROWS = (1, 2, 4, 8)       # the row counts timed; 3 takes 4's choice, 5-7 8's
TC_SPLITS = (1, 2, 4, 8)       # dense_gemv_tc's candidates
MIN_GAIN = 0.97                # ours is used when it takes at most this share of the other's time
FLUSH_BYTES = 256 << 20        # larger than any GPU's L2 cache


def parse_mode(text: str) -> tuple[str, frozenset]:
    """(mode, parts left out) of a SYMPHONY_CUDA_KERNELS value such as ``auto,-attention``."""
    items = [t.strip() for t in text.strip().lower().split(",")]
    mode = items[0] or "auto"
    if mode not in MODES:
        raise ValueError(f"SYMPHONY_CUDA_KERNELS must be one of {', '.join(MODES)}, got {text.strip()!r} "
                         f"(optionally followed by parts left out: ,-{' ,-'.join(PARTS)})")
    out = set()
    for t in items[1:]:
        if not t.startswith("-") or t[1:] not in PARTS:
            raise ValueError(f"SYMPHONY_CUDA_KERNELS: {t!r} is not a part to leave out; "
                             f"write ,-PART with PART one of {', '.join(PARTS)}")
        out.add(t[1:])
    return mode, frozenset(out)


def mode_from_env() -> str:
    """The base mode of SYMPHONY_CUDA_KERNELS (ValueError when the value is malformed)."""
    return parse_mode(os.environ.get("SYMPHONY_CUDA_KERNELS", "auto"))[0]


@dataclass
class GemvTiming:
    """One shape's measurement: microseconds a call of each candidate timed ({} when not timed),
    and the one used ("cublas", "gemv", "tc1" .. "tc8")."""
    n: int
    k: int
    rows: int
    float_out: bool
    times: dict
    use: str
    why: str = ""

    def line(self) -> str:
        what = f"{self.n}x{self.k} rows={self.rows}{' float32 out' if self.float_out else ''}"
        if not self.times:
            return f"{what}: {self.use} ({self.why})" if self.why else f"{what}: {self.use}"
        return f"{what}: " + ", ".join(f"{c} {us:.1f} us" for c, us in self.times.items()) + f" -> {self.use}"


@dataclass
class CudaKernels:
    """The kernels chosen for one model on one device; `linear`, `head` and `attention` dispatch
    on them."""
    mode: str = "off"
    excluded: frozenset = frozenset()
    elementwise: bool = False
    gemv: dict = field(default_factory=dict)     # (n, k, rows, float_out) -> "cublas" | "gemv" | "tcS"
    attention: int = 0                           # paged_attention_tiled's kernels bits; 0: paged_attention
    choices: list = field(default_factory=list)  # GemvTiming, in the order measured
    notes: list = field(default_factory=list)    # what was checked and what failed

    @classmethod
    def build(cls, device: torch.device, dtype: torch.dtype, config, weights: list,
              head: Optional[torch.Tensor], head_torch: Callable, mode: Optional[str] = None,
              reps: int = 9) -> "CudaKernels":
        """Check and time our kernels for a model of ``config`` whose dense matrices are
        ``weights`` and ``head`` (the lm_head, None when quantized); ``head_torch(x, w)`` is the
        head's float32-logits product the model would use otherwise."""
        base, excluded = parse_mode(mode if mode is not None else os.environ.get("SYMPHONY_CUDA_KERNELS", "auto"))
        k = cls(mode=base, excluded=excluded)
        if k.mode == "off" or device.type != "cuda" or not ops.cuda_available():
            k.mode = "off"
            return k
        if "elementwise" not in excluded:
            k.elementwise = k._check_elementwise(device, dtype, config)
        if dtype in (torch.float16, torch.bfloat16):
            k._choose_gemv(device, dtype, weights, head, head_torch, reps)
            if "attention" not in excluded:
                k._choose_attention(device, dtype, config, reps)
        for line in k.summary():
            log.info("cuda kernels: %s", line)
        return k

    def summary(self) -> list[str]:
        return [*self.notes, *(t.line() for t in self.choices)]

    # ------------------------------------------------------------------ dispatch
    def _gemv_impl(self, x: torch.Tensor, w: torch.Tensor, float_out: bool) -> str:
        if x.dim() != 2 or not 1 <= x.shape[0] <= 8 or w.dim() != 2:
            return "cublas"
        rows = x.shape[0] if x.shape[0] in GEMV_ROWS else (4 if x.shape[0] == 3 else 8)
        impl = self.gemv.get((w.shape[0], w.shape[1], rows, float_out), "cublas")
        if impl != "cublas" and x.dtype == w.dtype and x.is_contiguous() and x.data_ptr() % 16 == 0:
            return impl
        return "cublas"

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w^T`` in x's dtype (a dense w, no bias)."""
        impl = self._gemv_impl(x, w, False)
        return F.linear(x, w) if impl == "cublas" else run_gemv(impl, x, w, False)

    def head(self, x: torch.Tensor, w: torch.Tensor, head_torch: Callable) -> torch.Tensor:
        """float32 logits ``x @ w^T``."""
        impl = self._gemv_impl(x, w, True)
        return head_torch(x, w) if impl == "cublas" else run_gemv(impl, x, w, True)

    def paged_attention(self, q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale) -> torch.Tensor:
        """`ops.paged_attention`, by the kernels chosen (`ops.paged_attention_tiled`'s parts)."""
        if self.attention:
            return ops.paged_attention_tiled(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale,
                                             self.attention)
        return ops.paged_attention(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale)

    # ------------------------------------------------------------------ checks
    def _check_elementwise(self, device, dtype, c) -> bool:
        """Our element-wise kernels against torch's on random data of the model's shapes."""
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

        def close(a, b, what):
            return self.agrees(a, b, f"element-wise kernels NOT used: {what}")

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
            self.warn(f"element-wise kernels NOT used: {str(e).splitlines()[0][:200]}")
            return False
        if ok:
            self.notes.append("element-wise kernels (rms_norm, add_rms_norm, silu_mul, rope_) "
                              "agree with torch's: used")
        return ok

    def agrees(self, got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 2e-2) -> bool:
        """Whether ``got`` is within ``tol`` of ``want``'s magnitude (at least 1); else a warning
        ``what differs ...``."""
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        bound = tol * max(1.0, want.float().abs().max().item() if want.numel() else 0.0)
        if not err <= bound:                                   # NaN fails too
            self.warn(f"{what} differs from the reference by {err:.3g} (bound {bound:.3g})")
            return False
        return True

    def warn(self, note: str) -> None:
        self.notes.append(note)
        log.warning("cuda kernels: %s", note)

    @staticmethod
    def tensor_cores(device) -> bool:
        """Whether dense_gemv_tc runs on ``device`` (CUDA, compute capability 8.0 or later)."""
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8

    def _candidates(self, device, rows: int) -> list[str]:
        """Our GEMVs that may run ``rows`` rows on this device."""
        out = ["gemv"] if rows <= 4 and "gemv" not in self.excluded else []
        if "gemv_tc" not in self.excluded and self.tensor_cores(device):
            out += [f"tc{s}" for s in TC_SPLITS] if self.mode == "auto" else ["tc0"]
        return out

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
                theirs = ((lambda: head_torch(x, w)) if float_out                   # noqa: E731
                          else (lambda: F.linear(x, w)))
                t = GemvTiming(n, k, rows, float_out, {}, "cublas")
                ok = []
                try:
                    want = theirs().float()
                    ref = x.float() @ w.float().t()
                    bound = 4 * (want - ref).abs().max().item() + 1e-3 * ref.abs().max().item() + 1e-6
                    for impl in self._candidates(device, rows):
                        try:
                            err = (run_gemv(impl, x, w, float_out).float() - ref).abs().max().item()
                        except RuntimeError as e:
                            self.warn(f"gemv {impl} {n}x{k} rows={rows} NOT used: failed: "
                                      f"{str(e).splitlines()[0][:200]}")
                            continue
                        if err <= bound:
                            ok.append(impl)
                        else:
                            self.warn(f"gemv {impl} {n}x{k} rows={rows} NOT used: differs from the "
                                      f"float32 product by {err:.3g} (bound {bound:.3g})")
                    if ok and self.mode == "on":
                        t.use, t.why = ok[-1], "SYMPHONY_CUDA_KERNELS=on"
                    elif ok:
                        fns = [theirs] + [(lambda impl=impl: run_gemv(impl, x, w, float_out)) for impl in ok]
                        us = time_calls(fns, flush, reps, device)
                        t.times = dict(zip(["cublas", *ok], us))
                        best = min(range(1, len(us)), key=us.__getitem__)
                        if us[best] <= MIN_GAIN * us[0]:
                            t.use = ok[best - 1]
                except RuntimeError as e:
                    t.why = f"failed: {str(e).splitlines()[0][:200]}"
                    log.warning("cuda kernels: gemv %dx%d rows=%d: %s", n, k, rows, t.why)
                self.gemv[(n, k, rows, float_out)] = t.use
                self.choices.append(t)
        del flush
        if device.type == "cuda":
            torch.cuda.synchronize(device)


    def _choose_attention(self, device, dtype, c, reps) -> None:
        """``self.attention``: the parts of `ops.paged_attention_tiled` that agree with
        `ops.paged_attention` on the model's head shape and (auto) are faster."""
        if c.head_dim not in (64, 128) or c.n_heads // c.n_kv_heads > 8:
            self.notes.append(f"attention: paged_attention (the tiled kernels take head_dim 64 or 128 "
                              f"and at most 8 query heads per KV head)")
            return
        g = torch.Generator(device="cpu").manual_seed(2)
        # a prompt of 80 tokens into a file of 120, beside decodes at contexts 1, 37, 300, 1100
        mixed = attention_case(c, device, dtype, g, [1, 80, 1, 1, 1], [1, 200, 37, 300, 1100])
        want = ops.paged_attention(*mixed)
        use = 0
        for bit, part in ((1, "prefill"), (2, "decode")):
            try:
                got = ops.paged_attention_tiled(*mixed, bit)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except RuntimeError as e:
                self.warn(f"attention: the tiled {part} kernel NOT used: failed: {str(e).splitlines()[0][:200]}")
                continue
            if self.agrees(got, want, f"attention: the tiled {part} kernel NOT used: it"):
                use |= bit
        if use and self.mode == "auto":
            flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
            for bit, part, case in ((1, "prefill", ([512], [1024])), (2, "decode", ([1], [512]))):
                if not use & bit:
                    continue
                args = attention_case(c, device, dtype, g, *case)
                us = time_calls([lambda: ops.paged_attention(*args),
                                 lambda: ops.paged_attention_tiled(*args, bit)], flush, reps, device)
                faster = us[1] <= MIN_GAIN * us[0]
                self.notes.append(f"attention: {part} ({case[0][0]} queries, context {case[1][0]}): "
                                  f"paged_attention {us[0]:.1f} us, tiled {us[1]:.1f} us -> "
                                  f"{'tiled' if faster else 'paged_attention'}")
                if not faster:
                    use &= ~bit
            del flush
        self.attention = use
        self.notes.append(f"attention: paged_attention_tiled with kernels={use}" if use
                          else "attention: paged_attention")


def attention_case(c, device, dtype, g: torch.Generator, q_lens: list, kv_lens: list) -> tuple:
    """Arguments of `ops.paged_attention` (scale included) for the model's head shape: sequences
    of ``q_lens`` new tokens and ``kv_lens`` slots each, in shuffled pages of 16."""
    page = 16
    need = [-(-n // page) for n in kv_lens]
    perm = torch.randperm(sum(need) + 1, generator=g)
    table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    cache = [torch.randn(sum(need) + 1, page, c.n_kv_heads, c.head_dim, generator=g).to(device, dtype)
             for _ in range(2)]
    q = torch.randn(sum(q_lens), c.n_heads, c.head_dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q, *cache, table.to(device), cu.to(device), torch.tensor(kv_lens, dtype=torch.int32).to(device),
            c.head_dim ** -0.5)


def run_gemv(impl: str, x: torch.Tensor, w: torch.Tensor, float_out: bool) -> torch.Tensor:
    """One of our GEMVs by name: "gemv" (`ops.dense_gemv`) or "tcS" (`ops.dense_gemv_tc`, S splits)."""
    if impl == "gemv":
        return ops.dense_gemv(x, w, float_out)
    return ops.dense_gemv_tc(x, w, float_out, int(impl[2:]))


def time_calls(fns: list, flush: Optional[torch.Tensor], reps: int, device) -> list[float]:
    """Median microseconds of one call of each of ``fns``, each timed after the L2 cache is
    flushed (when ``flush`` is given), the calls interleaved; after two warm-up calls each."""
    for _ in range(2):
        for fn in fns:
            fn()
    stream = torch.cuda.current_stream(device)
    times: list = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times[i].append(start.elapsed_time(end) * 1e3)
    return [statistics.median(t) for t in times]
