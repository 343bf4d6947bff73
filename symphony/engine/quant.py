"""Quantized weights kept quantized in memory: `QWeight`, GGUF repacking, load-time quantizers.

A `QWeight` is a matrix W ``[N, K]`` in one of two layouts the kernels read (``csrc/quant.h``):

    kind 0 "u4": qs uint8 [N, K/2]   (group g: 16 bytes, byte j = element 32g+j | element 32g+16+j << 4)
    kind 1 "i8": qs int8  [N, K]
    scales float32 or float16 [N, K/group], mins the same dtype [N, K/group] or empty
    W[n, k] = scales[n, k // group] * q[n, k] + mins[n, k // group]
    (empty mins: no offset for i8, -8 * scales for u4: Q4_0's q - 8)

Every GGUF format below is repacked into one of them without changing a single weight (the
kernels and the ``gguf`` package's dequantizer agree to a float32 ulp). Q4_0, Q4_1 and Q8_0
keep the file's float16 scales (and Q4_1's float16 mins; Q4_0's, -8 d, are implied, not stored),
so that a decode step reads the file's bytes. The per-group scale of a K-quant,
``d * sc``, is a float16 times a 6- or 8-bit integer: exact in float32, not in float16, so
K-quants keep float32 scales.

    GGUF    ours                     bytes/weight (file -> memory)
    Q4_0    u4, g32, float16 scales  0.5625 -> 0.5625
    Q4_1    u4, g32, float16 scales  0.625  -> 0.625
    Q4_K    u4, g32                  0.5625 -> 0.75
    Q8_0    i8, g32, float16 scales  1.0625 -> 1.0625
    Q5_K    i8, g32 + min            0.6875 -> 1.25
    Q6_K    i8, g16                  0.8203 -> 1.25

Float16 scales and implied u4 mins are CPU layouts (the CPU kernels widen the scales exactly and
write the mins out, a block of rows at a time); `QWeight.to` a GPU makes both float32 tensors.

Other quantized GGUF types (Q5_0, Q2_K, IQ*, ...) are dequantized to float at load.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from . import ops

U4, I8 = 0, 1
GGUF_QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QUANTIZE_CHOICES = ("int8", "int4")
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


# The qlinear path QWeight.linear asks for (ops.qlinear): -1 lets the op pick by M and the CPU
# (csrc/cpu/qlinear.cpp) a kernel whose result is the float32 product up to ~3e-5 of |x| |W| (15-bit
# activations on AVX-512 VNNI and on AVX2 without AVX-512, float32 otherwise), -2 an int8-activation
# one. -2 is opt-in
# (`set_int8_activations`, `symphony-kernel --activations int8`, or SYMPHONY_INT8_ACTIVATIONS=1 in
# the environment): it is faster for batches but rounds every linear layer's input to int8 (logits
# move by a few % of their scale; perf/RESULTS.md).
# Tests and benchmarks force a path with `force_qlinear_path`.
_qlinear_path = -2 if os.environ.get("SYMPHONY_INT8_ACTIVATIONS", "") == "1" else -1


def set_int8_activations(on: bool) -> None:
    """Process-wide: quantized matrices compute on int8-rounded activations (True) or on
    activations as exact as float32 to ~3e-5 (False, the default unless
    SYMPHONY_INT8_ACTIVATIONS=1)."""
    global _qlinear_path
    if not isinstance(on, bool):
        raise TypeError(f"set_int8_activations takes a bool, got {on!r}")
    _qlinear_path = -2 if on else -1


def qlinear_path() -> int:
    """The qlinear path `QWeight.linear` asks for now (-1 or -2 unless a test forces one); the
    C++ layer stack (ops.llama_layers) passes the same."""
    return _qlinear_path


def int8_activations() -> bool:
    """Whether `QWeight.linear` picks int8-activation kernels (see `set_int8_activations`)."""
    return _qlinear_path == -2


# what each qlinear path is (ops.qlinear's docstring); -1 / -2 as resolve_path returns them: the
# best float32 / int8 row kernel this CPU has
PATH_NAMES = {
    -2: "int8 row kernels", -1: "float32 register kernels", 0: "float32 scalar kernel",
    1: "float32 AVX2 kernel", 2: "float32 AVX-512 kernel", 3: "dense float32 GEMM on the dequantized weight",
    4: "int8 scalar kernel", 5: "int8 AVX2 kernel", 6: "int8 AVX-VNNI kernel", 7: "int8 AVX-512 VNNI row kernel",
    8: "int8 AVX-512 VNNI 16-row tiles", 9: "15-bit AVX-512 VNNI kernels (16-row tiles; the row kernel at one row)",
    10: "int8 AVX2 8-row tiles", 11: "15-bit AVX2 8-row tiles", 12: "15-bit AVX2 row kernel",
    13: "dense bfloat16 GEMM on the dequantized weight (AMX)",
}


def describe_cpu_kernels(n: int = 576, k: int = 576, kind: int = U4, max_rows: int = 256) -> str:
    """One line on what quantized matrices multiply with on this CPU, for the kernel's log: the
    kernel qlinear's current choice (`qlinear_path`) takes at each number of rows up to
    ``max_rows``, for an ``[n, k]`` weight of ``kind`` (default: a 4-bit 576 x 576 matrix),
    as qlinear resolves it (``ops.qlinear_path_for``)."""
    mode = _qlinear_path
    runs: list[list[int]] = []                  # [first row, last row, path]
    for m in range(1, max_rows + 1):
        p = ops.qlinear_path_for(mode, m, n, k, kind)
        if runs and runs[-1][2] == p:
            runs[-1][1] = m
        else:
            runs.append([m, m, p])
    what = {-2: "activations rounded to int8 per block of 16 (--activations int8)",
            -1: "automatic choice (--activations auto)"}.get(mode, f"qlinear path {mode} forced")

    def rows(a: int, b: int) -> str:
        if b == max_rows:
            return f"from {a} rows" if a > 1 else "any number of rows"
        return f"{a} row{'s' if b > 1 else ''}" if a == b else f"{a}-{b} rows"
    line = what + ": " + "; ".join(f"{rows(a, b)}: {PATH_NAMES.get(p, f'path {p}')}" for a, b, p in runs)
    if mode == -2:
        line += ("; attention of prompt chunks (32 query rows and more): bfloat16 on the AMX tiles"
                 if ops.qcpu_features()["amx_tiles"] else "; attention: float32")
    return line


class force_qlinear_path:
    """Context manager: every `QWeight.linear` inside runs qlinear path ``path`` (see
    ``ops.qlinear``: -2 / -1 the automatic choices). Not thread-local: for tests/benchmarks."""

    def __init__(self, path: int):
        if not isinstance(path, int) or isinstance(path, bool) or not -2 <= path <= 13:
            raise ValueError(f"qlinear path must be an int in -2..13, got {path!r}")
        self.path, self.saved = path, -1

    def __enter__(self) -> "force_qlinear_path":
        global _qlinear_path
        self.saved, _qlinear_path = _qlinear_path, self.path
        return self

    def __exit__(self, *exc) -> None:
        global _qlinear_path
        _qlinear_path = self.saved


class QuantError(ValueError):
    """A quantized tensor has a shape or type the kernels cannot take."""


@dataclass
class QWeight:
    """A quantized matrix ``[N, K]`` (see the module docstring for the layout)."""

    qs: torch.Tensor          # uint8 [N, K/2] (u4) or int8 [N, K] (i8)
    scales: torch.Tensor      # float32 or float16 [N, K/group]
    mins: torch.Tensor        # the scales' dtype [N, K/group], or empty: none (i8), -8 scales (u4)
    kind: int
    group: int
    source: str = ""          # where the bits came from ("Q4_1", "int8", ...)

    def __post_init__(self) -> None:
        if self.kind not in (U4, I8):
            raise QuantError(f"kind must be 0 (u4) or 1 (i8), got {self.kind}")
        if self.qs.dim() != 2:
            raise QuantError(f"qs must be 2-D, got shape {tuple(self.qs.shape)}")
        k = self.in_features
        if k % 32 or self.group not in ((32,) if self.kind == U4 else (16, 32)):
            raise QuantError(f"bad quantized shape: K={k}, group={self.group}, kind={self.kind}")
        if tuple(self.scales.shape) != (self.qs.shape[0], k // self.group):
            raise QuantError(f"scales shape {tuple(self.scales.shape)} does not match qs "
                             f"{tuple(self.qs.shape)} with groups of {self.group}")
        if self.mins.numel() and self.mins.shape != self.scales.shape:
            raise QuantError("mins and scales shapes differ")
        if self.scales.dtype not in (torch.float32, torch.float16):
            raise QuantError(f"scales must be float32 or float16, got {self.scales.dtype}")
        if self.mins.numel() and self.mins.dtype != self.scales.dtype:
            raise QuantError(f"mins ({self.mins.dtype}) and scales ({self.scales.dtype}) dtypes differ")

    # ---------------------------------------------------------------- shape
    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.kind == U4 else 1)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qs.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins))

    # ---------------------------------------------------------------- compute
    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for x ``[..., K]`` (any float dtype; computed in float32, returned in x's)."""
        n, k = self.shape
        x2 = x.reshape(-1, k)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = ops.qlinear(x2, self.qs, self.scales, self.mins, self.kind, self.group,
                        _qlinear_path)                                       # [M, N]
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def dequantize(self) -> torch.Tensor:
        """W as float32 ``[N, K]``."""
        return ops.qdequant(self.qs, self.scales, self.mins, self.kind, self.group)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows ``W[index]`` (an embedding lookup), ``[*index.shape, K]``."""
        flat = index.reshape(-1)
        mins = self.mins.index_select(0, flat) if self.mins.numel() else self.mins
        out = ops.qdequant(self.qs.index_select(0, flat), self.scales.index_select(0, flat), mins,
                           self.kind, self.group)
        return out.reshape(*index.shape, self.in_features)

    def __getitem__(self, idx) -> torch.Tensor:
        """Dequantized rows (a slice or index of rows), float32."""
        rows = torch.arange(self.shape[0], device=self.device)[idx]
        return self.rows(rows)

    # ---------------------------------------------------------------- transforms
    def to(self, device=None, dtype=None) -> "QWeight":
        """Move to ``device``; ``dtype`` is ignored (quantized weights keep their bits). Off the
        CPU, float16 scales and mins become float32 and a u4 weight's implied mins are written
        out (the CUDA kernels read float32 mins; exact)."""
        if device is None or torch.device(device) == self.device:
            return self
        if torch.device(device).type == "cpu":
            return QWeight(self.qs.to(device), self.scales.to(device), self.mins.to(device),
                           self.kind, self.group, self.source)
        w = self.with_float32_scales()
        return QWeight(w.qs.to(device), w.scales.to(device), w.stored_mins().to(device),
                       w.kind, w.group, w.source)

    def select_rows(self, index: torch.Tensor) -> "QWeight":
        """The rows ``index`` (a permutation, say) as a new QWeight."""
        mins = self.mins[index] if self.mins.numel() else self.mins
        return QWeight(self.qs[index].contiguous(), self.scales[index].contiguous(),
                       mins.contiguous(), self.kind, self.group, self.source)

    def select_cols(self, start: int, stop: int) -> "QWeight":
        """Columns ``[start, stop)`` as a new QWeight (a row-parallel shard): both
        on a group boundary and a multiple of 32 apart, so every kept group is whole."""
        k = self.in_features
        if not 0 <= start < stop <= k or start % self.group or (stop - start) % 32 or stop % self.group:
            raise QuantError(f"cannot cut columns [{start}, {stop}) of a quantized matrix with K={k} "
                             f"in groups of {self.group}")
        per = 2 if self.kind == U4 else 1
        g0, g1 = start // self.group, stop // self.group
        mins = self.mins[:, g0:g1].contiguous() if self.mins.numel() else self.mins
        return QWeight(self.qs[:, start // per:stop // per].contiguous(), self.scales[:, g0:g1].contiguous(),
                       mins, self.kind, self.group, self.source)

    def with_float32_scales(self) -> "QWeight":
        """The same weight with float32 scales and mins (exact); itself if they are."""
        if self.scales.dtype == torch.float32:
            return self
        return QWeight(self.qs, self.scales.float(), self.mins.float(), self.kind, self.group, self.source)

    def stored_mins(self) -> torch.Tensor:
        """The mins as a tensor of the scales' shape and dtype: a u4 weight's implied ones (-8 *
        scales, exact; float16 scales above 8188 would overflow: QuantError) written out; an i8
        weight without mins gives its empty tensor."""
        if self.mins.numel() or self.kind != U4:
            return self.mins
        mins = (self.scales * -8).contiguous()
        if not bool(torch.isfinite(mins).all()) and bool(torch.isfinite(self.scales).all()):
            raise QuantError("the implied mins (-8 * scale) overflow float16: use with_float32_scales()")
        return mins

    def as_i8(self, group: int) -> "QWeight":
        """The same weights as i8 with groups of ``group`` (exact: only the storage widens)."""
        if self.kind == I8 and self.group == group:
            return self
        if self.kind == U4:
            b = self.qs.view(self.qs.shape[0], -1, 16)                        # [N, G, 16]
            q = torch.cat([b & 0xF, b >> 4], dim=2).reshape(self.qs.shape[0], -1).to(torch.int8)
        else:
            q = self.qs
        rep = self.group // group
        if rep < 1:
            raise QuantError(f"cannot regroup groups of {self.group} into {group}")
        w = self if self.mins.numel() else self.with_float32_scales()    # implied u4 mins: float32
        sc = w.scales.repeat_interleave(rep, dim=1)
        mins = w.stored_mins()                                       # i8 has no implied mins
        mn = mins.repeat_interleave(rep, dim=1) if mins.numel() else mins
        return QWeight(q.contiguous(), sc.contiguous(), mn.contiguous(), I8, group, self.source)

    @staticmethod
    def cat(parts: Sequence["QWeight"]) -> "QWeight":
        """Stack along N (the fused qkv / gate_up projections). Parts of different layouts are
        widened to a common one first (u4 -> i8, groups of 32 -> 16), exactly."""
        if len({p.in_features for p in parts}) != 1:
            raise QuantError("cannot stack quantized matrices of different K")
        same = all(p.kind == parts[0].kind and p.group == parts[0].group for p in parts)
        if not same:
            g = min(p.group for p in parts)
            parts = [p.as_i8(g) for p in parts]
        if len({bool(p.mins.numel()) for p in parts}) > 1:        # some stored, some not:
            def written(p: QWeight) -> QWeight:                      # write them all out
                if p.mins.numel():
                    return p
                p = p.with_float32_scales()
                mins = p.stored_mins() if p.kind == U4 else torch.zeros_like(p.scales)
                return QWeight(p.qs, p.scales, mins, p.kind, p.group, p.source)
            parts = [written(p) for p in parts]
        if len({p.scales.dtype for p in parts}) > 1:               # float16 and float32: widen
            parts = [p.with_float32_scales() for p in parts]
        src = "+".join(dict.fromkeys(p.source for p in parts))   # (all parts have mins, or none)
        return QWeight(torch.cat([p.qs for p in parts]).contiguous(),
                       torch.cat([p.scales for p in parts]).contiguous(),
                       torch.cat([p.mins for p in parts]).contiguous() if parts[0].mins.numel() else parts[0].mins,
                       parts[0].kind, parts[0].group, src)


Weight = Union[torch.Tensor, QWeight]


def linear(x: torch.Tensor, w: Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` for a dense or a quantized weight."""
    if isinstance(w, QWeight):
        y = w.linear(x)
        return y if bias is None else y + bias.to(y.dtype)
    return torch.nn.functional.linear(x, w, bias)


def embedding(tokens: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table (dense or quantized) as ``dtype``, ``[*tokens.shape, K]``."""
    if isinstance(w, QWeight):
        return w.rows(tokens).to(dtype)
    return torch.nn.functional.embedding(tokens, w)


def dense(w: Weight) -> torch.Tensor:
    """float32 for a quantized weight, the tensor itself otherwise."""
    return w.dequantize() if isinstance(w, QWeight) else w


def cat_rows(parts: Sequence[Weight]) -> Weight:
    """Stack weights along N; all quantized: a QWeight, else a dense float32 tensor."""
    if all(isinstance(p, QWeight) for p in parts):
        return QWeight.cat(parts)
    return torch.cat([dense(p).float() for p in parts]).contiguous()


# -------------------------------------------------------------------------------- GGUF


def _f16(b: np.ndarray, off: int, keep: bool = False) -> np.ndarray:
    """float16 at byte offset ``off`` of every block -> float32 [..., 1] (``keep``: float16)."""
    h = np.ascontiguousarray(b[..., off:off + 2]).view(np.float16)
    return h if keep else h.astype(np.float32)


def _pack_u4(vals: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 -> our u4 bytes [N, K/2] (group: byte j = v[j] | v[j + 16] << 4)."""
    n, k = vals.shape
    v = vals.reshape(n, k // 32, 2, 16).astype(np.uint8)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed scale bytes of Q4_K / Q5_K -> (sc, m), 6-bit each, [..., 8]."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def from_gguf(data: np.ndarray, qtype: str, n: int, k: int) -> QWeight:
    """Repack a GGUF tensor's raw blocks (uint8, ``n`` rows of ``k`` weights) into a QWeight."""
    if qtype not in _BLOCK:
        raise QuantError(f"GGUF type {qtype} is not kept quantized (supported: "
                         f"{', '.join(GGUF_QUANT_TYPES)})")
    qk, bb = _BLOCK[qtype]
    if k % qk:
        raise QuantError(f"{qtype}: row length {k} is not a multiple of {qk}")
    nb = k // qk
    raw = np.asarray(data, dtype=np.uint8)
    if raw.size != n * nb * bb:
        raise QuantError(f"{qtype}: {raw.size} bytes for a [{n}, {k}] tensor, expected {n * nb * bb}")
    b = raw.reshape(n, nb, bb)
    t = torch.from_numpy
    if qtype in ("Q4_0", "Q4_1"):                                       # float16 scales, mins
        d = _f16(b, 0, keep=True)[..., 0]                               # [n, nb]
        # Q4_0: q - 8, the mins (-8 d) implied; Q4_1: the file's mins
        mins = (torch.empty(0, dtype=torch.float16) if qtype == "Q4_0"
                else t(np.ascontiguousarray(_f16(b, 2, keep=True)[..., 0])))
        qs = b[:, :, 2:18] if qtype == "Q4_0" else b[:, :, 4:20]        # our u4 layout already
        return QWeight(t(np.ascontiguousarray(qs).reshape(n, k // 2)), t(np.ascontiguousarray(d)),
                       mins, U4, 32, qtype)
    if qtype == "Q8_0":
        d = _f16(b, 0, keep=True)[..., 0]                               # float16 scales
        qs = np.ascontiguousarray(b[:, :, 2:34]).view(np.int8).reshape(n, k)
        return QWeight(t(qs), t(np.ascontiguousarray(d)), torch.empty(0, dtype=torch.float16), I8, 32, qtype)
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0), _f16(b, 2)                                 # [n, nb, 1]
        sc, m = _k4_scales(b[:, :, 4:16])                                # [n, nb, 8]
        scales = (d * sc.astype(np.float32)).reshape(n, nb * 8)          # exact in float32
        mins = (-(dmin * m.astype(np.float32))).reshape(n, nb * 8)
        ql = b[:, :, 16:144] if qtype == "Q4_K" else b[:, :, 48:176]
        ql = ql.reshape(n, nb, 4, 32)                                    # 4 pairs of sub-blocks
        q = np.stack([ql & 0xF, ql >> 4], axis=3)                        # [n, nb, 4, 2, 32]
        if qtype == "Q4_K":
            return QWeight(t(_pack_u4(q.reshape(n, k))), t(scales), t(mins), U4, 32, qtype)
        qh = b[:, :, 16:48]                                              # [n, nb, 32]
        j = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)                # sub-block j: bit j
        hi = (qh[:, :, None, None, :] >> j) & 1                          # [n, nb, 4, 2, 32]
        q = (q + (hi << 4)).astype(np.int8)
        return QWeight(t(q.reshape(n, k)), t(scales), t(mins), I8, 32, qtype)
    # Q6_K: ql [0:128], qh [128:192], scales int8 [192:208], d [208:210]
    d = _f16(b, 208)                                                     # [n, nb, 1]
    sc = np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).astype(np.float32)
    scales = (d * sc).reshape(n, nb * 16)
    ql = b[:, :, 0:128].reshape(n, nb, 2, 2, 32)                         # [half, l // 32, l % 32]
    qh = b[:, :, 128:192].reshape(n, nb, 2, 32)                          # [half, l]
    lo = np.stack([ql[:, :, :, 0] & 0xF, ql[:, :, :, 1] & 0xF,
                   ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], axis=3)    # [n, nb, 2, 4, 32]
    sh = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    hi = (qh[:, :, :, None, :] >> sh) & 3                                # [n, nb, 2, 4, 32]
    q = (lo.astype(np.int16) | (hi.astype(np.int16) << 4)) - 32
    return QWeight(t(q.astype(np.int8).reshape(n, k)), t(np.ascontiguousarray(scales)),
                   torch.empty(0), I8, 16, qtype)


# -------------------------------------------------------------------------------- load-time quantizers


def prepare_weights(weights, keep_quantized: bool, scheme: Optional[str] = None):
    """Apply the engine's weight options to a ModelWeights: dequantize every QWeight (not
    ``keep_quantized``), or quantize the float matrices whose K is a multiple of 32 with
    ``scheme`` ("int8" / "int4"; QWeights keep the file's bits)."""
    if not keep_quantized:
        return weights.dequantized() if weights.is_quantized() else weights
    if scheme is None:
        return weights

    def q(t):
        if isinstance(t, QWeight) or t.dim() != 2 or t.shape[1] % 32:
            return t
        return quantize(t, scheme)
    return weights.map_matrices(q)


def quantize(w: torch.Tensor, scheme: str) -> QWeight:
    """Quantize a float matrix ``[N, K]`` (K a multiple of 32) at load: ``int8``: symmetric,
    groups of 32 (like Q8_0); ``int4``: scale + min, groups of 32 (like Q4_1)."""
    if scheme not in QUANTIZE_CHOICES:
        raise QuantError(f"unknown quantization {scheme!r} (choices: {', '.join(QUANTIZE_CHOICES)})")
    if w.dim() != 2 or w.shape[1] % 32:
        raise QuantError(f"can only quantize [N, K] matrices with K % 32 == 0, got {tuple(w.shape)}")
    n, k = w.shape
    g = w.detach().float().cpu().reshape(n, k // 32, 32)
    if scheme == "int8":
        amax = g.abs().amax(dim=2)                                        # [n, G]
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
        return QWeight(q.reshape(n, k).contiguous(), scale.contiguous(), torch.empty(0), I8, 32,
                       "int8")
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(hi))
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2)
    return QWeight(qs.contiguous(), scale.contiguous(), lo.contiguous(), U4, 32, "int4")
