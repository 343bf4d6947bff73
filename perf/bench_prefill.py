"""Prompt into an empty KV file: fused SDPA attention vs the paged kernel, same engine.

    python perf/bench_prefill.py [--lens 512,1500] [--rounds 6]

The engine attends a prompt fed alone into an empty file with
``scaled_dot_product_attention`` where ``PagedLlama.fused_prefill`` is on (the
default on CUDA only). This runs the embedded SmolLM2 with the flag on and off,
interleaved, and prints the median of the per-round time ratios (the first
round is a warm-up).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from symphony.engine.config import EngineConfig  # noqa: E402
from symphony.engine.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="512,1500")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    eng = Engine.load(config=EngineConfig(kv_memory_bytes=256 << 20))
    print(f"# {eng.model_config.name or 'model'} on {eng.device}/{eng.dtype}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    for n in (int(x) for x in args.lens.split(",")):
        prompt = torch.randint(10, eng.model_config.vocab_size, (n,), generator=gen).tolist()
        times = {True: [], False: []}
        for _ in range(args.rounds):
            for fused in (True, False):
                eng.model.fused_prefill = fused
                kv = eng.new_sequence()
                t0 = time.perf_counter()
                eng.pred(kv, prompt)
                times[fused].append(time.perf_counter() - t0)
                eng.release(kv)
        ratios = [p / f for f, p in zip(times[True][1:], times[False][1:])]
        print(f"prompt {n}: fused {statistics.median(times[True][1:]) * 1e3:.0f} ms, "
              f"paged {statistics.median(times[False][1:]) * 1e3:.0f} ms, paged / fused time "
              f"{statistics.median(ratios):.3f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
