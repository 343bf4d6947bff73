"""Time symphony's paged attention against SDPA (and flash-attn / FlashInfer where installed) on
the same K/V gathered into contiguous tensors.

    python perf/bench_ops.py [--threads N] [--runs 15] [--device cpu|cuda] [--layers 1]
                             [--dtypes float32,bfloat16,float16] [--shape smollm|1b] [--json PATH]

Head shapes: SmolLM2-135M's (n_heads=9, n_kv_heads=3, head_dim=64) or Llama-3.2-1B's (32, 8,
64); page_size 16, pages shuffled. Cases: a 1500-token prompt into an empty file, a 1000-token
prompt into a file of 1000 (the non-empty-file prefill), decode steps of 32 sequences at a
context of 1000 and of 100..2000, of one sequence at 2000 and at 64. SDPA gets the same data
already gathered into contiguous [B, heads, L, head_dim] tensors (the gather is not timed),
enable_gqa=True; causal with the keys' offset (a boolean mask where the queries do not start at
key 0). On the CPU in float32 `paged_attention_bf16` (the attention of `--activations int8`:
prompts on the AMX tiles in bfloat16 where the CPU has them) is timed beside `paged_attention`.
On CUDA `paged_attention_tiled` (the query-tiled prefill and split decode kernels) is
timed beside `paged_attention`, and flash-attn's `flash_attn_func` and FlashInfer's
`single_prefill_with_kv_cache` / `single_decode_with_kv_cache` where those packages import
(both take bottom-right aligned causal masks, our semantics). Times are CUDA events around each
call on a GPU, wall time on the CPU; medians of --runs interleaved calls. With --layers N
each call is N calls, one on each of N layers' caches in turn (as a forward pass reads them:
cold), and the time is per layer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from symphony.engine import ops  # noqa: E402

SHAPES = {"smollm": (9, 3, 64), "1b": (32, 8, 64)}
PAGE = 16


def make(q_lens, kv_lens, shape, device, seed=0, dtype=torch.float32):
    n_heads, n_kv, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    need = [-(-kv // PAGE) for kv in kv_lens]
    num_pages = sum(need) + 16
    perm = torch.randperm(num_pages, generator=g)
    pt = torch.zeros(len(q_lens), max(need), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        pt[b, :n] = perm[pos:pos + n].int()
        pos += n
    kc = torch.randn(num_pages, PAGE, n_kv, head_dim, generator=g)
    vc = torch.randn(num_pages, PAGE, n_kv, head_dim, generator=g)
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    q, kc, vc = (t.to(dtype) for t in (q, kc, vc))
    return [t.to(device) for t in (q, kc, vc, pt, cu, kvl)]


def gathered(q, kc, vc, pt, cu, kvl):
    """Contiguous [B, heads, L, D] tensors of equal-length sequences."""
    B = pt.shape[0]
    q_len, kv_len = int(cu[1] - cu[0]), int(kvl[0])
    n = -(-kv_len // PAGE)
    n_kv, head_dim = kc.shape[2], kc.shape[3]
    k = kc[pt[:, :n].long()].reshape(B, n * PAGE, n_kv, head_dim)[:, :kv_len]
    v = vc[pt[:, :n].long()].reshape(B, n * PAGE, n_kv, head_dim)[:, :kv_len]
    qb = q.reshape(B, q_len, q.shape[1], head_dim)
    return qb, k.contiguous(), v.contiguous()            # [B, L, heads, D]


def sdpa_fn(qb, k, v, scale):
    """SDPA on [B, heads, L, D]: query i sees keys 0 .. kv_len - q_len + i."""
    q_len, kv_len = qb.shape[1], k.shape[1]
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (qb, k, v))
    if q_len == 1:
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=True)
    if q_len == kv_len:
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    i = torch.arange(q_len, device=qb.device)[:, None]
    j = torch.arange(kv_len, device=qb.device)[None, :]
    mask = j <= kv_len - q_len + i
    return lambda: F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)


def others(qb, k, v, scale):
    """(name, fn) of flash-attn and FlashInfer on the gathered tensors, where they import."""
    out = []
    try:
        from flash_attn import flash_attn_func
        out.append(("flash-attn", lambda: flash_attn_func(qb, k, v, softmax_scale=scale, causal=True)))
    except Exception as e:  # noqa: BLE001 - absent or unusable: say so once
        out.append(("flash-attn", f"not used: {type(e).__name__}: {str(e)[:80]}"))
    try:
        import flashinfer
        if qb.shape[0] == 1 and qb.shape[1] > 1:
            out.append(("flashinfer", lambda: flashinfer.single_prefill_with_kv_cache(
                qb[0], k[0], v[0], causal=True, sm_scale=scale)))
        elif qb.shape[0] == 1:
            out.append(("flashinfer", lambda: flashinfer.single_decode_with_kv_cache(
                qb[0, 0], k[0], v[0], sm_scale=scale)))
    except Exception as e:  # noqa: BLE001
        out.append(("flashinfer", f"not used: {type(e).__name__}: {str(e)[:80]}"))
    return out


def _time_ms(fn, device):
    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fns, runs, device):
    """Median time of each fn; calls are interleaved so all see the same machine noise."""
    for fn in fns:
        for _ in range(3):
            fn()
    if device == "cuda":
        torch.cuda.synchronize()
    ts = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            ts[i].append(_time_ms(fn, device))
    return [statistics.median(t) for t in ts]


CASES = [
    # name, q_lens, kv_lens, same length for SDPA (None: ragged, ours only)
    ("prefill 1 x 1500, empty file", [1500], [1500], True),
    ("prefill 1 x 1000 into a file of 1000", [1000], [2000], True),
    ("prefill chunk 1 x 128 at 2800", [128], [2928], True),
    ("decode 32 x 1 @ ctx 1000", [1] * 32, [1000] * 32, True),
    ("decode 32 x 1 @ ctx 100..2000", [1] * 32, list(range(100, 2001, 61))[:32], None),
    ("decode 1 x 1 @ ctx 2000", [1], [2000], True),
    ("decode 1 x 1 @ ctx 64", [1], [64], True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32",
                    help="comma-separated: float32, bfloat16, float16 (default float32)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the medians as JSON")
    ap.add_argument("--no-tiled", action="store_true", help="CUDA: leave paged_attention_tiled out")
    ap.add_argument("--layers", type=int, default=1,
                    help="call each contender on the caches of this many layers in turn (cold caches); "
                         "times are per layer")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    ops.load()
    dev, shape = args.device, SHAPES[args.shape]
    tiled = dev == "cuda" and ops.cuda_available() and not args.no_tiled
    print(f"device={dev} threads={torch.get_num_threads()} torch={torch.__version__} shape={args.shape} "
          f"{shape} timer={'CUDA events' if dev == 'cuda' else 'wall'} layers={args.layers}")
    scale = shape[2] ** -0.5
    rows = []
    print(f"{'case':38s} {'dtype':9s} {'contender':22s} {'ms':>9s} {'/ sdpa':>8s}")
    for name, ql, kl, same in CASES:
        for dt in dtypes:
            layers = [make(ql, kl, shape, dev, dtype=dt, seed=i) for i in range(max(1, args.layers))]
            q, kc, vc, pt, cu, kvl = layers[0]

            def each(op):               # op on every layer's caches in turn
                return lambda: [op(*x, scale) for x in layers]
            fns = [("paged_attention", each(ops.paged_attention))]
            if tiled:
                fns.append(("paged_attention_tiled", each(ops.paged_attention_tiled)))
            if dev == "cpu" and dt == torch.float32:     # --activations int8's (AMX tiles for prompts)
                fns.append(("paged_attention_bf16", each(ops.paged_attention_bf16)))
            notes = []
            if same:
                calls = [sdpa_fn(*gathered(*x), scale) for x in layers]
                fns.append(("sdpa", lambda: [f() for f in calls]))
                if dev == "cuda" and dt != torch.float32:
                    per_layer = [others(*gathered(*x), scale) for x in layers]
                    for i, (oname, ofn) in enumerate(per_layer[0]):
                        if callable(ofn):
                            fs = [pl[i][1] for pl in per_layer]
                            fns.append((oname, lambda fs=fs: [f() for f in fs]))
                        else:
                            notes.append(f"{oname} {ofn}")
            try:
                ts = median_ms([f for _, f in fns], args.runs, dev)
            except Exception as e:  # noqa: BLE001 - a contender that fails: time the ours alone
                notes.append(f"{type(e).__name__}: {str(e)[:120]}")
                fns = [f for f in fns if f[0].startswith("paged_attention")]
                ts = median_ms([f for _, f in fns], args.runs, dev)
            ts = [t / len(layers) for t in ts]
            sdpa = dict(zip([n for n, _ in fns], ts)).get("sdpa")
            dname = str(dt).replace("torch.", "")
            for (cname, _), t in zip(fns, ts):
                rel = f"{t / sdpa:8.2f}" if sdpa else f"{'-':>8s}"
                print(f"{name:38s} {dname:9s} {cname:22s} {t:9.4f} {rel}")
                rows.append(dict(case=name, dtype=dname, contender=cname, ms=t, vs_sdpa=t / sdpa if sdpa else None))
            for n in notes:
                print(f"{'':38s} {dname:9s} ({n})")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=dev, shape=args.shape, torch=torch.__version__,
                                                   runs=args.runs, layers=args.layers, rows=rows), indent=2))


if __name__ == "__main__":
    main()
