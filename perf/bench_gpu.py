"""Serving benchmark for a GPU: Symphony vs Hugging Face transformers, one model, one run.

    python perf/bench_gpu.py                     # GPU: 1B Llama-shaped model, bfloat16
    python perf/bench_gpu.py --shape smollm      # (the CPU default: SmolLM2-135M shape, float32)
    python perf/bench_gpu.py --shape tiny --rounds 1 --steps 8    # a quick check
    python perf/bench_gpu.py --json results.json

The model is built ONCE as a Hugging Face ``LlamaForCausalLM`` with random
weights (normal, std ``--init-std``) in the bench dtype from a ``LlamaConfig``
(default shape: Llama-3.2-1B) and saved with ``save_pretrained`` (safetensors)
into a temporary directory.  Symphony loads that directory with its own loader
(``symphony.engine.loader.load_model``); transformers runs the model object it
built.  Both systems thus run the very same weights, each through its real
loading path.  One thing is added to the directory for our loader: a 3-token
stub ``tokenizer.json`` (load_model requires one; the bench feeds token ids).
``config.json`` is loaded as transformers wrote it (RoPE in ``rope_parameters``
for transformers 5, ``rope_theta`` / ``rope_scaling`` before).

Defaults: on CUDA the 1b shape in bfloat16, batches 1, 16, 64, 128 decode
steps, a 2,000-token TTFT prompt, 5 rounds (sized for a few minutes on an
H100/H200, the C++/CUDA op build included; not yet run on one); on the CPU the smollm shape in float32,
batches 1, 4, 16, 32 steps, a 512-token TTFT prompt.

Measured in interleaved rounds (A B C A B C ...), medians reported:
  * correctness first: logits of each Symphony engine vs the HF forward in
    float32 (two sequences prefilled in one batch, then 4 decode steps
    together): max |diff|, and max and rms |diff| relative to the logit std.
    In bfloat16/float16 the HF model's own error against float32 is printed
    as the noise floor.  The run stops when Symphony is way off (float32: max
    |diff| / std > 1e-3; half: > 1, or rms error > 5x the HF half-precision
    one) and warns above 2x;
  * decode tokens/s at each ``--batches`` size.  Symphony: B sequences, each
    prefilled with a ``--decode-prompt``-token prompt (untimed), then
    ``--steps`` timed ``pred_batch`` decode steps, greedy next tokens taken on
    the device (one argmax over the stacked [B, vocab] logits, B ints back to
    the host per step).  Symphony runs with CUDA graphs (EngineConfig default
    on CUDA) and with ``cuda_graphs=False``.  HF: ``model.generate(input_ids
    [B, prompt], max_new_tokens=N, min_new_tokens=N, do_sample=False)``; its
    decode rate is B*(N-1) / (T(generate N) - T(generate 1)), i.e. prefill
    and the first token are timed separately and subtracted;
  * memory-bandwidth utilisation (MBU) of a batch-1 decode step: the bytes a
    step must read (the token's embedding row, every layer's matrices and
    norms, the final norm, the lm_head, and the K/V of the context at the
    step's average position), all in the bench dtype, divided by the median
    step time, as a fraction of (a) the device's peak (H100 SXM 3.35e12 B/s,
    H200 4.8e12 B/s; ``--peak-bw`` to give another) and (b) the copy bandwidth
    measured in this run (a large device-to-device ``copy_``, bytes read +
    written);
  * time to first token for a ``--prompt-len``-token prompt: Symphony, one
    pred of the whole prompt on a fresh sequence + argmax; HF,
    ``generate(max_new_tokens=1)``;
  * a prompt into a non-empty file (Symphony only): the same ``--prompt-len`` tokens
    appended to a file already holding ``--prompt-len`` (the paged attention path, where a
    prompt into an empty file takes SDPA), one pred + argmax.

Decode steps ask for the greedy token (``Want("argmax")``: on CUDA graphs the argmax and
the token copy are part of the graph); ``--decode-want logits`` takes the logits of every
call instead and the argmax over the stacked [B, vocab] rows, as earlier runs did.
``--previous-kernels`` adds the same engine without the tiled attention and the tensor-core
GEMV (``SYMPHONY_CUDA_KERNELS=auto,-attention,-gemv_tc``), for a before/after in one run.

transformers is a benchmark-only dependency (never needed by the package or
its tests): ``pip install transformers``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from symphony.engine import ops                                  # noqa: E402
from symphony.engine.config import EngineConfig                  # noqa: E402
from symphony.engine.engine import Engine, PredRequest           # noqa: E402
from symphony.engine.runner import Want                          # noqa: E402
from symphony.engine.loader import load_model                    # noqa: E402

SHAPES = {
    # Llama-3.2-1B (1.24B parameters; llama3 RoPE scaling as in its config.json)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
               rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # SmolLM2-135M (135M parameters)
    "smollm": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                   rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192),
    # a few MB, untied lm_head: a quick end-to-end check
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                 rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=4096),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peak_bandwidth(name: str):
    """Peak memory bandwidth in bytes/s from torch.cuda.get_device_name; None if unknown."""
    n = name.upper()
    if "H200" in n:
        return 4.8e12
    if "H100" in n:
        if "PCIE" in n:
            return 2.0e12
        if "NVL" in n:
            return 3.9e12
        return 3.35e12          # H100 SXM5 80GB HBM3
    return None


T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- model

def import_transformers():
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        sys.exit("perf/bench_gpu.py needs Hugging Face transformers, which builds the model and is "
                 f"the baseline ({e}).\nInstall it for benchmarks only: pip install transformers "
                 "(it is not a dependency of symphony or of its tests).")
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    return transformers, LlamaConfig, LlamaForCausalLM


def build_hf_model(args, device, dtype):
    transformers, LlamaConfig, LlamaForCausalLM = import_transformers()
    shape = dict(SHAPES[args.shape])
    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, initializer_range=args.init_std,
                      attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0, use_cache=True)
    torch.manual_seed(args.seed)
    # Built in the bench dtype (random init on the device: fast for 1B parameters).
    # Not LlamaForCausalLM(cfg).to(dtype): .to() would also round the RoPE
    # inv_freq buffer to bf16, which from_pretrained(dtype=...) models keep in float32.
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    return transformers, model, n


def write_stub_tokenizer(model_dir: Path) -> None:
    """load_model() reads tokenizer.json from a HF directory; the bench feeds
    token ids, so a 3-token word-level tokenizer satisfies it."""
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.save(str(model_dir / "tokenizer.json"))


def engine_config(args, device, dtype, graphs):
    kw = dict(device=str(device), dtype=dtype, page_size=16,
              kv_memory_bytes=int(args.kv_memory_gib * 2**30),
              max_batch_tokens=max(8192, args.prompt_len, max(args.batches) * args.decode_prompt,
                                   2 * (args.check_len + 8)))
    if graphs is not None:
        if "cuda_graphs" not in {f.name for f in dataclasses.fields(EngineConfig)}:
            return None
        kw["cuda_graphs"] = graphs
    return EngineConfig(**kw)


# --------------------------------------------------------------------------- helpers

def make_sync(device):
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def rel_err(a, b):
    d = (a.float() - b.float()).abs().max().item()
    return d, d / b.float().std().item()


@torch.inference_mode()
def sym_check_run(eng, prompts):
    """Two sequences prefilled in one pred_batch (all logits), then 4 greedy decode
    steps together.  Returns the token rows [2, n + 4] and Symphony's logits for
    them [2, n + 4, vocab] (row j: the logits after token j)."""
    seqs = [eng.new_sequence() for _ in prompts]
    try:
        outs = eng.pred_batch([PredRequest(s, p, all_logits=True) for s, p in zip(seqs, prompts)])
        logits = [torch.stack(outs)]                                # [2, n, vocab]
        nxt = logits[0][:, -1].argmax(-1).tolist()
        toks = [list(p) for p in prompts]
        for _ in range(4):
            for t, n in zip(toks, nxt):
                t.append(n)
            outs = eng.pred_batch([PredRequest(s, [n]) for s, n in zip(seqs, nxt)])
            logits.append(torch.stack(outs)[:, None])               # [2, 1, vocab]
            nxt = logits[-1][:, 0].argmax(-1).tolist()
    finally:
        for s in seqs:
            eng.release(s)
    return toks, torch.cat(logits, 1).float()


@torch.inference_mode()
def hf_logits(model, toks, device):
    return model(input_ids=torch.tensor(toks, device=device)).logits.float()


def compare(x, ref, n_prompt):
    """max |diff| of the prefill and decode rows, and relative to the std of ref."""
    std = ref.std().item()
    d = (x - ref).abs()
    pre, dec = d[:, :n_prompt].max().item(), d[:, n_prompt:].max().item()
    return dict(prefill_max_abs=pre, decode_max_abs=dec, prefill_rel=pre / std, decode_rel=dec / std,
                max_rel=max(pre, dec) / std, rms_rel=d.pow(2).mean().sqrt().item() / std,
                argmax_agree=(x.argmax(-1) == ref.argmax(-1)).float().mean().item(), logit_std=std)


DECODE_WANT = "argmax"           # --decode-want


def decode_step(eng, seqs, nxt):
    """One greedy decode step of every sequence; the next tokens (B ints on the host)."""
    if DECODE_WANT == "argmax":     # the greedy token of each call (in the CUDA graph: argmax + copy)
        outs = eng.pred_batch([PredRequest(s, [t], want=Want("argmax")) for s, t in zip(seqs, nxt)])
        return [int(o) for o in outs] if outs[0].device.type == "cpu" else torch.stack(outs).tolist()
    outs = eng.pred_batch([PredRequest(s, [t]) for s, t in zip(seqs, nxt)])
    return torch.stack(outs).argmax(-1).tolist()   # greedy on the device; B ints to the host


def sym_decode(eng, prompts, steps, sync, step_times=None):
    """B = len(prompts) sequences, prefilled together (untimed), then `steps`
    timed decode steps; returns tokens/s."""
    seqs = [eng.new_sequence() for _ in prompts]
    try:
        outs = eng.pred_batch([PredRequest(s, p) for s, p in zip(seqs, prompts)])
        nxt = torch.stack(outs).argmax(-1).tolist()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            ts = time.perf_counter()
            nxt = decode_step(eng, seqs, nxt)
            if step_times is not None:
                step_times.append(time.perf_counter() - ts)
        sync()
        dt = time.perf_counter() - t0
    finally:
        for s in seqs:
            eng.release(s)
    return len(prompts) * steps / dt


def _dev_time(e) -> float:
    """An event's self time on the device, microseconds (the name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(e, name):
            return float(getattr(e, name))
    return 0.0


@torch.inference_mode()
def profile_decode(label, eng, prompts, steps, sync):
    """Where one decode step's time goes: ``steps`` steps of len(prompts) sequences, timed
    plainly first, then under torch.profiler; prints the wall time a step, the device's
    busy time a step (the sum of every kernel's self time) and the top operators."""
    from torch.profiler import ProfilerActivity, profile
    seqs = [eng.new_sequence() for _ in prompts]
    try:
        outs = eng.pred_batch([PredRequest(s, p) for s, p in zip(seqs, prompts)])
        nxt = torch.stack(outs).argmax(-1).tolist()

        def step():
            nonlocal nxt
            nxt = decode_step(eng, seqs, nxt)
        for _ in range(3):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / steps
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                step()
            sync()
    finally:
        for s in seqs:
            eng.release(s)
    ev = prof.key_averages()
    kernels = [e for e in ev if _dev_time(e) > 0 and e.key and not e.key.startswith("aten::")
               and not e.key.startswith("symphony::")]
    dev = sum(_dev_time(e) for e in kernels) / steps / 1e3
    print(f"\n### profile: {label}, batch {len(prompts)}, {steps} decode steps", flush=True)
    print(f"  wall {wall * 1e3:.3f} ms a step (unprofiled); device busy {dev:.3f} ms a step "
          f"({dev / (wall * 1e3) * 100:.0f}% of the wall); the rest is host work and launch gaps", flush=True)
    top = sorted(kernels, key=_dev_time, reverse=True)[:12]
    for e in top:
        print(f"  {_dev_time(e) / steps / 1e3:8.3f} ms/step  {e.count // steps:4d}x  {e.key[:110]}", flush=True)
    cpu = sorted((e for e in ev if e.key.startswith(("aten::", "symphony::"))),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    print("  host (self CPU time a step, profiled):", flush=True)
    for e in cpu:
        print(f"  {e.self_cpu_time_total / steps / 1e3:8.3f} ms/step  {e.count // steps:4d}x  {e.key[:110]}",
              flush=True)


def sym_ttft(eng, prompt, sync):
    seq = eng.new_sequence()
    try:
        sync()
        t0 = time.perf_counter()
        logits = eng.pred(seq, prompt)
        int(logits.argmax())
        sync()
        return time.perf_counter() - t0
    finally:
        eng.release(seq)


def sym_prefill_nonempty(eng, prompt, sync):
    """Seconds for ``prompt`` appended to a file already holding it (untimed first)."""
    seq = eng.new_sequence()
    try:
        eng.pred(seq, prompt)
        sync()
        t0 = time.perf_counter()
        int(eng.pred(seq, prompt).argmax())
        sync()
        return time.perf_counter() - t0
    finally:
        eng.release(seq)


def hf_generate(model, ids, new, sync):
    """Seconds for generate(max_new_tokens=new); checks `new` tokens came out."""
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    sync()
    dt = time.perf_counter() - t0
    if out.shape != (ids.shape[0], ids.shape[1] + new):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected "
                           f"{(ids.shape[0], ids.shape[1] + new)}")
    return dt


def hf_decode(model, ids, steps, sync):
    """(tokens/s of the decode part, seconds per decode step): T(N) - T(1);
    (None, None) when noise makes T(N) <= T(1)."""
    t1 = hf_generate(model, ids, 1, sync)
    tn = hf_generate(model, ids, steps, sync)
    if tn <= t1:
        return None, None
    return ids.shape[0] * (steps - 1) / (tn - t1), (tn - t1) / (steps - 1)


def copy_bandwidth(device, nbytes, sync, reps=10):
    """Bytes/s of dst.copy_(src), counting bytes read + written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def step_bytes(cfg: dict, elem: int, ctx: float) -> dict:
    """Bytes a batch-1 decode step must read, in the bench dtype."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd, nh, nkv, V = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    layer = (h * (nh + 2 * nkv) * hd          # q, k, v
             + nh * hd * h                    # o
             + 3 * h * i                      # gate, up, down
             + 2 * h)                         # two norms
    weights = (h                              # the token's embedding row
               + L * layer + h                # layers, final norm
               + V * h) * elem                # lm_head (tied or not, read whole)
    kv = 2 * L * ctx * nkv * hd * elem
    return dict(weights=weights, kv=kv, total=weights + kv)


def machine_name(device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{torch.cuda.get_device_name(device)} ({p.total_memory / 2**30:.0f} GiB)"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"


def med(xs):
    return statistics.median(xs) if xs else None


def div(a, b):
    return None if a is None or not b else a / b


def fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


# --------------------------------------------------------------------------- main

def parse_args():
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="model shape (default: 1b on CUDA, smollm on the CPU)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default: 1,16,64 on CUDA, 1,4,16 on the CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default: 128 on CUDA, 32 on the CPU)")
    ap.add_argument("--decode-prompt", type=int, default=32, help="prompt tokens per sequence before decoding")
    ap.add_argument("--prompt-len", type=int, default=None, help="TTFT prompt tokens (default: 2000 on CUDA, 512 on the CPU)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 5)")
    ap.add_argument("--check-len", type=int, default=64, help="prompt tokens of the logits check")
    ap.add_argument("--check-only", action="store_true", help="stop after the logits check")
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-memory-gib", type=float, default=None, help="Symphony KV pool per engine (default: 4 on CUDA, 0.5 on the CPU)")
    ap.add_argument("--peak-bw", type=float, default=None, help="device peak memory bandwidth in GB/s (default: by device name)")
    ap.add_argument("--no-eager", action="store_true", help="CUDA: skip the cuda_graphs=False engine")
    ap.add_argument("--both-modes", action="store_true",
                    help="CPU: also run cuda_graphs=True (the static padded decode path, eagerly) vs False")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF timings (the model is still built with transformers)")
    ap.add_argument("--model-dir", default=None, help="save the model here (kept) instead of a temporary directory")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after the timings, profile STEPS decode steps at batch 16 of each engine "
                         "(torch.profiler, CPU + CUDA) and print where the time goes")
    ap.add_argument("--profile-batches", default="16", help="batch sizes --profile profiles (default 16)")
    ap.add_argument("--torch-kernels", action="store_true",
                    help="CUDA: also time the engine with torch's kernels only (SYMPHONY_CUDA_KERNELS=off), "
                         "against ours (symphony/engine/cuda_kernels.py) in the same run")
    ap.add_argument("--previous-kernels", action="store_true",
                    help="CUDA: also time the engine without the tiled attention and the tensor-core GEMV "
                         "(SYMPHONY_CUDA_KERNELS=auto,-attention,-gemv_tc): the kernels before them")
    ap.add_argument("--decode-want", choices=["argmax", "logits"], default="argmax",
                    help="what a decode step asks for: each call's greedy token (default) or its logits")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args()
    gpu = torch.device(args.device).type == "cuda"
    args.shape = args.shape or ("1b" if gpu else "smollm")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.batches = [int(b) for b in (args.batches or ("1,16,64" if gpu else "1,4,16")).split(",")]
    args.steps = args.steps or (128 if gpu else 32)
    args.prompt_len = args.prompt_len or (2000 if gpu else 512)
    args.rounds = args.rounds or 5
    args.kv_memory_gib = args.kv_memory_gib or (4.0 if gpu else 0.5)
    global DECODE_WANT
    DECODE_WANT = args.decode_want
    if args.steps < 2:
        ap.error("--steps must be >= 2")
    return args


def main():
    args = parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda asked for, but torch sees no CUDA device")
    sync = make_sync(device)
    gen = torch.Generator().manual_seed(args.seed + 1)

    say(f"building a random {args.shape} Llama ({args.dtype}, std {args.init_std}) with transformers "
        f"on {device}...")
    transformers, model, n_params = build_hf_model(args, device, dtype)
    hf_cfg = model.config.to_dict()
    shape_cfg = {k: hf_cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "head_dim",
                                        "vocab_size")}
    say(f"{n_params / 1e6:.1f}M parameters; transformers {transformers.__version__}, "
        f"attention {getattr(model.config, '_attn_implementation', '?')}, torch {torch.__version__}")
    tmp = None
    if args.model_dir:
        model_dir = Path(args.model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="symphony-bench-gpu-")
        model_dir = Path(tmp.name)
    say(f"save_pretrained -> {model_dir}")
    model.save_pretrained(str(model_dir), safe_serialization=True)
    write_stub_tokenizer(model_dir)

    say("symphony: load_model (HF safetensors directory)...")
    weights, tok = load_model(model_dir, progress=False)
    if tmp is not None:
        tmp.cleanup()
    mc = weights.config
    say(f"symphony: loaded {weights.num_parameters() / 1e6:.1f}M parameters; rope_theta {mc.rope_theta}, "
        f"rope scaling {mc.rope_scaling.kind}, tied {mc.tie_embeddings}")
    # Symphony engines: the EngineConfig default (CUDA graphs on for CUDA) and
    # cuda_graphs=False; on the CPU the default only, unless --both-modes (there
    # cuda_graphs=True runs the static padded decode path eagerly).
    has_graphs = "cuda_graphs" in {f.name for f in dataclasses.fields(EngineConfig)}
    modes = [None]
    if has_graphs and (device.type == "cuda" and not args.no_eager or args.both_modes):
        modes = [None if device.type == "cuda" else True, False]
    elif not has_graphs and device.type == "cuda":
        say("EngineConfig has no cuda_graphs field: one Symphony engine (the default) only")
    variants = []                                   # (label, EngineConfig)
    for m in modes:
        cfg = engine_config(args, device, dtype, m)
        on = getattr(cfg, "use_graphs", None)
        label = "symphony" if on is None or len(modes) == 1 and device.type != "cuda" else \
            f"symphony, cuda_graphs {'on' if on else 'off'}"
        variants.append((label, cfg, None))
    if device.type == "cuda" and args.torch_kernels:
        # the same engine with torch's kernels only (SYMPHONY_CUDA_KERNELS=off): what ours gain
        variants.append(("symphony, torch's kernels", engine_config(args, device, dtype, None), "off"))
    if device.type == "cuda" and args.previous_kernels:
        variants.append(("symphony, previous kernels", engine_config(args, device, dtype, None),
                         "auto,-attention,-gemv_tc"))
    say("symphony: loading the C++/CUDA ops (the first use on a machine builds them: a minute or "
        "more with CUDA)...")
    ops.load()
    say(f"symphony: ops ready (CUDA kernels: {ops.cuda_available()})")
    if device.type == "cuda" and not ops.cuda_available():
        sys.exit("symphony's CUDA kernels are not built (no CUDA toolkit found, or the build failed: "
                 "see above), so the engine cannot run on the GPU")
    engines = []
    for label, cfg, kernels in variants:
        capture = device.type == "cuda" and getattr(cfg, "use_graphs", False)
        say(f"{label}: building the engine on {device}/{dtype}"
            + (" (captures its decode CUDA graphs)..." if capture else "..."))
        saved = os.environ.get("SYMPHONY_CUDA_KERNELS")
        if kernels is not None:
            os.environ["SYMPHONY_CUDA_KERNELS"] = kernels
        try:
            eng = Engine(weights, tok, cfg)
        finally:
            if kernels is not None:
                if saved is None:
                    os.environ.pop("SYMPHONY_CUDA_KERNELS", None)
                else:
                    os.environ["SYMPHONY_CUDA_KERNELS"] = saved
        for line in getattr(getattr(eng.model, "kernels", None), "summary", lambda: [])():
            print(f"    {label}: {line}", flush=True)
        engines.append((label, eng))
    del weights

    # ---------------------------------------------------------------- correctness
    # The reference is transformers in float32.  In half precision the HF model's
    # own error against it (same weights, bf16/fp16) is the yardstick for ours.
    check_prompts = [torch.randint(3, shape_cfg["vocab_size"], (args.check_len,), generator=gen).tolist()
                     for _ in range(2)]
    half = dtype != torch.float32
    ref_model = copy.deepcopy(model).float() if half else model
    checks = {}
    failed = []
    for label, eng in engines:
        say(f"{label}: logits vs transformers ({args.check_len}-token prompts x 2 in one batch, "
            "then 4 decode steps)...")
        toks, sym = sym_check_run(eng, check_prompts)
        ref = hf_logits(ref_model, toks, device)
        c = compare(sym, ref, args.check_len)
        print(f"    {label} vs HF float32: prefill max|diff| {c['prefill_max_abs']:.3g} "
              f"({c['prefill_rel']:.2e} of the logit std {c['logit_std']:.3g}), decode max|diff| "
              f"{c['decode_max_abs']:.3g} ({c['decode_rel']:.2e}); rms {c['rms_rel']:.2e}; "
              f"argmax agreement {c['argmax_agree'] * 100:.0f}%", flush=True)
        if half:
            h = compare(hf_logits(model, toks, device), ref, args.check_len)
            c["hf_half"] = h
            print(f"    HF {args.dtype} vs HF float32 (the {args.dtype} noise floor): max |diff| / std "
                  f"{h['max_rel']:.2e}, rms {h['rms_rel']:.2e}; argmax agreement "
                  f"{h['argmax_agree'] * 100:.0f}%", flush=True)
            if c["max_rel"] > 1.0 or c["rms_rel"] > 5 * h["rms_rel"]:
                failed.append(f"{label}: max |diff| / std {c['max_rel']:.3g} (limit 1), rms "
                              f"{c['rms_rel']:.3g} vs HF's own {args.dtype} rms {h['rms_rel']:.3g} "
                              "(limit 5x)")
            elif c["rms_rel"] > 2 * h["rms_rel"]:
                print(f"    WARNING: {label}'s {args.dtype} error is over twice transformers' own",
                      flush=True)
        elif c["max_rel"] > 1e-3:
            failed.append(f"{label}: max |diff| / std {c['max_rel']:.3g} > 1e-3 in float32")
        checks[label] = c
    if half:
        del ref_model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        sys.exit("FAILED: logits disagree with transformers; the timings would be meaningless:\n  "
                 + "\n  ".join(failed))
    if args.check_only:
        say("--check-only: done")
        return

    # ---------------------------------------------------------------- timings
    P, N = args.decode_prompt, args.steps
    maxb = max(args.batches)
    dec_prompts = torch.randint(3, shape_cfg["vocab_size"], (maxb, P), generator=gen)
    ttft_prompt = torch.randint(3, shape_cfg["vocab_size"], (args.prompt_len,), generator=gen)
    dec_ids = dec_prompts.to(device)
    ttft_ids = ttft_prompt[None].to(device)
    dec_lists = dec_prompts.tolist()
    ttft_list = ttft_prompt.tolist()
    names = [l for l, _ in engines] + ([] if args.no_hf else ["hf"])
    res = {n: {"tok_s": {b: [] for b in args.batches}, "ttft": [], "step": [], "prefill2": []} for n in names}

    say("measuring the device copy bandwidth...")
    copy_bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20), sync)
    say(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")

    say("warm-up" + (" (CUDA graph capture)" if device.type == "cuda" else "") + "...")
    with torch.inference_mode():
        for label, eng in engines:
            for b in args.batches:
                sym_decode(eng, dec_lists[:b], 2, sync)
            sym_ttft(eng, ttft_list[:64], sync)
            sym_prefill_nonempty(eng, ttft_list[:64], sync)
        if not args.no_hf:
            for b in args.batches:
                hf_decode(model, dec_ids[:b], 3, sync)
            hf_generate(model, ttft_ids[:, :64], 1, sync)

    say(f"{args.rounds} interleaved rounds: decode {N} steps after {P}-token prompts at batch "
        f"{', '.join(map(str, args.batches))}; TTFT of {args.prompt_len} tokens")
    with torch.inference_mode():
        for r in range(args.rounds):
            for label, eng in engines:
                for b in args.batches:
                    steps = res[label]["step"] if b == 1 else None
                    res[label]["tok_s"][b].append(sym_decode(eng, dec_lists[:b], N, sync, steps))
                res[label]["ttft"].append(sym_ttft(eng, ttft_list, sync))
                res[label]["prefill2"].append(sym_prefill_nonempty(eng, ttft_list, sync))
            if not args.no_hf:
                for b in args.batches:
                    rate, step = hf_decode(model, dec_ids[:b], N, sync)
                    if rate is None:
                        print(f"  (HF batch-{b}: T(generate {N}) <= T(generate 1), sample dropped)")
                        continue
                    res["hf"]["tok_s"][b].append(rate)
                    if b == 1:
                        res["hf"]["step"].append(step)
                res["hf"]["ttft"].append(hf_generate(model, ttft_ids, 1, sync))
            say(f"round {r + 1}/{args.rounds}: " + "; ".join(
                f"{n}: " + ", ".join(
                    f"b{b} {fmt(res[n]['tok_s'][b][-1] if res[n]['tok_s'][b] else None)}"
                    for b in args.batches)
                + f", ttft {res[n]['ttft'][-1] * 1e3:.0f} ms" for n in names))

    # ---------------------------------------------------------------- report
    elem = torch.tensor([], dtype=dtype).element_size()
    ctx = P + (N + 1) / 2                                 # average context of a timed step
    sb = step_bytes(shape_cfg, elem, ctx)
    peak = args.peak_bw * 1e9 if args.peak_bw else (
        peak_bandwidth(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    out = {}
    for n in names:
        d = res[n]
        step = med(d["step"])
        bw = sb["total"] / step if step else None
        out[n] = dict(tok_s={b: med(v) for b, v in d["tok_s"].items()}, ttft_ms=med(d["ttft"]) * 1e3,
                      prefill_nonempty_ms=med(d["prefill2"]) * 1e3 if d["prefill2"] else None,
                      b1_step_ms=step * 1e3 if step else None, b1_bytes_per_s=bw,
                      mbu_peak=bw / peak if bw and peak else None, mbu_copy=bw / copy_bw if bw else None)

    label_of = {n: ("HF transformers generate" if n == "hf" else n) for n in names}
    dev_name = machine_name(device)
    ratios = {}
    if not args.no_hf:
        for n, _ in engines:
            r = {f"batch_{b}": div(out[n]["tok_s"][b], out["hf"]["tok_s"][b]) for b in args.batches}
            r["ttft_speedup"] = out["hf"]["ttft_ms"] / out[n]["ttft_ms"]
            ratios[n] = r
    pct = lambda x: "-" if x is None else f"{x * 100:.1f}%"
    lines = [
        f"## Serving vs transformers on {dev_name.split(' (')[0]} "
        f"(`python perf/bench_gpu.py {' '.join(sys.argv[1:])}`)".replace(" (``)", ""),
        "",
        f"Machine: {dev_name}; torch {torch.__version__}, transformers {transformers.__version__} "
        f"(attention {getattr(model.config, '_attn_implementation', '?')}). Model: random {args.shape} "
        f"Llama shape, {n_params / 1e6:.0f}M parameters, {args.dtype}, built with transformers, "
        f"saved as safetensors and loaded by our loader. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        f"Decode: {P}-token prompts, then {N} greedy steps (HF: B*(N-1) tokens / (T(generate N) - "
        f"T(generate 1))). TTFT: one {args.prompt_len}-token prompt. Medians of {args.rounds} "
        "interleaved rounds.",
        "",
        "| contender | " + " | ".join(f"batch-{b} tok/s" for b in args.batches)
        + f" | TTFT {args.prompt_len} ms | {args.prompt_len} into a file of {args.prompt_len} ms"
        " | batch-1 step ms | MBU vs peak | MBU vs copy |",
        "|---|" + "---|" * (len(args.batches) + 5),
    ]
    for n in names:
        o = out[n]
        lines.append(f"| {label_of[n]} | " + " | ".join(fmt(o["tok_s"][b]) for b in args.batches)
                     + f" | {fmt(o['ttft_ms'])} | {fmt(o.get('prefill_nonempty_ms'))} | "
                     f"{fmt(o['b1_step_ms'], '.2f')} | {pct(o['mbu_peak'])} | "
                     f"{pct(o['mbu_copy'])} |")
    lines.append("")
    for n, r in ratios.items():
        lines.append(f"* {n} / transformers: decode " + ", ".join(
            f"batch-{b} **{fmt(r[f'batch_{b}'], '.2f')}x**" for b in args.batches)
            + f"; TTFT **{r['ttft_speedup']:.2f}x** faster.")
    graph_modes = [n for n, e in engines if "kernels" not in n]
    if len(graph_modes) == 2:
        ng, ne = graph_modes
        lines.append("* cuda_graphs on / off: " + ", ".join(
            f"batch-{b} {fmt(div(out[ng]['tok_s'][b], out[ne]['tok_s'][b]), '.2f')}x"
            for b in args.batches) + ".")
    tk = [n for n, _ in engines if "torch's kernels" in n]
    if tk:
        lines.append(f"* our kernels / torch's kernels (same engine, graphs on): " + ", ".join(
            f"batch-{b} {fmt(div(out[engines[0][0]]['tok_s'][b], out[tk[0]]['tok_s'][b]), '.2f')}x"
            for b in args.batches) + f"; batch-1 step {fmt(out[engines[0][0]]['b1_step_ms'], '.3f')} ms vs "
            f"{fmt(out[tk[0]]['b1_step_ms'], '.3f')} ms.")
    pk = [n for n, _ in engines if "previous kernels" in n]
    if pk:
        a, b = out[engines[0][0]], out[pk[0]]
        lines.append(f"* new kernels / previous kernels (same engine, graphs on): " + ", ".join(
            f"batch-{x} {fmt(div(a['tok_s'][x], b['tok_s'][x]), '.2f')}x" for x in args.batches)
            + f"; batch-1 step {fmt(a['b1_step_ms'], '.3f')} ms vs {fmt(b['b1_step_ms'], '.3f')} ms; prompt into "
            f"a non-empty file {fmt(a.get('prefill_nonempty_ms'), '.2f')} ms vs {fmt(b.get('prefill_nonempty_ms'), '.2f')} ms.")
    first = engines[0][0]
    o = out[first]
    lines.append(
        f"* Batch-1 decode step: {sb['total'] / 1e6:.1f} MB to read ({sb['weights'] / 1e6:.1f} MB of "
        f"weights, {sb['kv'] / 1e6:.2f} MB of KV at context {ctx:.0f}); {first} moves "
        f"{o['b1_bytes_per_s'] / 1e9:.1f} GB/s: "
        + (f"**{pct(o['mbu_peak'])}** of the {peak / 1e9:.0f} GB/s peak (target >= 70%), "
           if o["mbu_peak"] is not None else "device peak unknown, ")
        + f"{pct(o['mbu_copy'])} of the {copy_bw / 1e9:.0f} GB/s copy bandwidth measured in the run.")
    lines.append("* Logits vs transformers float32 (max |diff| / logit std, prefill and decode rows): "
                 + "; ".join(f"{n} {c['prefill_rel']:.1e} / {c['decode_rel']:.1e}" for n, c in checks.items())
                 + (f"; transformers {args.dtype} itself {checks[first]['hf_half']['max_rel']:.1e}"
                    if half else "") + ".")
    print("\n----- for perf/RESULTS.md -----\n" + "\n".join(lines) + "\n-------------------------------",
          flush=True)

    if args.profile:
        for b in [int(x) for x in args.profile_batches.split(",") if x.strip()]:
            for label, eng in engines:
                profile_decode(label, eng, dec_lists[:min(b, maxb)], args.profile, sync)

    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            device=dev_name, shape=args.shape, shape_config=shape_cfg, parameters=n_params,
            dtype=args.dtype, torch=torch.__version__, transformers=transformers.__version__,
            args={k: v for k, v in vars(args).items()},
            copy_bandwidth=copy_bw, peak_bandwidth=peak, b1_step_bytes=sb, checks=checks,
            results=out, ratios=ratios, raw=res), indent=2, default=str))
        say(f"wrote {args.json}")


if __name__ == "__main__":
    main()
