"""Decode and prefill throughput, side by side in one process, on a GGUF file (default: the
embedded SmolLM2-135M-Instruct, Q4_1 + Q8_0).

    python perf/bench_decode.py [--steps 64] [--rounds 5] [--batch 32] [--prefill 1500]
                                [--no-llamacpp] [--no-rss] [--dtypes float32,bfloat16,float16|none]
                                [--threads N] [--model PATH.gguf] [--no-paths]
                                [--servers symphony,llama-server,vllm|none] [--server-batches 1,16]
                                [--servers-only] [--json OUT]

Measures, in interleaved rounds (A B C A B C ...) so machine noise hits every contender alike,
and reports medians with the per-round spread:
  * single-stream decode tokens/s, batch-N decode tokens/s (N sequences, one forward pass per
    step) and prefill tokens/s of one --prefill-token prompt, for
      - the engine on the GGUF's quantized bits (--weights quantized, the CPU default),
      - the same with int8-rounded activations and a bfloat16 KV pool, as ``--activations int8``
        runs (quant.set_int8_activations, opt-in; not with --no-int8),
      - the engine on the same weights dequantized to each --dtypes dtype (--weights float;
        --dtypes none skips them and the plain PyTorch loop: a 3B model's float32 copy is 12 GB),
      - llama.cpp's library (llama-cpp-python's low-level API, in this process: multi-sequence
        batches, no server) on the same file, when installed (perf-only dependency);
  * a plain PyTorch loop over the float32 weights (contiguous KV), single stream;
  * ratios from the same rounds: quantized / float32 and quantized / llama.cpp;
  * the physical limit: bytes read per decode token (weights + KV) over the read bandwidth
    measured in the same run (a multi-threaded sum over 256 MiB), and each contender's share;
  * the resident memory of a real symphony-kernel started with each --weights mode (not with
    --no-rss), against 1.5 x (GGUF size + KV pool);
  * the default's choice against every path it may take (not with --no-paths): decode steps of
    1, 8 and --batch sequences and a 128-token prefill chunk, with each qlinear path of the
    float-accurate choice forced (the scalar one left out), in interleaved rounds: the path the
    default takes (after the start-up calibration) and the fastest, side by side per row count;
  * the CPU model and its SIMD flags, the load average before and after, and the CPU the other
    processes used meanwhile (cores, from /proc/stat);
  * batched decode through each server (--servers; not with --model): N concurrent streamed
    greedy requests of distinct prompts (N from --server-batches), --steps tokens each, through
    Symphony's gateway (a kernel with default flags), llama.cpp's `llama-server` (-np N, the same
    GGUF) and vLLM (CPU, the GGUF dequantized to float32; perf/peers.py starts them, or says why
    it cannot): decode tokens/s counted from the chunks' arrival times while every request is
    decoding (from the last first token to the first last token), so prefill stays out; rounds
    interleaved, every other server paused (SIGSTOP) while one is measured.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from symphony.engine.config import DTYPES, EngineConfig          # noqa: E402
from symphony.engine.engine import Engine, PredRequest           # noqa: E402
from symphony.engine.loader import default_model_path, load_model  # noqa: E402
from symphony.engine.quant import QWeight, force_qlinear_path      # noqa: E402
from symphony.engine.reference import ReferenceLlama             # noqa: E402
from symphony.engine.ops import calibrate, qlinear_path_for, timing  # noqa: E402

import peers                                                     # noqa: E402

PREFILL_TEXT = ("The history of the violin begins in sixteenth-century Italy, where makers in Cremona "
                "and Brescia gave the instrument the shape it still has. Over the following centuries "
                "composers wrote concertos, sonatas and chamber music for it, and players carried it "
                "from courts and churches to concert halls, folk dances and recording studios. ")
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
              "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")

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


def bench_engine_prefill(eng, ids):
    kv = eng.new_sequence()
    t0 = time.perf_counter()
    eng.pred(kv, ids)
    dt = time.perf_counter() - t0
    eng.release(kv)
    return len(ids) / dt


def read_bandwidth(buf):
    """GB/s of a multi-threaded sum over ``buf`` (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best / 1e9


def cpu_description():
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k.strip() == "model name" and model == "unknown CPU":
                    model = v.strip()
                if k.strip() == "flags":
                    flags = set(v.split())
                    break
    except OSError:
        pass
    return model, [f for f in SIMD_FLAGS if f in flags]


def kernel_rss(model, mode, kv_mb, timeout=600):
    """VmRSS (bytes) of a real symphony-kernel once it listens and its KV pool is committed (the
    default, `--kv-commit background`), started with --weights mode."""
    import signal
    import subprocess
    import tempfile
    from symphony.engine.hostmem import commit_ended
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "k.sock")
        cmd = [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; "
               "sys.exit(kernel_main(sys.argv[1:]))", "--socket", sock, "--kv-memory-mb", str(kv_mb),
               "--weights", mode]
        if model:
            cmd += ["--model", str(model)]
        env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
        log_path = os.path.join(tmp, "kernel.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            t0 = time.time()
            while not os.path.exists(sock) or not commit_ended(open(log_path).read()):
                if proc.poll() is not None or time.time() - t0 > timeout:
                    return None
                time.sleep(0.2)
            time.sleep(1.0)
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return None


def weight_bytes_per_token(w):
    """Bytes of weights one decode step reads: every matrix, the embedding only when it is
    also the (tied) head (one embedding row otherwise)."""
    def nb(t):
        return t.nbytes() if isinstance(t, QWeight) else t.numel() * t.element_size()
    total = nb(w.lm_head) + w.norm.numel() * 4
    for l in w.layers:
        total += sum(nb(t) for t in (l.wqkv, l.wo, l.w_gate_up, l.w_down))
        total += (l.attn_norm.numel() + l.mlp_norm.numel()) * 4
    return total


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

    def __init__(self, path, n_ctx, n_seq, threads, extra_bufts=True):
        import llama_cpp as lc
        self.lc = lc
        if extra_bufts:
            # the high-level Llama() loads the model; its own context holds one sequence only,
            # so a second context with n_seq_max sequences is made through the C API
            self.llm = lc.Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False)
            model = self.llm._model.model
            self.vocab = self.llm.n_vocab()
        else:                            # the model without extra buffer types (AMX, repacked)
            lc.llama_backend_init()
            mp = lc.llama_model_default_params()
            mp.use_extra_bufts = False
            model = self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
            if not model:
                raise RuntimeError("llama.cpp could not load the model")
            self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        p = lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq
        p.n_threads = p.n_threads_batch = threads
        if hasattr(p, "kv_unified"):
            p.kv_unified = True
        self.ctx = lc.llama_init_from_model(model, p)
        if not self.ctx:
            raise RuntimeError("llama.cpp context creation failed")

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

    def prefill(self, ids):
        """tokens/s of one prompt (fed in n_batch chunks, logits of the last token only)."""
        self._clear()
        t0 = time.perf_counter()
        for i in range(0, len(ids), 512):
            chunk = ids[i:i + 512]
            self._decode([(0, chunk, i)])
        return len(ids) / (time.perf_counter() - t0)

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


def bench_paths(eng, ids, pre, steps, rounds, batch):
    """tok/s of the engine at each row count (1, 8, ``batch`` sequences decoding; a 128-token
    prefill chunk) with the default choice and with each path it may take forced, interleaved
    over ``rounds``: {rows: {path or "default": [tok/s per round]}}."""
    paths = [p for p in calibrate.auto_paths(-1) if p != 0]
    rows = [1, 8, batch] + ([128] if len(pre) >= 128 else [])
    res = {m: {k: [] for k in ["default", *paths]} for m in rows}

    def run(m):
        if m == 128:
            return bench_engine_prefill(eng, pre[:128])
        return bench_engine_single(eng, ids, steps) if m == 1 else bench_engine_batch(eng, ids, max(2, steps // 4), m)
    for _ in range(rounds):
        for m in rows:
            for k in res[m]:
                with force_qlinear_path(-1 if k == "default" else k):
                    res[m][k].append(run(m))
    return res


def print_paths(res, shape):
    print("\nThe default's choice against every path it may take (tok/s, median of the rounds; "
          "'default' resolved for a %d x %d u4 matrix; default / fastest: per round, then the "
          "median, min..max):" % shape)
    print("| rows | default (path) | fastest path | default / fastest | every path |")
    print("|---|---|---|---|---|")
    for m, by in res.items():
        med = {k: statistics.median(v) for k, v in by.items()}
        best = max((k for k in med if k != "default"), key=med.get)
        chosen = qlinear_path_for(-1, m, *shape, 0)
        others = ", ".join(f"{k} {med[k]:.1f}" for k in med if k != "default")
        ratios = [d / b for d, b in zip(by["default"], by[best])]   # each round's pair, timed side by side
        print(f"| {m if m != 128 else '128 (prefill)'} | {med['default']:.1f} ({chosen}) | {med[best]:.1f} ({best}) | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) | {others} |")


def spread(v):
    return f"{statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f})"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked (argparse's exit status 2 on a bad value); adds
    ``dtype_names``, ``server_names`` and ``batches`` (lists)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=1500, help="prompt tokens of the prefill test (0: skip)")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2; "
                    "perf/make_gguf.py writes random 1B / 3B ones)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                    help="llama.cpp without its extra weight buffer types (AMX, repacked layouts): "
                    "llama-cpp-python 0.3.36's AMX buffers fault on some virtual machines")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8-activation contender")
    ap.add_argument("--no-rss", action="store_true", help="skip starting real kernels for their RSS")
    ap.add_argument("--kv-mb", type=int, default=256, help="KV pool of the engines and kernels, MiB")
    ap.add_argument("--dtypes", default="float32",
                    help="comma-separated dtypes of the dequantized engines: float32, bfloat16, "
                    "float16; none: no dequantized engine and no plain PyTorch loop")
    ap.add_argument("--threads", type=int, default=0, help="torch / llama.cpp threads (default: torch's)")
    ap.add_argument("--no-paths", action="store_true", help="skip the default-vs-every-path table")
    ap.add_argument("--servers", default="symphony,llama-server,vllm",
                    help="batched decode through these servers (none: skip; not with --model)")
    ap.add_argument("--server-batches", default="1,16", help="concurrent requests of the server decode test")
    ap.add_argument("--servers-only", action="store_true", help="only the decode through the servers")
    ap.add_argument("--json", default=None, help="write the servers' decode figures (every round) to this file")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.rounds < 1 or args.batch < 1 or args.prefill < 0 or args.kv_mb < 1:
        ap.error("--steps must be >= 2, --rounds, --batch and --kv-mb >= 1, --prefill >= 0")
    args.dtype_names = [d.strip() for d in args.dtypes.split(",") if d.strip() and d.strip() != "none"]
    for d in args.dtype_names:
        if d not in DTYPES:
            ap.error(f"--dtypes: unknown dtype {d!r} (float32, bfloat16, float16)")
    args.server_names = [x for x in args.servers.split(",") if x and x != "none"]
    known = ("symphony",) + peers.NAMES
    for bad in (x for x in args.server_names if x not in known):
        ap.error(f"--servers: unknown {bad!r} (known: {', '.join(known)}, none)")
    try:
        args.batches = [int(x) for x in args.server_batches.split(",") if x]
    except ValueError:
        args.batches = []
    if not args.batches or min(args.batches) < 1:
        ap.error(f"--server-batches {args.server_batches!r}: comma-separated numbers >= 1")
    if args.servers_only and (args.model or not args.server_names):
        ap.error("--servers-only needs --servers and no --model (the servers serve the embedded model)")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.servers_only:
        cpu, _ = cpu_description()
        print(f"# CPU: {cpu}, {os.cpu_count()} logical CPUs", flush=True)
        bench_servers(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    dnames = args.dtype_names
    threads = torch.get_num_threads()
    path = args.model or default_model_path()
    cpu, flags = cpu_description()
    print(f"# {os.path.basename(str(path))} ({os.path.getsize(path) / 1e6:.1f} MB), {threads} threads, "
          f"torch {torch.__version__}", flush=True)
    print(f"# CPU: {cpu}, {os.cpu_count()} logical CPUs; SIMD flags: {' '.join(flags)}", flush=True)
    print(f"# load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    ticks0 = timing.cpu_ticks()
    weights, tok = load_model(path, progress=False)
    kv_bytes = args.kv_mb * 2**20

    def cfg(**kw):
        return EngineConfig(page_size=16, kv_memory_bytes=kv_bytes, **kw)
    engines = {"quantized": Engine(weights, tok, cfg(weights="quantized"))}
    # qlinear's automatic choices as the kernel makes them: calibrated on this CPU at this
    # thread count (SYMPHONY_QLINEAR_CALIBRATION=off: the fixed rule)
    calib = engines["quantized"].calibrate_kernels()
    if calib is not None:
        print(f"# qlinear calibration: {calib.describe()}", flush=True)
    if not args.no_int8:                          # the same weights (shared), its own KV pool
        engines["int8"] = Engine(weights, tok, cfg(weights="quantized", kv_dtype=torch.bfloat16))  # as --activations int8
    ref = None
    if dnames:
        dense = weights.dequantized()
        for d in dnames:
            engines[d] = Engine(dense, tok, cfg(weights="float", dtype=DTYPES[d]))
        ref = ReferenceLlama(dense)
        del dense
    del weights
    ids = tok.encode_chat([{"role": "user", "content": PROMPT}])
    pre = (tok.encode(PREFILL_TEXT) * (args.prefill // 40 + 1))[: args.prefill] if args.prefill else []
    print(f"# decode prompt {len(ids)} tokens, {args.steps} steps single-stream, {args.steps // 2} "
          f"batch-{args.batch} steps, "
          f"prefill {len(pre)} tokens, {args.rounds} interleaved rounds", flush=True)
    lcpp = None
    if not args.no_llamacpp:
        try:
            lcpp = LlamaCpp(path, n_ctx=max((len(ids) + args.steps + 8) * args.batch, len(pre) + 8),
                            n_seq=args.batch, threads=threads, extra_bufts=not args.llamacpp_no_extra_bufts)
        except ImportError:
            print("# llama-cpp-python not installed: skipping llama.cpp (pip install llama-cpp-python)")
    bw_buf = torch.ones(64 * 2**20)                                  # 256 MiB of float32
    names = list(engines)
    res = {f"{k}_{n}": [] for n in names for k in ("one", "batch", "prefill")}
    res.update({"torch_one": [], "bw": []} if ref is not None else {"bw": []})
    if lcpp:
        res.update({"lcpp_one": [], "lcpp_batch": [], "lcpp_prefill": []})
    def acts(n):                                  # the int8 contender: int8-activation kernels
        return force_qlinear_path(-2) if n == "int8" else contextlib.nullcontext()
    for n in names:                                                   # warm-up
        with acts(n):
            bench_engine_single(engines[n], ids, 4)
            bench_engine_batch(engines[n], ids, 2, args.batch)
            if pre:
                bench_engine_prefill(engines[n], pre[:64])
    if ref is not None:
        bench_reference_single(ref, ids, 2)
    for r in range(args.rounds):
        res["bw"].append(read_bandwidth(bw_buf))
        for n in names:
            e = engines[n]
            with acts(n):
                res[f"one_{n}"].append(bench_engine_single(e, ids, args.steps))
                res[f"batch_{n}"].append(bench_engine_batch(e, ids, args.steps // 2, args.batch))
                if pre:
                    res[f"prefill_{n}"].append(bench_engine_prefill(e, pre))
        if ref is not None:
            res["torch_one"].append(bench_reference_single(ref, ids, args.steps))
        if lcpp:
            res["lcpp_one"].append(lcpp.single(ids, args.steps))
            res["lcpp_batch"].append(lcpp.batch(ids, args.steps // 2, args.batch))
            if pre:
                res["lcpp_prefill"].append(lcpp.prefill(pre))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k} {v[-1]:.1f}" for k, v in res.items() if v), flush=True)
    paths = None if args.no_paths else bench_paths(engines["quantized"], ids, pre, args.steps // 2,
                                                   args.rounds, args.batch)
    load = timing.others_load(ticks0, timing.cpu_ticks())
    print(f"# load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; other processes "
          f"used {'?' if load is None else f'{load:.1f}'} of {os.cpu_count()} cores meanwhile", flush=True)
    if paths:
        print_paths(paths, (576, 576))
    b = args.batch
    has_pre = bool(pre)
    print(f"\n| contender | single-stream tok/s | batch-{b} tok/s | prefill {len(pre)} tok/s |")
    print("|---|---|---|---|")
    label = {"quantized": "symphony, quantized weights (GGUF bits)",
             "int8": "symphony, quantized weights + int8 activations, bfloat16 KV"}
    for n in names:
        print(f"| {label.get(n, f'symphony, dequantized {n}')} | {spread(res[f'one_{n}'])} | "
              f"{spread(res[f'batch_{n}'])} | {spread(res[f'prefill_{n}']) if has_pre else '-'} |")
    if ref is not None:
        print(f"| plain PyTorch loop, float32 | {spread(res['torch_one'])} | - | - |")
    if lcpp:
        print(f"| llama.cpp's library (llama-cpp-python, in-process) | {spread(res['lcpp_one'])} | {spread(res['lcpp_batch'])} | "
              f"{spread(res['lcpp_prefill']) if has_pre else '-'} |")
    print("\nRatios (per round, then median; min..max over rounds):")

    def ratio(a, c, what):
        if not res.get(a) or not res.get(c):
            return
        per = [x / y for x, y in zip(res[a], res[c])]
        print(f"  {what}: {statistics.median(per):.2f}x ({min(per):.2f}..{max(per):.2f})")
    d0 = dnames[0] if dnames else None
    for k, what in (("one", "single stream"), ("batch", f"batch-{b}"), ("prefill", "prefill")):
        if d0:
            ratio(f"{k}_quantized", f"{k}_{d0}", f"quantized / dequantized {d0}, {what}")
        if lcpp:
            ratio(f"{k}_quantized", f"lcpp_{k}", f"quantized / llama.cpp, {what}")
            ratio(f"{k}_int8", f"lcpp_{k}", f"quantized + int8 activations / llama.cpp, {what}")
    # the physical limit: bytes a decode step must read over the bandwidth just measured
    bw = statistics.median(res["bw"]) * 1e9
    c = engines["quantized"].model_config
    ctx = len(ids) + args.steps / 2
    print(f"\nRead bandwidth (sum over 256 MiB, {threads} threads): {bw / 1e9:.1f} GB/s "
          f"(rounds {min(res['bw']):.1f}..{max(res['bw']):.1f})")
    rows = [(n, weight_bytes_per_token(engines[n].model.w),
             2 * c.n_layers * c.kv_size * engines[n].kv.pool.element_size() * ctx) for n in names]
    if lcpp:
        gguf_bytes = os.path.getsize(path)
        rows.append(("llama.cpp", gguf_bytes, 2 * c.n_layers * c.kv_size * 2 * ctx))
    print("| contender | weight bytes / token | KV bytes / token | limit tok/s | measured | share |")
    print("|---|---|---|---|---|---|")
    for n, wb, kb in rows:
        limit = bw / (wb + kb)
        got = statistics.median(res["lcpp_one" if n == "llama.cpp" else f"one_{n}"])
        print(f"| {n} | {wb / 1e6:.1f} MB | {kb / 1e6:.2f} MB | {limit:.1f} | {got:.1f} | {got / limit:.0%} |")
    if not args.no_rss:
        print("\nKernel RSS after start (symphony-kernel --kv-memory-mb %d):" % args.kv_mb)
        target = 1.5 * (os.path.getsize(path) + kv_bytes)
        for mode in ("quantized", "float"):
            rss = kernel_rss(args.model, mode, args.kv_mb)
            if rss is None:
                print(f"  --weights {mode}: the kernel did not start")
                continue
            print(f"  --weights {mode}: {rss / 2**20:.0f} MiB (target 1.5 x (GGUF + KV pool) = "
                  f"{target / 2**20:.0f} MiB: {rss / target:.2f} of it)")
    if args.server_names:
        if args.model:
            print("\n# decode through the servers: skipped (--model: the peers serve the embedded model)")
        else:
            bench_servers(args)


# ---------------------------------------------------------------- batched decode through the servers
SERVER_TOPICS = ("a lighthouse keeper", "a clockmaker", "a desert caravan", "a submarine cook", "a glacier",
                 "a tea merchant", "a lost kite", "a mountain railway", "an old violin", "a night market",
                 "a beekeeper", "a comet", "a ferry captain", "a paper mill", "a snow owl", "a river delta")


async def _decode_requests(url: str, model: str, n: int, steps: int, tag: str) -> list[tuple[list[float], int]]:
    """``n`` concurrent streamed greedy requests: per request, its content chunks' arrival times
    and its completion tokens (usage)."""
    import httpx
    import sse

    async def one(client, i):
        body = {"model": model, "temperature": 0, "max_tokens": steps, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"({tag}.{i}) Write a long story about "
                              f"{SERVER_TOPICS[i % len(SERVER_TOPICS)]} number {i}."}]}
        times, tokens = [], None
        async for ev in sse.chat_events(client, url, body):   # an error event stops the run, saying why
            if ev.get("usage"):
                tokens = ev["usage"].get("completion_tokens")
            if sse.content(ev):
                times.append(time.perf_counter())
        return times, tokens if tokens is not None else len(times)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        return await asyncio.gather(*(one(client, i) for i in range(n)))


def decode_rate(reqs: list[tuple[list[float], int]]) -> float:
    """Tokens/s while every request decodes: from the last first chunk to the first last chunk,
    each chunk weighted by its request's tokens a chunk (a server may send several tokens in a
    chunk). NaN when no such window exists (a request ended before another began)."""
    start = max(t[0] for t, _ in reqs if t)
    end = min(t[-1] for t, _ in reqs if t)
    if end <= start or any(len(t) < 2 for t, _ in reqs):
        return float("nan")
    tokens = 0.0
    for t, n in reqs:
        per_chunk = n / len(t)
        tokens += per_chunk * sum(1 for x in t if start < x <= end)
    return tokens / (end - start)


def bench_servers(args) -> dict:
    """Batched decode through Symphony's gateway and the peers' servers, interleaved rounds:
    {"rounds": {server: {batch: [figures per round]}}, "servers": {server: what it is}}."""
    import json
    import tempfile
    from pathlib import Path
    from bench_gateway import Symphony, _git_commit, symphony_contender, peer_contender, write_json
    names, batches = args.server_names, args.batches
    print(f"\n# batched decode through the servers: batches {batches}, {args.steps} tokens a request, "
          f"{args.rounds} interleaved rounds; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"peers from the {peers._where()}", flush=True)
    out = {"machine": {"cpu": cpu_description()[0], "cores": os.cpu_count(), "load_before": os.getloadavg(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": _git_commit()},
           "steps": args.steps, "batches": batches, "skipped": {}, "servers": {}, "rounds": {}}
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp, contextlib.ExitStack() as stack:
        os.chmod(tmp, 0o755)                    # a root kernel's gateway runs as another uid
        cs = []
        for name in names:
            if name == "symphony":
                sym = Symphony(Path(tmp) / "symphony", kv_memory_mb=args.kv_mb * 4, nocache=False)
                stack.callback(sym.stop)
                cs.append(symphony_contender("symphony", sym))
                continue
            print(f"# starting {name} (slots {max(batches)}) ...", flush=True)
            try:
                p = stack.enter_context(peers.peer(name, slots=max(batches), threads=args.threads or None,
                                                   ctx_per_slot=1024, log_dir=Path(tmp) / "logs"))
            except peers.Unavailable as e:
                print(f"# {name}: skipped: {e}", flush=True)
                out["skipped"][name] = str(e)
                continue
            p.pause()
            cs.append(peer_contender(p))
        for c in cs:
            out["servers"][c.name] = c.info
            print(f"# {c.name}: {c.info.get('version')}; weights: {c.info.get('weights')}; started in "
                  f"{c.info.get('startup_s') or 0:.0f} s; command: "
                  f"{' '.join(f'{k}={v}' for k, v in (c.info.get('env') or {}).items())} "
                  f"{' '.join(c.info.get('argv', []))}".replace(":  ", ": "), flush=True)
        if not cs:
            print("# batched decode through the servers: no server to measure", flush=True)
            return out
        res = {(c.name, b): [] for c in cs for b in batches}
        for c in cs:                                                  # warm-up
            c.resume()
            asyncio.run(_decode_requests(c.url, c.model, 2, 4, "warm"))
            c.pause()
        for r in range(args.rounds):
            for c in cs[r % len(cs):] + cs[:r % len(cs)]:
                c.resume()
                try:
                    for b in batches:
                        load = peers.BoxLoad({c.name: c.pids()})
                        reqs = asyncio.run(_decode_requests(c.url, c.model, b, args.steps, f"r{r}b{b}"))
                        used = load.stop()
                        res[(c.name, b)].append({"tok_s": decode_rate(reqs), "tokens": sum(n for _, n in reqs),
                                                 "server_cores": used[f"{c.name}_cores"],
                                                 "others_cores": used["others_cores"]})
                finally:
                    c.pause()
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} b{b} {v[-1]['tok_s']:.1f}" for (n, b), v in res.items()), flush=True)
        out["machine"]["load_after"] = os.getloadavg()
        print(f"# load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
        print("\n| server | " + " | ".join(f"batch-{b} decode tok/s" for b in batches) +
              " | its cores | others' cores |")
        print("|---|" + "---|" * (len(batches) + 2))
        for c in cs:
            rows = [x for b in batches for x in res[(c.name, b)]]
            print(f"| {c.name} | " + " | ".join(spread([x["tok_s"] for x in res[(c.name, b)] if x["tok_s"] == x["tok_s"]]
                                                       or [float("nan")]) for b in batches) +
                  f" | {spread([x['server_cores'] for x in rows])} | {spread([x['others_cores'] for x in rows])} |")
        for o in (c for c in cs if c.peer is None):
            for c in (c for c in cs if c.peer is not None):
                for b in batches:
                    per = [x["tok_s"] / y["tok_s"] for x, y in zip(res[(o.name, b)], res[(c.name, b)])
                           if x["tok_s"] == x["tok_s"] and y["tok_s"] == y["tok_s"] and y["tok_s"] > 0]
                    if per:
                        print(f"  {o.name} / {c.name}, batch-{b}: {statistics.median(per):.2f}x "
                              f"({min(per):.2f}..{max(per):.2f})")
        out["rounds"] = {c.name: {str(b): res[(c.name, b)] for b in batches} for c in cs}
    if args.json:
        write_json(args.json, json.loads(json.dumps(out, default=str)))
    return out


if __name__ == "__main__":
    main()
