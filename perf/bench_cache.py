"""A cache must never cost more than no cache: the rag and serve programs' KV caches on a small
pool, at uniform and at skewed popularity, against the same programs without a cache.

    python perf/bench_cache.py [--docs 200] [--queries 48] [--concurrency 8] [--rounds 2]
                               [--kv-memory-mb 128] [--programs rag,serve] [--popularity uniform,zipf]

One kernel (--kv-memory-mb, CPU) serves every run. --docs synthetic documents (perf/bench_rag's
generator) are the working set: for `rag` they are the retrieved documents (k=1); for `serve`
each document is a request's system prompt, with a question after it. A run is --queries
requests, --concurrency at a time, each about a document drawn by popularity (uniform, or Zipf
with s=1.1), the same draw for both contenders; the contenders alternate within each round
(cached first in odd rounds). Reported: requests per second, median and per-round spread, and
the ratio cached / uncached (the target: >= 0.95 at uniform popularity, where the cache rarely
hits and its files fill the pool; > 1 at skew), and the kernel's cache drops.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

from bench_rag import Kernel, make_docs  # noqa: E402
from symphony.client import Client  # noqa: E402
from symphony.programs import resolve  # noqa: E402


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def draw(n_docs: int, n: int, popularity: str, seed: int) -> list[int]:
    rnd = random.Random(seed)
    if popularity == "uniform":
        return [rnd.randrange(n_docs) for _ in range(n)]
    weights = [1 / (i + 1) ** 1.1 for i in range(n_docs)]
    return rnd.choices(range(n_docs), weights, k=n)


def one(sock: str, source: str, filename: str, args: list, grants: dict) -> None:
    with Client(sock) as c:
        c.spawn(source, args, filename=filename, grants=grants)
        evs = list(c.events(timeout=900))
    if evs[-1].get("status") != 0:
        raise RuntimeError(f"{filename} failed: {evs[-3:]}")


def run(sock, program, cached, picks, docs, ddir, concurrency) -> float:
    """Seconds for every request of ``picks`` (document indexes), ``concurrency`` at a time."""
    source = resolve(program).read_text()
    subjects = list(docs.values())

    def job(i):
        subject, text = subjects[i]
        q = f"Which lanterns does {subject} sell in the harbour town?"
        if program == "rag":
            args = ["--docs", str(ddir), "--k", "1", "--max-tokens", "8", q] + ([] if cached else ["--no-cache"])
            one(sock, source, "rag.py", args, {"http": [], "read": [str(ddir)]})
        else:
            req = {"mode": "chat", "messages": [{"role": "system", "content": text}, {"role": "user", "content": q}],
                   "max_tokens": 8, "temperature": 0,
                   "cache": {"dir": "/home/root/serve-cache", "trust": []} if cached else None}
            one(sock, source, "serve.py", [json.dumps(req)], {})
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(job, picks))
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--sentences", type=int, default=24)
    p.add_argument("--queries", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-memory-mb", type=int, default=128)
    p.add_argument("--programs", default="rag,serve")
    p.add_argument("--popularity", default="uniform,zipf")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    ddir = tmp / "docs"
    ddir.mkdir()
    docs = make_docs(a.docs, a.sentences)
    for fname, (_, text) in docs.items():
        (ddir / fname).write_text(text)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {a.docs} documents, {a.queries} requests "
          f"{a.concurrency} at a time, --kv-memory-mb {a.kv_memory_mb}", flush=True)
    k = Kernel(tmp, a.kv_memory_mb)
    try:
        for program in a.programs.split(","):
            for pop in a.popularity.split(","):
                rps = {True: [], False: []}
                drops0 = Client(k.socket).stats().get("cache_drops", 0)
                for r in range(a.rounds):
                    picks = draw(a.docs, a.queries, pop, seed=r)
                    for cached in ((True, False) if r % 2 == 0 else (False, True)):
                        dt = run(k.socket, program, cached, picks, docs, ddir, a.concurrency)
                        rps[cached].append(a.queries / dt)
                drops = Client(k.socket).stats().get("cache_drops", 0) - drops0
                ratio = [c / u for c, u in zip(rps[True], rps[False])]
                fmt = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"  # noqa: E731
                print(f"{program:5} {pop:7}: cached {fmt(rps[True])} req/s, uncached {fmt(rps[False])} req/s: "
                      f"ratio {fmt(ratio)}; cache files dropped {drops}", flush=True)
    finally:
        k.stop()
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
