"""Tensor parallelism on this CPU: decode and prefill tokens/s at --tp 1, 2 (a tiny-head model
cannot split 2 ways: the embedded SmolLM2 runs at 1 and 3) in one run, and what moves per token.

    python perf/bench_tp.py [--sizes 1,3] [--rounds 3] [--steps 32] [--batch 16] [--prefill 256]

Rank 0 is this process (the other ranks: worker processes, as under ``symphony-kernel --tp N``),
each rank computing with the cores divided by the ranks.  Rounds alternate the sizes
(1 3 1 3 ...) so machine noise hits both alike; medians with the per-round min..max.  Also
printed: the bytes each rank sends per decoded token in its two all-reduces a layer, and the step's
broadcast bytes.  On a 2-core CPU a loss is expected: the ranks share the same memory bandwidth
and cores, and every layer adds two all-reduces through gloo; the point of --tp on a CPU is
that CI runs the tensor-parallel code paths, and on GPUs that a model larger than one card runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symphony.engine.config import EngineConfig                  # noqa: E402
from symphony.engine.engine import Engine, PredRequest           # noqa: E402
from symphony.engine.loader import load_model, read_model_config  # noqa: E402
from symphony.engine.tp.launch import TensorParallel             # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "paper"))
from common import cpu_name                                      # noqa: E402


def make(size: int, model, cfg: EngineConfig) -> Engine:
    if size == 1:
        torch.set_num_threads(os.cpu_count() or 1)
        weights, tok = load_model(model, progress=False, keep_quantized=cfg.keep_quantized)
        return Engine(weights, tok, cfg)
    tp = TensorParallel.start(model, cfg, size, read_model_config(model))
    torch.set_num_threads(tp.threads)
    return Engine.load(model, cfg, progress=False, tp=tp)


def run(eng: Engine, steps: int, batch: int, prefill: int) -> dict:
    out = {}
    s = eng.new_sequence()
    t = int(eng.pred(s, list(range(100, 116))).argmax())
    t0 = time.perf_counter()
    for _ in range(steps):
        t = int(eng.pred(s, [t]).argmax())
    out["decode"] = steps / (time.perf_counter() - t0)
    eng.release(s)
    seqs = [eng.new_sequence() for _ in range(batch)]
    nxt = [int(x.argmax()) for x in eng.pred_batch([PredRequest(q, [100 + i, 7]) for i, q in enumerate(seqs)])]
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = [int(x.argmax()) for x in eng.pred_batch([PredRequest(q, [n]) for q, n in zip(seqs, nxt)])]
    out["batch"] = steps * batch / (time.perf_counter() - t0)
    for q in seqs:
        eng.release(q)
    s = eng.new_sequence()
    t0 = time.perf_counter()
    eng.pred(s, [(i * 37) % 1000 + 10 for i in range(prefill)])
    out["prefill"] = prefill / (time.perf_counter() - t0)
    eng.release(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sizes", default="1,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=256)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    cfg = EngineConfig(page_size=16, num_pages=512)
    print(f"# {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}; model "
          f"{args.model or 'embedded SmolLM2-135M-Instruct Q4_1'}", flush=True)
    res = {n: [] for n in sizes}
    moved = {}
    for r in range(args.rounds):
        for n in sizes:                         # one group per process at a time: start, run, stop
            eng = make(n, args.model, cfg)
            before = eng.tp.group.bytes_reduced if eng.tp else 0
            res[n].append(run(eng, args.steps, args.batch, args.prefill))
            if eng.tp:
                toks = args.steps * (1 + args.batch) + 16 + 2 * args.batch + args.prefill
                moved[n] = (eng.tp.group.bytes_reduced - before) / toks
            eng.close()
            print(f"round {r + 1}, --tp {n}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in res[n][-1].items()),
                  flush=True)
    c = read_model_config(args.model)
    print(f"\n| measurement | " + " | ".join(f"--tp {n}" for n in sizes) + " | " +
          " | ".join(f"--tp {n} / --tp 1" for n in sizes[1:]) + " |")
    print("|---|" + "---|" * (2 * len(sizes) - 1))
    for k, name in (("decode", "single-stream decode tok/s"), ("batch", f"batch-{args.batch} decode tok/s"),
                    ("prefill", f"prefill of {args.prefill} tok/s")):
        med = {n: statistics.median(x[k] for x in res[n]) for n in sizes}
        cells = [f"{med[n]:.1f} ({min(x[k] for x in res[n]):.1f}..{max(x[k] for x in res[n]):.1f})" for n in sizes]
        ratios = [f"**{med[n] / med[sizes[0]]:.2f}** ({min(a[k] / b[k] for a, b in zip(res[n], res[sizes[0]])):.2f}.."
                  f"{max(a[k] / b[k] for a, b in zip(res[n], res[sizes[0]])):.2f})" for n in sizes[1:]]
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    for n, b in moved.items():
        print(f"\n--tp {n}: {b / 1024:.1f} KiB all-reduced per token per rank (2 x {c.n_layers} layers x "
              f"hidden {c.hidden_size} x 4 bytes = {2 * c.n_layers * c.hidden_size * 4 / 1024:.1f} KiB)")


if __name__ == "__main__":
    main()
