"""The cost of pred() granularity: time per decode step at batch 1..64 when each call
returns the full logits, the top-k, or a token chosen in the kernel.

    python perf/paper/granularity.py [--batches 1,4,16,64] [--steps 24] [--rounds 3]
                                     [--modes logits,topk,argmax,sample] [--plot PNG]

One kernel (the embedded SmolLM2-135M, its default device) serves every run.  For each
batch size B, B LIPs are spawned together, each prefills its own ~40-token prompt into an
anonymous KV file, says "ready" and waits; once all are ready they are told "go" at once
and each makes --steps decode steps with ``pred(f, [t], output=MODE)``:

  logits   the full row of vocabulary logits crosses into the LIP (49,152 float32: 192 KiB
           per call) and the LIP takes the argmax with NumPy;
  topk     ``output="topk", k=20``: 20 ids and log-probabilities cross; the LIP takes the first;
  argmax   the kernel picks the greedy token; only its id crosses;
  sample   the kernel samples (temperature 0.8, top-p 0.95, a seed per step); only the id crosses.

Each LIP times its own steps (perf_counter); the figure per (B, mode) is the median over
the B LIPs of the time per step, and the aggregate tokens/s over the decode phase (first
start to last end, CLOCK_MONOTONIC shared by the processes).  The modes alternate within
each round (the order rotates per round) so that drift on a shared machine hits them
alike; the table gives medians over rounds with the per-round spread, and each mode's
step time as a ratio to argmax in the same round.  The plot (matplotlib, a perf-only
dependency) shows step time vs batch per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))
sys.path.insert(0, str(REPO / "tests"))

from bench_kernel import KernelProc, run_together  # noqa: E402
from common import cpu_name, pyplot, save, spread  # noqa: E402

MODES = ("logits", "topk", "argmax", "sample")
LIP = r'''
import json, time
import numpy as np
from symphony.lip import kv, pred, recv, send, tokenize

def step(f, t, mode, i):
    if mode == "logits":
        return int(np.argmax(pred(f, [t])))
    if mode == "topk":
        ids, _ = pred(f, [t], output="topk", k=20)
        return int(ids[0])
    if mode == "sample":
        return pred(f, [t], output="sample", temperature=0.8, top_p=0.95, seed=i)
    return pred(f, [t], output="argmax")

def main(prompt, mode, steps):
    steps = int(steps)
    with kv.create() as f:
        t = pred(f, tokenize(prompt), output="argmax")
        send("ready")
        recv()
        t0 = time.perf_counter()
        for i in range(steps):
            t = step(f, t, mode, i)
        t1 = time.perf_counter()
    send({"t0": t0, "t1": t1, "step_ms": 1e3 * (t1 - t0) / steps})
'''



def one(k: KernelProc, batch: int, mode: str, steps: int, timeout: float) -> dict:
    prompts = [f"Story {i}: write a short story about a robot who learns to play the violin."
               for i in range(batch)]
    conns, _ = run_together(k, LIP, [[p, mode, str(steps)] for p in prompts], filename="granularity.py",
                            timeout=timeout, go=True, kv_tokens=64 + steps)
    bad = [c for c in conns if not c.ok]
    if bad:
        raise RuntimeError(f"{len(bad)}/{batch} LIPs failed ({mode}, batch {batch}): {bad[0].describe()}")
    res = [c.result for c in conns]
    span = max(r["t1"] for r in res) - min(r["t0"] for r in res)
    return {"step_ms": statistics.median(r["step_ms"] for r in res), "tok_s": batch * steps / span}



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--kernel-args", default="", help="extra symphony-kernel flags (e.g. '--gpus 0')")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("granularity.png")))
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    if not batches or min(batches) < 1 or max(batches) > 256 or set(modes) - set(MODES) or "argmax" not in modes:
        ap.error(f"--batches in 1..256; --modes from {MODES}, argmax included (the ratios' baseline)")
    if a.steps < 1 or a.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")

    tmp = Path(tempfile.mkdtemp(prefix="paper-granularity-"))
    k = KernelProc(tmp, "--kv-memory-mb", "512", "--max-lips", "256", "--max-lips-per-user", "256",
                   *a.kernel_args.split())
    print(f"# pred() granularity: SmolLM2-135M-Instruct Q4_1, {cpu_name()}, {os.cpu_count()} vCPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; kernel log {tmp / 'kernel.log'}",
          flush=True)
    figures: dict = {b: {m: [] for m in modes} for b in batches}
    try:
        for b in batches:                                  # warm-up: every path, small
            for m in modes:
                one(k, min(b, 4), m, 2, a.timeout)
        for r in range(a.rounds):
            for b in batches:
                order = modes[r % len(modes):] + modes[:r % len(modes)]
                for m in order:
                    figures[b][m].append(one(k, b, m, a.steps, a.timeout))
                print(f"  round {r + 1}/{a.rounds}, batch {b}: " + ", ".join(
                    f"{m} {figures[b][m][-1]['step_ms']:.1f} ms" for m in modes), flush=True)
    finally:
        k.proc.terminate()
        k.proc.wait(30)

    print(f"\n| batch | " + " | ".join(f"{m} ms/step" for m in modes) + " | "
          + " | ".join(f"{m} / argmax" for m in modes if m != "argmax") + " | argmax tok/s |")
    print("|---" * (1 + 2 * len(modes)) + "|")
    for b in batches:
        cells = [spread([x["step_ms"] for x in figures[b][m]]) for m in modes]
        ratios = [spread([x["step_ms"] / y["step_ms"] for x, y in zip(figures[b][m], figures[b]["argmax"])])
                  for m in modes if m != "argmax"]
        tok = spread([x["tok_s"] for x in figures[b]["argmax"]])
        print(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(ratios) + f" | {tok} |")
    if a.json:
        Path(a.json).write_text(json.dumps({str(b): v for b, v in figures.items()}))
    plt = pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in modes:
        ax.plot(batches, [statistics.median(x["step_ms"] for x in figures[b][m]) for b in batches],
                marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LIPs decoding together (batch)")
    ax.set_ylabel("time per decode step, ms (median)")
    ax.set_title(f"pred() output granularity\nSmolLM2-135M Q4_1, {cpu_name()[:40]}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
