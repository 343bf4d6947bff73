"""Decode throughput, side by side in one process, on the embedded SmolLM2.

    python perf/bench_decode.py [--steps 64] [--rounds 5] [--batch 32] [--no-llamacpp]
                                [--dtypes float32,bfloat16,float16] [--threads N]

Measures, in interleaved rounds (A B C A B C ...) so machine noise hits every
contender alike, and reports medians:
  * single-stream decode tokens/s: our paged engine vs a plain PyTorch loop
    over the same weights with a contiguous KV cache (symphony.kernel.reference)
  * batch-N decode tokens/s of our engine (N sequences, one forward pass per step)
  * the same two figures for llama.cpp (llama-cpp-python) on the same GGUF file,
    when it is installed (it is a perf-only dependency, never needed by CI)
  * with --dtypes naming several dtypes (default: float32 only), the engine and the
    plain loop in each of them, in the same rounds, and each dtype's speed relative
    to the first one (per-round ratios, then their median)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symphony.kernel.config import DTYPES, EngineConfig          # noqa: E402
from symphony.kernel.engine import Engine, PredRequest           # noqa: E402
from symphony.kernel.loader import default_model_path, load_model  # noqa: E402
from symphony.kernel.reference import ReferenceLlama             # noqa: E402

PROMPT = "Write a short story about a robot who learns to play the violin."


def bench_engine_single(eng, prompt_ids, steps):
    kv = eng.new_sequence()
    logits = eng.pred(kv, prompt_ids)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = eng.pred(kv, [int(logits.argmax())])
    dt = time.perf_counter() - t0
    eng.release(kv)
    return steps / dt


def bench_reference_single(ref, prompt_ids, steps):
    cache = ref.new_cache(len(prompt_ids) + steps + 1)
    logits = ref.forward(prompt_ids, cache=cache)[-1]
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = ref.forward([int(logits.argmax())], cache=cache)[-1]
    return steps / (time.perf_counter() - t0)


def bench_engine_batch(eng, prompt_ids, steps, batch):
    seqs = [eng.new_sequence() for _ in range(batch)]
    # distinct prompts of equal length, prefilled in one pass
    outs = eng.pred_batch([PredRequest(s, prompt_ids[:-1] + [i + 100]) for i, s in enumerate(seqs)])
    t0 = time.perf_counter()
    for _ in range(steps):
        outs = eng.pred_batch([PredRequest(s, [int(o.argmax())]) for s, o in zip(seqs, outs)])
    dt = time.perf_counter() - t0
    for s in seqs:
        eng.release(s)
    return batch * steps / dt


class LlamaCpp:
    """llama.cpp through llama-cpp-python's low-level API (multi-sequence batches)."""

    def __init__(self, path, n_ctx, n_seq, threads):
        import llama_cpp as lc
        self.lc = lc
        # the high-level Llama() loads the model; its own context holds one sequence only,
        # so a second context with n_seq_max sequences is made through the C API
        self.llm = lc.Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq
        p.n_threads = p.n_threads_batch = threads
        if hasattr(p, "kv_unified"):
            p.kv_unified = True
        self.ctx = lc.llama_init_from_model(self.llm._model.model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp context creation failed")
        self.vocab = self.llm.n_vocab()

    def _decode(self, items):
        """items: [(seq_id, tokens, start_pos)] -> next-token argmax per item."""
        lc = self.lc
        n = sum(len(t) for _, t, _ in items)
        batch = lc.llama_batch_init(n, 0, len(items))
        try:
            k, rows = 0, []
            for sid, toks, pos in items:
                for j, t in enumerate(toks):
                    batch.token[k] = t
                    batch.pos[k] = pos + j
                    batch.n_seq_id[k] = 1
                    batch.seq_id[k][0] = sid
                    batch.logits[k] = j == len(toks) - 1
                    k += 1
                rows.append(k - 1)
            batch.n_tokens = n
            if lc.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            out = []
            for r in rows:
                ptr = lc.llama_get_logits_ith(self.ctx, r)

                arr = np.ctypeslib.as_array(ptr, shape=(self.vocab,))
                out.append(int(arr.argmax()))
            return out
        finally:
            lc.llama_batch_free(batch)

    def _clear(self):
        lc = self.lc
        if hasattr(lc, "llama_memory_clear"):
            lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        else:
            lc.llama_kv_self_clear(self.ctx) if hasattr(lc, "llama_kv_self_clear") else lc.llama_kv_cache_clear(self.ctx)

    def single(self, prompt_ids, steps):
        self._clear()
        [t] = self._decode([(0, prompt_ids, 0)])
        pos = len(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            [t] = self._decode([(0, [t], pos)])
            pos += 1
        return steps / (time.perf_counter() - t0)

    def batch(self, prompt_ids, steps, n):
        self._clear()
        prompts = [prompt_ids[:-1] + [i + 100] for i in range(n)]
        nxt = [self._decode([(i, p, 0)])[0] for i, p in enumerate(prompts)]   # prefill under n_batch
        pos = len(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            nxt = self._decode([(i, [t], pos) for i, t in enumerate(nxt)])
            pos += 1
        return n * steps / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--dtypes", default="float32",
                    help="comma-separated engine dtypes: float32, bfloat16, float16 (default float32)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dnames = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dnames:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r} (float32, bfloat16, float16)")
    threads = torch.get_num_threads()
    print(f"# SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32, run as {', '.join(dnames)}), "
          f"CPU, {threads} threads, torch {torch.__version__}", flush=True)
    weights, tok = load_model(None, progress=False)
    engines = {d: Engine(weights, tok, EngineConfig(page_size=16, kv_memory_bytes=512 * 2**20,
                                                    dtype=DTYPES[d])) for d in dnames}
    refs = {d: ReferenceLlama(weights, dtype=DTYPES[d]) for d in dnames}
    del weights
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    print(f"# prompt {len(ids)} tokens, {args.steps} decode steps, {args.rounds} interleaved rounds", flush=True)
    lcpp = None
    if not args.no_llamacpp:
        try:
            lcpp = LlamaCpp(default_model_path(), n_ctx=(len(ids) + args.steps + 8) * args.batch,
                            n_seq=args.batch, threads=threads)
        except ImportError:
            print("# llama-cpp-python not installed: skipping llama.cpp (pip install llama-cpp-python)")
    keys = [f"{k}_{d}" for d in dnames for k in ("engine_1", "torch_1", "engine_b")]
    res = {k: [] for k in keys + ["lcpp_1", "lcpp_b"]}
    for d in dnames:                                                 # warm-up
        bench_engine_single(engines[d], ids, 4)
        bench_reference_single(refs[d], ids, 4)
        bench_engine_batch(engines[d], ids, 2, args.batch)
    for r in range(args.rounds):
        for d in dnames:
            res[f"engine_1_{d}"].append(bench_engine_single(engines[d], ids, args.steps))
            res[f"torch_1_{d}"].append(bench_reference_single(refs[d], ids, args.steps))
            res[f"engine_b_{d}"].append(bench_engine_batch(engines[d], ids, args.steps // 2, args.batch))
        if lcpp:
            res["lcpp_1"].append(lcpp.single(ids, args.steps))
            res["lcpp_b"].append(lcpp.batch(ids, args.steps // 2, args.batch))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]:.1f}" for k, v in res.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in res.items() if v}
    b = args.batch
    print("\n| contender | single-stream tok/s | batch-%d tok/s | batch-%d / single |" % (b, b))
    print("|---|---|---|---|")
    for d in dnames:
        e1, eb = med[f"engine_1_{d}"], med[f"engine_b_{d}"]
        print(f"| symphony paged engine, {d} | {e1:.1f} | {eb:.1f} | {eb / e1:.1f}x |")
        print(f"| plain PyTorch loop (contiguous KV), {d} | {med[f'torch_1_{d}']:.1f} | - | - |")
    if lcpp:
        print(f"| llama.cpp (llama-cpp-python, Q4_1) | {med['lcpp_1']:.1f} | {med['lcpp_b']:.1f} | "
              f"{med['lcpp_b'] / med['lcpp_1']:.1f}x |")
    print()
    for d in dnames:
        print(f"[{d}] engine / plain PyTorch, single stream: "
              f"{med[f'engine_1_{d}'] / med[f'torch_1_{d}']:.2f}x (target >= 1.0)")
        print(f"[{d}] engine batch-{b} / single stream:      "
              f"{med[f'engine_b_{d}'] / med[f'engine_1_{d}']:.1f}x (target >= 8)")
    d0 = dnames[0]
    for d in dnames[1:]:
        def ratio(k):
            per_round = [x / y for x, y in zip(res[f"{k}_{d}"], res[f"{k}_{d0}"])]
            return statistics.median(per_round), min(per_round), max(per_round)
        for k, what in (("engine_1", "engine single stream"), ("engine_b", f"engine batch-{b}"),
                        ("torch_1", "plain PyTorch single stream")):
            m, lo, hi = ratio(k)
            print(f"{d} / {d0}, {what}: {m:.2f}x (rounds {lo:.2f}..{hi:.2f})")
    if lcpp:
        print(f"engine / llama.cpp, single stream:     {med[f'engine_1_{d0}'] / med['lcpp_1']:.2f}x")
        print(f"engine / llama.cpp, batch-{b}:          {med[f'engine_b_{d0}'] / med['lcpp_b']:.2f}x")


if __name__ == "__main__":
    main()
