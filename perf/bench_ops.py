"""Time symphony's paged_attention against SDPA on gathered, contiguous K/V.

    python perf/bench_ops.py [--threads N] [--runs 15] [--device cpu|cuda]
                             [--dtypes float32,bfloat16,float16]

Shapes are SmolLM2-135M's (n_heads=9, n_kv_heads=3, head_dim=64), page_size 16, pages
shuffled: one 1500-token prefill and a decode step of 32 sequences x 1000 tokens of context.
SDPA gets the same data already gathered into contiguous [B, heads, L, head_dim] tensors (the
gather is not timed), with enable_gqa=True. Prints medians and the ratio ours / SDPA; with
several dtypes (default: float32 only), every dtype of a case is timed in the same interleaved
rounds and "vs first" is ours in that dtype / ours in the first one.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from symphony.engine import ops  # noqa: E402

N_HEADS, N_KV, HEAD_DIM, PAGE = 9, 3, 64, 16


def make(q_lens, kv_lens, device, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    need = [-(-kv // PAGE) for kv in kv_lens]
    num_pages = sum(need) + 16
    perm = torch.randperm(num_pages, generator=g)
    pt = torch.zeros(len(q_lens), max(need), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        pt[b, :n] = perm[pos:pos + n].int()
        pos += n
    kc = torch.randn(num_pages, PAGE, N_KV, HEAD_DIM, generator=g)
    vc = torch.randn(num_pages, PAGE, N_KV, HEAD_DIM, generator=g)
    q = torch.randn(sum(q_lens), N_HEADS, HEAD_DIM, generator=g)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    q, kc, vc = (t.to(dtype) for t in (q, kc, vc))
    return [t.to(device) for t in (q, kc, vc, pt, cu, kvl)]


def gathered(q, kc, vc, pt, cu, kvl):
    """Contiguous [B, heads, L, D] tensors of equal-length sequences, for SDPA."""
    B = pt.shape[0]
    q_len = int(cu[1] - cu[0])
    kv_len = int(kvl[0])
    n = -(-kv_len // PAGE)
    k = kc[pt[:, :n].long()].reshape(B, n * PAGE, N_KV, HEAD_DIM)[:, :kv_len]
    v = vc[pt[:, :n].long()].reshape(B, n * PAGE, N_KV, HEAD_DIM)[:, :kv_len]
    qb = q.reshape(B, q_len, N_HEADS, HEAD_DIM)
    return (qb.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous())


def _time_ms(fn, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fns, runs, device):
    """Median time of each fn; calls are interleaved so all see the same machine noise."""
    for fn in fns:
        for _ in range(3):
            fn()
    ts = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            ts[i].append(_time_ms(fn, device))
    return [statistics.median(t) for t in ts]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32",
                    help="comma-separated: float32, bfloat16, float16 (default float32)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    ops.load()
    dev = args.device
    print(f"device={dev} threads={torch.get_num_threads()} torch={torch.__version__}")
    cases = [
        ("prefill 1 x 1500", [1500], [1500], True),
        ("decode 32 x 1 @ ctx 1000", [1] * 32, [1000] * 32, False),
        ("decode 32 x 1 @ ctx 100..2000", [1] * 32, list(range(100, 2001, 61))[:32], None),
        ("decode 1 x 1 @ ctx 2000", [1], [2000], False),
    ]
    scale = HEAD_DIM ** -0.5
    print(f"{'case':32s} {'dtype':9s} {'ours ms':>9s} {'sdpa ms':>9s} {'ours/sdpa':>9s} {'vs first':>9s}")
    for name, ql, kl, causal in cases:
        fns = []
        for dt in dtypes:
            q, kc, vc, pt, cu, kvl = make(ql, kl, dev, dtype=dt)
            fns.append(lambda q=q, kc=kc, vc=vc, pt=pt, cu=cu, kvl=kvl:
                       ops.paged_attention(q, kc, vc, pt, cu, kvl, scale))
            if causal is not None:  # ragged contexts: no single SDPA call; ours only
                qs, ks, vs = gathered(q, kc, vc, pt, cu, kvl)
                fns.append(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(
                    qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True))
        ts = median_ms(fns, args.runs, dev)
        per = 1 if causal is None else 2
        first = ts[0]
        for i, dt in enumerate(dtypes):
            ours = ts[i * per]
            dname = str(dt).replace("torch.", "")
            rel = f"{ours / first:9.2f}" if len(dtypes) > 1 else f"{'-':>9s}"
            if causal is None:
                print(f"{name:32s} {dname:9s} {ours:9.3f} {'-':>9s} {'-':>9s} {rel}")
            else:
                sdpa = ts[i * per + 1]
                print(f"{name:32s} {dname:9s} {ours:9.3f} {sdpa:9.3f} {ours / sdpa:9.2f} {rel}")


if __name__ == "__main__":
    main()
