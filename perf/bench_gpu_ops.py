"""GPU pieces of a decode step, each against its plain alternative, in one run.

    python perf/bench_gpu_ops.py [--runs 50]

1. logits to the host: a [B, vocab] float32 copy into a pinned buffer (what the LIP arenas
   use on CUDA) vs into a pageable tensor, B = 1, 16, 64, vocab 128256 (Llama 3's);
2. quantized matrices: ``ops.qlinear`` on GGUF Q4_0 / Q8_0 weights of Llama-3.2-1B's MLP
   shape (N 8192, K 2048) vs the bf16 ``torch.matmul`` of the same shape and vs
   ``qdequant`` + float32 matmul, M = 1, 8, 16, 64 rows; the bytes each must read over the
   median time give GB/s.

3. the decode GEMVs (``--gemv``): Llama-3.2-1B's weight shapes (q/k/v 3072x2048, o 2048x2048,
   gate/up 16384x2048, down 2048x8192, the head 128256x2048 with float32 logits) at 1, 2, 4 and
   8 rows: cuBLAS, ``ops.dense_gemv`` (up to 4 rows) and ``ops.dense_gemv_tc`` with 1, 2, 4 and
   8 warps a row group, each call after the L2 cache is flushed; GB/s = the weight's bytes over
   the median (the target: >= 3,000 GB/s at 1-4 rows).

Medians of --runs timed calls (CUDA events), interleaved; the spread is the
25th-75th percentile. Needs a CUDA GPU and the ops built with CUDA. ``--only gemv`` (or
``logits``, ``quant``) runs one section; ``--json PATH`` writes section 3's medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from symphony.engine import ops, quant  # noqa: E402
from modelfiles import random_gguf_blocks  # noqa: E402


def timed(fns, runs):
    """Per fn: list of milliseconds, calls interleaved, CUDA events around each."""
    for fn in fns:
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    out = [[] for _ in fns]
    for _ in range(runs):
        for i, fn in enumerate(fns):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out[i].append(a.elapsed_time(b))
    return out


def med(ts):
    q = np.percentile(ts, [25, 75])
    return f"{statistics.median(ts):8.4f} ms [{q[0]:.4f}-{q[1]:.4f}]"


GEMV_SHAPES = [("qkv", 3072, 2048, False), ("o", 2048, 2048, False), ("gate_up", 16384, 2048, False),
               ("down", 2048, 8192, False), ("head", 128256, 2048, True)]


def gemv_section(runs, with_tc=True):
    """Section 3: every GEMV candidate on each shape and row count, L2 flushed before each call."""
    from symphony.engine.cuda_kernels import FLUSH_BYTES, run_gemv, time_calls
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    tc = with_tc and torch.cuda.get_device_capability()[0] >= 8
    out = []
    for name, n, k, f32 in GEMV_SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        mb = n * k * 2 / 1e6
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cands = [("cublas", (lambda: torch.mm(x, w.t(), out_dtype=torch.float32)) if f32
                      else (lambda: torch.nn.functional.linear(x, w)))]
            cands += [("gemv", lambda: run_gemv("gemv", x, w, f32))] if m <= 4 else []
            cands += [(f"tc{s}", lambda s=s: run_gemv(f"tc{s}", x, w, f32)) for s in (1, 2, 4, 8)] if tc else []
            ref = x.float() @ w.float().t()
            for cname, fn in cands[1:]:
                err = (fn().float() - ref).abs().max().item()
                if not err <= 1e-2 * ref.abs().max().item():
                    print(f"  WARNING {name} M={m} {cname}: max |diff| {err:.3g} from the float32 product")
            us = time_calls([fn for _, fn in cands], flush, runs, torch.device("cuda"))
            best = min(range(len(us)), key=us.__getitem__)
            print(f"  {name:8s} {n:6d}x{k:<5d} M={m}: " + "  ".join(
                f"{c} {u:7.1f} us ({mb / u * 1e3 / 1e3:5.2f} TB/s)" for (c, _), u in zip(cands, us))
                + f"  -> {cands[best][0]}", flush=True)
            out.append(dict(shape=name, n=n, k=k, rows=m, us=dict(zip([c for c, _ in cands], us)),
                            best=cands[best][0], best_tb_s=mb / us[best] / 1e3))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--only", choices=["logits", "quant", "gemv"], default=None)
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--no-tc", action="store_true", help="gemv: leave dense_gemv_tc out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_ops: needs a CUDA GPU")
    ops.load()
    if not ops.cuda_available():
        raise SystemExit("bench_gpu_ops: the ops were built without CUDA")
    p = torch.cuda.get_device_properties(0)
    print(f"# {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, CUDA {torch.version.cuda}")

    if args.only in (None, "gemv"):
        print("\n## 3. decode GEMVs, bfloat16, L2 flushed (TB/s: weight bytes / median time)")
        rows = gemv_section(args.runs, not args.no_tc)
        if args.json:
            import json
            Path(args.json).write_text(json.dumps(dict(device=p.name, gemv=rows), indent=2))
    if args.only == "gemv":
        return
    print("\n## 1. logits [B, 128256] float32 device -> host: pinned vs pageable")
    vocab = 128256
    for b in (1, 16, 64) if args.only != "quant" else ():
        src = torch.randn(b, vocab, device="cuda")
        pinned = torch.empty(b, vocab, pin_memory=True)
        pageable = torch.empty(b, vocab)
        tp, tq = timed([lambda: pinned.copy_(src, non_blocking=True), lambda: pageable.copy_(src)], args.runs)
        mb = b * vocab * 4 / 1e6
        print(f"  B={b:3d} ({mb:6.1f} MB): pinned {med(tp)} ({mb / statistics.median(tp):6.1f} GB/s)   "
              f"pageable {med(tq)} ({mb / statistics.median(tq):6.1f} GB/s)   "
              f"pageable/pinned {statistics.median(tq) / statistics.median(tp):.2f}x")
        assert torch.equal(pinned, src.cpu()) and torch.equal(pageable, src.cpu())

    if args.only == "logits":
        return
    print("\n## 2. quantized matrices, N 8192 x K 2048 (Llama-3.2-1B gate/up)")
    n, k = 8192, 2048
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    for qtype in ("Q4_0", "Q8_0"):
        qw = quant.from_gguf(random_gguf_blocks(qtype, n, k, seed=1), qtype, n, k).to("cuda")
        wbytes = sum(t.numel() * t.element_size() for t in (qw.qs, qw.scales, qw.mins) if t is not None)
        for m in (1, 8, 16, 64):
            x = torch.randn(m, k, device="cuda")
            xb = x.bfloat16()
            ref = x.double() @ qw.dequantize().double().t()
            y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group)
            err = float((y.double() - ref).norm() / ref.norm())
            tq, td, tb = timed([
                lambda: ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group),
                lambda: x @ ops.qdequant(qw.qs, qw.scales, qw.mins, qw.kind, qw.group).t(),
                lambda: xb @ dense.t()], args.runs)
            print(f"  {qtype} M={m:2d}: qlinear {med(tq)} ({wbytes / statistics.median(tq) / 1e6:6.0f} GB/s, "
                  f"rel err {err:.1e})   dequant+matmul {med(td)}   bf16 matmul {med(tb)} "
                  f"({n * k * 2 / statistics.median(tb) / 1e6:6.0f} GB/s)   bf16/qlinear "
                  f"{statistics.median(tb) / statistics.median(tq):.2f}x")


if __name__ == "__main__":
    main()
