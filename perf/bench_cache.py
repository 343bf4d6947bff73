"""A cache must never cost more than no cache: the serve and rag programs' KV caches on a small
pool at uniform and skewed popularity against the same programs without a cache; the block
cache's hit rate against vLLM's automatic prefix caching on the same trace; what a lookup
costs; and a cold burst (many clients, one new system prompt) with and without sharing.

    python perf/bench_cache.py [--docs 200] [--queries 200] [--concurrency 8] [--rounds 2]
                               [--kv-memory-mb 128] [--programs serve,rag] [--popularity uniform,zipf]
                               [--burst 16] [--burst-rules 55] [--parts overheads,popularity,burst]
                               [--json OUT]

One kernel (--kv-memory-mb, CPU) serves every part.

overheads   a LIP times the calls a request makes for its cache (median us of --calls each):
            kv.create + close (no cache), kv.lookup of a ~1,000-token prompt's keys that
            misses, that claims (+ kv_publish of the answer's keys at the end), that hits;
            and hashing the keys in the LIP; at blocks of 16 and 32 tokens.
popularity  --docs synthetic documents (perf/bench_rag's generator) are the working set: for
            `serve` each is a request's system prompt with a question after it (through the
            kernel's socket, as the gateway runs it), for `rag` the retrieved document (k=1).
            A run is --queries requests, --concurrency at a time, each about a document drawn
            by popularity (uniform, or Zipf s=1.1), the same draw for both contenders, which
            alternate within each round (cached first in odd rounds); a cached run starts from
            an empty cache directory of its own.  Reported: requests/s (median and per-round
            spread), cached / uncached, the kernel's tokens computed per run, cache files
            dropped, and for serve the hit rate (cached_tokens / prompt tokens) next to what
            vLLM's automatic prefix caching hits on the same trace with a pool of as many
            blocks (perf/apc_sim.py, an exact block-level simulation with LRU: at 16-token
            blocks, its GPU default, and 128, its CPU default).
burst       --burst clients send at once a chat request with the same new system prompt
            (--burst-rules rules, ~19 tokens each: 55 are ~1,050 tokens) and a question each:
            time to first token p50 / p99 and tokens computed, with sharing (a request waits
            for the prefix another is computing), without (cache.wait 0: each computes what is
            not yet cached when it looks) and without a cache; a new cache directory a round.
Each part prints the machine's load and the CPU other processes took meanwhile (the box is
shared: a busy neighbour skews every figure).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

from apc_sim import simulate  # noqa: E402
from bench_kernel import CpuWatch, _children  # noqa: E402
from bench_overload import load_tokenizer  # noqa: E402
from bench_rag import Kernel, make_docs  # noqa: E402
from symphony.client import Client  # noqa: E402
from symphony.programs import resolve  # noqa: E402

OVERHEADS = '''
import time
from symphony.lip import kv, send
from symphony.lip.prefixcache import PrefixCache

def med(f, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return round(sorted(ts)[n // 2] * 1e6, 1)

def main(n, d):
    n = int(n)
    kv.mkdir(d)
    prompt = [(i * 7919) % 900 + 50 for i in range(1040)]
    out = {"create+close": med(lambda: kv.create().close(), n)}
    for block in (16, 32):
        pc = PrefixCache(d, block=block, user="any")
        out[f"hash {block}"] = med(lambda: PrefixCache(d, block=block, user="any").keys(prompt, len(prompt) // block), n)
        keys = b"".join(pc.keys(prompt, len(prompt) // block))
        miss = b"".join(PrefixCache(d, block=block, user="any", salt=b"miss").keys(prompt, len(prompt) // block))
        out[f"lookup miss {block}"] = med(lambda: kv.lookup(d, miss, block).close(), n)
        def claim():
            f = kv.lookup(d, miss, block, claim=True, ttl=60)
            f.publish(miss, block)
            f.remove()
        out[f"lookup claim+publish {block}"] = med(claim, n)
        with kv.lookup(d, keys, block, claim=True, ttl=600) as w:
            from symphony.lip import pred
            pred(w, prompt, output="argmax")
        out[f"lookup hit {block}"] = med(lambda: kv.lookup(d, keys, block, limit=len(keys) // 16 - 1).close(), n)
    send(out)
'''


def draw(n_docs: int, n: int, popularity: str, seed: int) -> list[int]:
    rnd = random.Random(seed)
    if popularity == "uniform":
        return [rnd.randrange(n_docs) for _ in range(n)]
    weights = [1 / (i + 1) ** 1.1 for i in range(n_docs)]
    return rnd.choices(range(n_docs), weights, k=n)


def run_lip(sock: str, source: str, filename: str, args: list, grants: dict, user=None) -> tuple[list, float]:
    """(the LIP's messages, seconds to its first text event or exit)."""
    with Client(sock, user=user) as c:
        t0 = time.perf_counter()
        c.spawn(source, args, filename=filename, grants=grants)
        outs, first, err = [], None, []
        for e in c.events(timeout=1800):
            if e["event"] == "stderr":
                err.append(e["data"])
            elif e["event"] == "out":
                outs.append(e["data"])
                if first is None and isinstance(e["data"], dict) and e["data"].get("event") == "text":
                    first = time.perf_counter() - t0
            elif e["event"] == "exit":
                if e.get("status") != 0:
                    raise RuntimeError(f"{filename} failed: {e} {outs[-2:]} {''.join(err)[-2000:]}")
                return outs, first if first is not None else time.perf_counter() - t0
    raise RuntimeError(f"{filename}: no exit event")


def question(subject: str) -> str:
    return f"Which lanterns does {subject} sell in the harbour town?"


class Bench:
    def __init__(self, a, tmp: Path):
        self.a, self.tmp = a, tmp
        self.ddir = tmp / "docs"
        self.ddir.mkdir()
        self.docs = list(make_docs(a.docs, a.sentences).values())
        for i, (_, text) in enumerate(self.docs):
            (self.ddir / f"doc{i}.txt").write_text(text)
        self.k = Kernel(tmp, a.kv_memory_mb)
        self.sock = self.k.socket
        self.serve = resolve("serve").read_text()
        self.rag = resolve("rag").read_text()
        self.watch = CpuWatch(self.k.proc.pid, *_children(self.k.proc.pid))
        self.results: dict = {}

    def stats(self) -> dict:
        with Client(self.sock) as c:
            return c.stats()

    def measured(self, fn):
        """(fn(), its kernel stats delta, other processes' CPU %)."""
        s0 = self.stats()
        self.watch.start()
        out = fn()
        others = self.watch.stop()
        s1 = self.stats()
        return out, {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], (int, float)) and k in s0}, others

    # ------------------------------------------------------------ parts
    def overheads(self) -> None:
        (msgs, _), _, others = self.measured(lambda: run_lip(self.sock, OVERHEADS, "overheads.py",
                                                             [str(self.a.calls), f"/home/root/bench-overheads-{uuid.uuid4().hex[:6]}"], {}))
        res = msgs[-1]
        print(f"\n## overheads: median us per call over {self.a.calls} (other processes' CPU {others:.0f}%)")
        for k, v in res.items():
            print(f"  {k:28} {v:9.1f}")
        self.results["overheads"] = res

    def serve_req(self, i: int, cache) -> dict:
        subject, text = self.docs[i]
        return {"mode": "chat", "messages": [{"role": "system", "content": text},
                                              {"role": "user", "content": question(subject)}],
                "max_tokens": self.a.max_tokens, "temperature": 0, "cache": cache}

    def run(self, program: str, cached: bool, picks: list[int], tag: str) -> dict:
        cache = {"dir": f"/home/root/bench-cache-{tag}", "trust": []} if cached else None
        prompts, lock = [], threading.Lock()

        def job(i):
            if program == "rag":
                subject = self.docs[i][0]
                args = ["--docs", str(self.ddir), "--k", "1", "--max-tokens", str(self.a.max_tokens), question(subject)]
                run_lip(self.sock, self.rag, "rag.py", args + ([] if cached else ["--no-cache"]),
                        {"http": [], "read": [str(self.ddir)]})
                return
            outs, _ = run_lip(self.sock, self.serve, "serve.py", [json.dumps(self.serve_req(i, cache))], {})
            with lock:
                prompts.append(outs[0])

        def go():
            t0 = time.perf_counter()
            with ThreadPoolExecutor(self.a.concurrency) as pool:
                list(pool.map(job, picks))
            return time.perf_counter() - t0
        dt, delta, others = self.measured(go)
        r = {"rps": len(picks) / dt, "computed": delta["tokens_computed"], "drops": delta["cache_drops"],
             "others": others}
        if prompts:
            r["hit"] = sum(p["cached_tokens"] for p in prompts) / sum(p["prompt_tokens"] for p in prompts)
        return r

    def popularity(self) -> None:
        a = self.a
        tok = load_tokenizer(_model())
        from symphony.lip.tools import render
        pages = self.stats()["kv_pages_total"]
        for program in a.programs.split(","):
            for pop in a.popularity.split(","):
                rows = {True: [], False: []}
                sims = {16: [], 128: []}
                for r in range(a.rounds):
                    picks = draw(a.docs, a.queries, pop, seed=r)
                    for cached in ((True, False) if r % 2 == 0 else (False, True)):
                        rows[cached].append(self.run(program, cached, picks, f"{pop}-{r}-{uuid.uuid4().hex[:6]}"))
                    if program == "serve":
                        prompts = [tok.encode_chat(render(self.serve_req(i, None)["messages"])) for i in picks]
                        for b in sims:
                            sims[b].append(simulate(prompts, pages * 16 // b, b, a.concurrency,
                                                    [a.max_tokens] * len(prompts))["hit_rate"])
                    print(f"  round {r + 1}: {program} {pop}: cached {rows[True][-1]['rps']:.2f} req/s, "
                          f"uncached {rows[False][-1]['rps']:.2f} req/s", flush=True)
                self.report(program, pop, rows, sims if program == "serve" else None)

    def report(self, program, pop, rows, sims) -> None:
        f = lambda xs, d=2: f"{statistics.median(xs):.{d}f} ({min(xs):.{d}f}..{max(xs):.{d}f})"  # noqa: E731
        c, u = rows[True], rows[False]
        ratio = [x["rps"] / y["rps"] for x, y in zip(c, u)]
        line = (f"{program:5} {pop:7}: req/s cached {f([x['rps'] for x in c])}, uncached {f([x['rps'] for x in u])}, "
                f"ratio {f(ratio)}; tokens computed cached {statistics.median(x['computed'] for x in c):.0f}, "
                f"uncached {statistics.median(x['computed'] for x in u):.0f}; cache files dropped "
                f"{sum(x['drops'] for x in c)}; other processes' CPU {f([x['others'] for x in c + u], 0)}%")
        if sims is not None:
            line += (f"; hit rate {f([x['hit'] for x in c], 3)}, vLLM APC simulated: 16-token blocks "
                     f"{f(sims[16], 3)}, 128-token blocks {f(sims[128], 3)}")
        print(line, flush=True)
        self.results.setdefault("popularity", {})[f"{program} {pop}"] = {
            "cached": c, "uncached": u, "ratio": ratio, "apc_sim": sims}

    def burst(self) -> None:
        a = self.a
        system = " ".join(f"Rule {i}: greet visitor number {i} politely and answer in one short sentence."
                          for i in range(a.burst_rules))
        modes = {"sharing": 30.0, "no sharing": 0.0, "no cache": None}
        res: dict = {m: [] for m in modes}
        for r in range(a.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                wait, tag = modes[mode], uuid.uuid4().hex[:8]
                cache = None if wait is None else {"dir": f"/home/root/bench-burst-{tag}", "trust": [], "wait": wait}
                reqs = [{"mode": "chat", "max_tokens": a.max_tokens, "temperature": 0, "cache": cache,
                         "messages": [{"role": "system", "content": f"Session {tag}. {system}"},
                                      {"role": "user", "content": f"Visitor {i} asks: what is {i} + {i}?"}]}
                        for i in range(a.burst)]
                start = threading.Barrier(a.burst)

                def one(req):
                    start.wait()
                    return run_lip(self.sock, self.serve, "serve.py", [json.dumps(req)], {})

                def go():
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(a.burst) as pool:
                        got = list(pool.map(one, reqs))
                    return got, time.perf_counter() - t0
                (got, wall), delta, others = self.measured(go)
                ttft = sorted(t for _, t in got)
                res[mode].append({"p50": _pct(ttft, 50), "p99": _pct(ttft, 99), "computed": delta["tokens_computed"],
                                  "wall": wall, "prompt": got[0][0][0]["prompt_tokens"], "others": others,
                                  "waits": delta.get("chain_waits", 0)})
                print(f"  round {r + 1}: burst {mode}: TTFT p50 {res[mode][-1]['p50']:.1f} s, p99 "
                      f"{res[mode][-1]['p99']:.1f} s, {delta['tokens_computed']} tokens computed, "
                      f"{delta.get('chain_waits', 0)} waited", flush=True)
        f = lambda xs, d=1: f"{statistics.median(xs):.{d}f} ({min(xs):.{d}f}..{max(xs):.{d}f})"  # noqa: E731
        print(f"\n## cold burst: {a.burst} clients at once, one new system prompt "
              f"({res['no cache'][0]['prompt']} prompt tokens each), {a.rounds} rounds: median (min..max)")
        print("| | TTFT p50 s | TTFT p99 s | tokens computed | wall s | other processes' CPU % |")
        print("|---|---|---|---|---|---|")
        for mode, rows in res.items():
            print(f"| {mode} | {f([x['p50'] for x in rows])} | {f([x['p99'] for x in rows])} | "
                  f"{f([x['computed'] for x in rows], 0)} | {f([x['wall'] for x in rows])} | "
                  f"{f([x['others'] for x in rows], 0)} |", flush=True)
        self.results["burst"] = res


def _pct(xs: list, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def _model():
    from symphony.engine.loader import default_model_path
    return default_model_path()


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--sentences", type=int, default=24)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kv-memory-mb", type=int, default=128)
    p.add_argument("--programs", default="serve,rag")
    p.add_argument("--popularity", default="uniform,zipf")
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--burst-rules", type=int, default=55)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--parts", default="overheads,popularity,burst")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    parts = a.parts.split(",")
    if set(parts) - {"overheads", "popularity", "burst"} or a.rounds < 1 or a.queries < 1 or a.burst < 1:
        p.error("--parts from overheads, popularity, burst; --rounds, --queries, --burst >= 1")
    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    print(f"# CPU: {cpu_name()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {a.docs} documents, {a.queries} requests "
          f"{a.concurrency} at a time, --kv-memory-mb {a.kv_memory_mb}, max_tokens {a.max_tokens}", flush=True)
    b = Bench(a, tmp)
    try:
        for part in parts:
            getattr(b, part)()
    finally:
        b.k.stop()
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(b.results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
