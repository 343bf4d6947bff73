"""The scheduler under load, on the CPU with the real model.

    python perf/bench_sched.py [--lips 64] [--prefill-lips 8] [--steps 24]

Runs, through a real kernel, LIPs that decode concurrently: ``lips -
prefill_lips`` decoders (a short prompt, then ``steps`` greedy steps, each
step timed inside the LIP) and ``prefill_lips`` LIPs that keep sending
600-token prompts (mixed prefill and decode).  Reports:
  * aggregate decode tokens/s of the decoders vs the in-process engine running
    the same number of sequences as one batch (pred_batch), measured in the
    same run (target >= 0.85x);
  * per-LIP decode step latency p50 / p99;
  * fairness: Jain's index of the decoders' token rates (target >= 0.95);
  * the kernel's batch statistics (calls per forward pass).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

DECODER = '''
import time
from symphony.lip import kv, pred, recv, send, tokenize

def main(i, steps):
    with kv.create() as f:
        t = pred(f, tokenize(f"Story number {i}: once upon a time"), output="argmax")
        send("ready")
        recv()                                   # all decoders start together
        lat = []
        t0 = time.perf_counter()
        for _ in range(int(steps)):
            s = time.perf_counter()
            t = pred(f, [t], output="argmax")
            lat.append(time.perf_counter() - s)
        send({"kind": "decode", "wall": time.perf_counter() - t0, "lat": lat})
'''

PREFILLER = '''
import time
from symphony.lip import kv, pred, send

def main(i, seconds):
    end = time.time() + float(seconds)
    n = 0
    while time.time() < end:
        with kv.create() as f:
            pred(f, [(7 * k + int(i)) % 1000 + 100 for k in range(600)], output="argmax")
            n += 600
    send({"kind": "prefill", "tokens": n})
'''


def jain(xs):
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs else 0.0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_kernel_round(k, n_dec, n_pre, steps):
    from symphony.client import Client
    results, errors = [], []
    before = k.client().stats()

    barrier = threading.Barrier(n_dec)

    def one(source, args, name):
        try:
            with Client(k.socket) as c:
                # the KV each one needs, so that admission does not hold decoders back on the
                # default estimate while the others wait at the barrier for them
                need = 600 + 16 if source is PREFILLER else 16 + steps + 16
                lip = c.spawn(source, args, filename=name, kv_tokens=need)
                evs = []
                if source is DECODER:
                    ev = next(e for e in c.events(timeout=600) if e.get("event") != "started")
                    assert ev.get("data") == "ready", ev
                    barrier.wait(timeout=600)
                    c.send_input(lip, "go")
                evs += list(c.events(timeout=600))
            outs = [e["data"] for e in evs if e.get("event") == "out"]
            if evs[-1].get("status") != 0:
                errors.append((name, evs[-1], [e for e in evs if e.get("event") == "stderr"][:1]))
            results.extend(outs)
        except Exception as e:
            errors.append((name, repr(e)))
    threads = [threading.Thread(target=one, args=(DECODER, [str(i), str(steps)], f"dec{i}.py")) for i in range(n_dec)]
    threads += [threading.Thread(target=one, args=(PREFILLER, [str(i), "8"], f"pre{i}.py")) for i in range(n_pre)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = k.client().stats()
    dec = [r for r in results if isinstance(r, dict) and r.get("kind") == "decode"]
    pre = [r for r in results if isinstance(r, dict) and r.get("kind") == "prefill"]
    rates = [steps / r["wall"] for r in dec]
    lat = [x for r in dec for x in r["lat"]]
    span = max(r["wall"] for r in dec) if dec else float("nan")
    return {"agg": n_dec * steps / span, "rates": rates, "lat": lat, "errors": errors, "wall": wall,
            "prefill_tokens": sum(r["tokens"] for r in pre),
            "calls_per_pass": (after["batch_calls"] - before["batch_calls"]) / max(1, after["batches"] - before["batches"]),
            "ok": len(dec) + len(pre)}


def run_inprocess(n_dec, steps):
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine, PredRequest
    eng = Engine.load(config=EngineConfig(kv_memory_bytes=512 << 20), progress=False)
    tok = eng.tokenizer
    seqs = [eng.new_sequence() for _ in range(n_dec)]
    outs = eng.pred_batch([PredRequest(s, tok.encode(f"Story number {i}: once upon a time"))
                           for i, s in enumerate(seqs)])
    t0 = time.perf_counter()
    for _ in range(steps):
        outs = eng.pred_batch([PredRequest(s, [int(o.argmax())]) for s, o in zip(seqs, outs)])
    dt = time.perf_counter() - t0
    del eng
    return n_dec * steps / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lips", type=int, default=64)
    ap.add_argument("--prefill-lips", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    from conftest import KernelProc
    import torch
    n_dec = args.lips - args.prefill_lips
    print(f"# SmolLM2-135M, CPU, {torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"{n_dec} decoding LIPs + {args.prefill_lips} prefill LIPs, {args.steps} steps, {args.rounds} rounds",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-sched-"))
    rounds = []
    for r in range(args.rounds):
        (tmp / f"k{r}").mkdir()
        k = KernelProc(tmp / f"k{r}", "--max-lips", "256", "--max-lips-per-user", "256", "--kv-memory-mb", "512")
        try:
            dec_only = run_kernel_round(k, args.lips, 0, args.steps)          # A: 64 decoders
            mixed = run_kernel_round(k, n_dec, args.prefill_lips, args.steps)  # B: decoders + prefills
        finally:
            k.stop()
        base = run_inprocess(args.lips, args.steps)
        rounds.append({"agg": dec_only["agg"], "base": base, "lat": dec_only["lat"], "mixed": mixed,
                       "calls_per_pass": dec_only["calls_per_pass"]})
        print(f"  round {r + 1}: {args.lips} decoders {dec_only['agg']:.1f} tok/s vs in-process batch-{args.lips} "
              f"{base:.1f} tok/s; mixed: jain {jain(mixed['rates']):.3f}, {mixed['prefill_tokens']} prefill "
              f"tokens; errors {len(dec_only['errors']) + len(mixed['errors'])}", flush=True)
        for e in (dec_only["errors"] + mixed["errors"])[:3]:
            print("   error:", e)
    med = lambda key: statistics.median(x[key] for x in rounds)
    lat = [x for r in rounds for x in r["lat"]]
    mlat = [x for r in rounds for x in r["mixed"]["lat"]]
    print("\n| metric | value |\n|---|---|")
    print(f"| A. {args.lips} decoding LIPs: aggregate decode tok/s through the kernel | {med('agg'):.1f} |")
    print(f"| A. in-process engine, batch {args.lips}, same steps | {med('base'):.1f} |")
    print(f"| A. kernel / in-process | {med('agg') / med('base'):.2f}x (target >= 0.85) |")
    print(f"| A. per-LIP decode step latency p50 / p99 | {pct(lat, 0.5) * 1e3:.0f} ms / {pct(lat, 0.99) * 1e3:.0f} ms |")
    print(f"| A. kernel pred calls per forward pass | {med('calls_per_pass'):.1f} |")
    print(f"| B. {n_dec} decoders + {args.prefill_lips} LIPs sending 600-token prompts: Jain's index of decoder token rates | "
          f"{statistics.median(jain(r['mixed']['rates']) for r in rounds):.3f} (target >= 0.95) |")
    print(f"| B. decode step latency p50 / p99 under prefill load | {pct(mlat, 0.5) * 1e3:.0f} ms / {pct(mlat, 0.99) * 1e3:.0f} ms |")
    print(f"| B. prefill tokens fed meanwhile (median per round) | "
          f"{statistics.median(r['mixed']['prefill_tokens'] for r in rounds):.0f} |")


if __name__ == "__main__":
    main()
