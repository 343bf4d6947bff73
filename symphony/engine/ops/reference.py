"""Pure-PyTorch references of the ops (tests and documentation): same semantics, no speed."""
from __future__ import annotations

import torch

from ..page_allocator import pages_for

def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Reference write_kv: scatter rows into the flattened [num_pages * page_size] slot axis
    (rounded by ``.to()`` into a narrower cache)."""
    keep = slots >= 0
    idx = slots[keep]
    k_cache.view(-1, *k_cache.shape[2:])[idx] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[idx] = v[keep].to(v_cache.dtype)


def qdequant_reference(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, kind: int,
                       group: int) -> torch.Tensor:
    """Reference qdequant: unpack the quants, ``scale * q + min`` per group (float32 [N, K]).

    Computed in float64 and rounded once, like the kernels' fused multiply-add (they may differ
    by one float32 ulp where double rounding bites)."""
    if kind == 0:                                   # u4: byte j of a group = elements j, j + 16
        b = qs.view(qs.shape[0], -1, 16).to(torch.int32)                  # [N, G, 16]
        q = torch.cat([b & 0xF, b >> 4], dim=2).reshape(qs.shape[0], -1)  # [N, K]
    else:
        q = qs.to(torch.int32)                                            # [N, K]
    w = q.double() * scales.double().repeat_interleave(group, dim=1)
    if mins.numel():
        w = w + mins.double().repeat_interleave(group, dim=1)
    elif kind == 0:                                 # u4 without mins: -8 * scale (Q4_0)
        w = w - 8 * scales.double().repeat_interleave(group, dim=1)
    return w.float()


def quantize_act_reference(x: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 ``[M, K]`` rounded as the integer-activation paths do, per block of 16 values:
    ``d = max|x_block| / qmax`` and ``q = round_half_even(x * (1 / d))`` (0 where d = 0), all in
    float32; qmax 127 for the int8 paths (4-8), 16383 for the 15-bit path (9). Returns q (int8
    or int16 ``[M, K]``) and d (float32 ``[M, K / 16]``)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 16, 16)                                  # [M, K/16, 16]
    d = xb.abs().amax(dim=2) / float(qmax)                                  # [M, K/16]
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)
    q = torch.round(xb * inv.unsqueeze(2)).clamp(-qmax, qmax)              # [M, K/16, 16]
    return q.to(torch.int8 if qmax <= 127 else torch.int16).reshape(m, k), d


# the qlinear paths that round x to 15 bits (the other integer-activation paths, 4-10: int8)
FIFTEEN_BIT_PATHS = frozenset({9, 11, 12})
BF16_PATH = 13          # the dense GEMM in bfloat16: x, W and the product rounded to bfloat16


def qlinear_reference(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      kind: int, group: int, path: int = -1) -> torch.Tensor:
    """Reference qlinear: the float64 product with the dequantized weight, rounded to float32.
    Paths 4-12 (integer activations) multiply x as those paths round it
    (``quantize_act_reference``: ``d * q`` per block of 16, 15 bits for `FIFTEEN_BIT_PATHS`, 8
    for the others) instead of x itself; their kernels compute the same with integer dot products per
    block (mins included: they take the rounded x's sums). Path 13 (`BF16_PATH`) multiplies x
    and W rounded to bfloat16 and rounds the product to bfloat16 (its kernel accumulates in
    float32 before that rounding: it agrees within a few bfloat16 ulps of the row's scale)."""
    w = qdequant_reference(qs, scales, mins, kind, group)
    if path == BF16_PATH:
        xb, wb = x.to(torch.bfloat16).double(), w.to(torch.bfloat16).double()
        return (xb @ wb.t()).to(torch.bfloat16).float()
    if path >= 4:
        q, d = quantize_act_reference(x, 16383 if path in FIFTEEN_BIT_PATHS else 127)
        x = q.double() * d.double().repeat_interleave(16, dim=1)            # [M, K] as rounded
    return (x.double() @ w.double().t()).float()


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """Reference silu_mul: ``silu(gu[:, :I]) * gu[:, I:]`` for ``gu [T, 2I]``, the model's torch
    expression. The kernel's exp is within 2 ulp of exp's value (argument clamped to [-87, 88]):
    it agrees with this within ~4 ulp relative (within 2e-36 |up| where gate < -87)."""
    i = gu.shape[1] // 2
    return torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]


def rope_reference(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                   heads: int) -> torch.Tensor:
    """Reference rope_ (out of place): x ``[T, N]`` with its first ``heads`` heads of
    ``2 * table.shape[1]`` values rotated by the complex multiply the model did before the op:
    ``(x[2i] + i x[2i+1]) * table[pos, i]``, the table viewed as complex."""
    t, half = x.shape[0], table.shape[1]
    width = heads * 2 * half
    rot = torch.view_as_complex(table.contiguous())[positions].unsqueeze(1)   # [T, 1, head_dim/2]
    xc = torch.view_as_complex(x[:, :width].float().reshape(t, heads, half, 2))
    out = x.clone()
    out[:, :width] = torch.view_as_real(xc * rot).reshape(t, width).to(x.dtype)
    return out


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              page_table: torch.Tensor, cu_q_lens: torch.Tensor,
                              kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference paged_attention: per sequence, gather K/V, build the causal mask, softmax."""
    T, n_heads, head_dim = q.shape
    _, page_size, n_kv_heads, _ = k_cache.shape
    group = n_heads // n_kv_heads
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # float32 accumulation
    out = torch.zeros(T, n_heads, head_dim, dtype=q.dtype, device=q.device)
    cu = cu_q_lens.tolist()
    kvl = kv_lens.tolist()
    for b in range(len(kvl)):
        q0, q1, kv_len = cu[b], cu[b + 1], kvl[b]
        q_len = q1 - q0
        if q_len == 0:
            continue
        n_pages = pages_for(kv_len, page_size)
        pages = page_table[b, :n_pages].long()
        # [kv_len, n_kv_heads, head_dim] -> one K/V head per query head
        k = k_cache[pages].reshape(-1, n_kv_heads, head_dim)[:kv_len].to(acc)
        v = v_cache[pages].reshape(-1, n_kv_heads, head_dim)[:kv_len].to(acc)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        qb = q[q0:q1].to(acc)
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale      # [n_heads, q_len, kv_len]
        i = torch.arange(q_len, device=q.device).unsqueeze(1)
        j = torch.arange(kv_len, device=q.device).unsqueeze(0)
        visible = j <= (kv_len - q_len + i)                         # [q_len, kv_len]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# CUDA compile check (no GPU needed)
# --------------------------------------------------------------------------------------------
