"""RAG under skewed document popularity: recomputation, LRU prefix caching, the rag LIP's
application policy and llama.cpp's prompt cache, swept from uniform to extreme skew.

    python perf/paper/rag_skew.py [--docs 200] [--sentences 24] [--queries 32] [--concurrency 8]
                                  [--alphas inf,1.43,1.13,0.7,0.3] [--rounds 2] [--kv-memory-mb 384]
                                  [--contenders recompute,lru,app,llamacpp] [--max-tokens 8] [--plot PNG]

Workload: --docs synthetic documents (perf/bench_rag's generator, ~--sentences sentences,
about 300 tokens each), written to a directory.  A query asks about one document, drawn by
popularity: the document of rank i (1-based) is asked about with probability proportional
to i^(-1/alpha), the rank-frequency law of a Pareto popularity with index alpha.  alpha =
inf is uniform; the seeds' indexes 1.13 and 1.43 are moderate skews (1.16 is the 80/20
rule); small alpha concentrates nearly every query on a few documents (alpha -> 0: one).
Each point is --queries queries, --concurrency at a time; the same draw for every contender.
The KV pool (--kv-memory-mb) holds only a fraction of the documents' KV: SmolLM2-135M keeps
30 layers x 3 KV heads x 64 x 2 (K and V) x 4 bytes = 45 KiB per token in float32, so 384 MiB
hold ~8,700 tokens: the queries in flight (8 x ~400) and ~18 of 200 documents (~9 %).

Contenders (one kernel with its HTTP gateway, a second gateway in front of it with its prefix
cache off, and llama.cpp's server; all up for the whole run, alternating within each round):
  recompute  the gateway, prefix cache off: every query computes its whole prompt;
  lru        the gateway's prefix-caching serving program (automatic, per user: every full
             16-token block of earlier prompts, found by their hash chain, least recently used
             dropped first: vLLM's policy), same prompts;
  app        the stock rag LIP (``userland/rag.py --k 1``) through the kernel's socket: its own
             policy (the instruction's and each document's KV kept as cache files, popular
             ones kept, the rest expiring; a question merges instruction + document and
             prefills only the question).  It retrieves the document itself (BM25 over the
             granted directory, counted in its time); the prompt contenders are handed the
             right document by the client (retrieval free for them);
  llamacpp   llama.cpp's OpenAI server (llama-cpp-python[server], perf-only) on the same
             GGUF with its prompt cache on (one sequence at a time: it queues).
The prompt contenders send [system: rag.py's instruction, user: "Document: ...\\n\\nQuestion: ..."],
the same text the rag LIP assembles, greedy, --max-tokens.  Reported per alpha and contender:
queries/s (median over rounds, per-round spread), time to first token p50 (streamed for the
HTTP contenders; the rag LIP sends its answer whole, so its figure is the time to the
answer), and the ratio to recompute.  For `lru`, also its hit rate (cached_tokens of the
streamed usage / prompt tokens) beside what vLLM's automatic prefix caching would reuse on the
same queries in the same order with a pool of as many tokens (perf/apc_sim.py, simulated
exactly at 16- and 128-token blocks).  The block cache's claim, never below 0.97x of recompute
at uniform popularity, wants --alphas inf --queries 200 or more.  The plot shows queries/s vs
alpha.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

from bench_gateway import LlamaCpp, Symphony, pct  # noqa: E402
from common import cpu_name, pyplot, save, spread  # noqa: E402
from bench_rag import make_docs  # noqa: E402
from symphony.client import Client  # noqa: E402

CONTENDERS = ("recompute", "lru", "app", "llamacpp")


def rag_instruction() -> str:
    """The rag LIP's system instruction (the prompt contenders send the same text)."""
    spec = importlib.util.spec_from_file_location("rag_lip", REPO / "userland" / "rag.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SYSTEM


def draw(n_docs: int, n: int, alpha: float, seed: int) -> list[int]:
    """Document indexes of ``n`` queries: rank i+1 with probability ~ (i+1)^(-1/alpha);
    which document holds which rank is shuffled by ``seed`` too."""
    rnd = random.Random(seed)
    order = list(range(n_docs))
    rnd.shuffle(order)
    s = 0.0 if math.isinf(alpha) else 1.0 / alpha
    weights = [(i + 1) ** -s for i in range(n_docs)]
    return [order[i] for i in rnd.choices(range(n_docs), weights, k=n)]


def question(subject: str) -> str:
    return f"Which lanterns does {subject} sell in the harbour town?"


def messages(system: str, doc: str, subject: str) -> list[dict]:
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"Document: {doc}\n\nQuestion: {question(subject)}"}]


def http_query(url: str, model: str, system: str, doc: str, subject: str, max_tokens: int,
               usage: bool = False) -> tuple:
    """(time to first content chunk, total, cached prompt tokens, prompt tokens) of one streamed
    chat request; the token counts from the usage chunk when ``usage`` (else 0, 0)."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": messages(system, doc, subject)}
    if usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    ttft, cached, prompt = None, 0, 0
    with httpx.Client(timeout=900) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if ttft is None and any((ch.get("delta") or {}).get("content") for ch in d.get("choices", [])):
                    ttft = time.perf_counter() - t0
                if d.get("usage"):
                    prompt = d["usage"]["prompt_tokens"]
                    cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    total = time.perf_counter() - t0
    return (ttft if ttft is not None else total), total, cached, prompt


def rag_query(sock: str, source: str, ddir: Path, subject: str, max_tokens: int) -> tuple[float, float]:
    with Client(sock, timeout=900) as c:
        t0 = time.perf_counter()
        c.spawn(source, ["--docs", str(ddir), "--k", "1", "--max-tokens", str(max_tokens), question(subject)],
                filename="rag.py", grants={"http": [], "read": [str(ddir)]})
        first = None
        for ev in c.events(timeout=900):
            if ev.get("event") == "out" and first is None:
                first = time.perf_counter() - t0
            if ev.get("event") == "exit":
                if ev.get("status") != 0:
                    raise RuntimeError(f"rag.py failed: {ev}")
                break
        total = time.perf_counter() - t0
    return (first if first is not None else total), total, 0, 0


def run_point(fn, picks: list[int], concurrency: int) -> dict:
    ttfts, lock = [], threading.Lock()
    tokens = [0, 0]                                   # cached, prompt

    def job(i):
        ttft, _, cached, prompt = fn(i)
        with lock:
            ttfts.append(ttft)
            tokens[0] += cached
            tokens[1] += prompt
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(job, picks))
    wall = time.perf_counter() - t0
    return {"qps": len(picks) / wall, "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99),
            "hit": tokens[0] / tokens[1] if tokens[1] else None}


class BlockSims:
    """vLLM's APC (perf/apc_sim.py) at 16- and 128-token blocks over a pool of as many tokens
    as the kernel's, fed the block cache's queries as they are served (the state carries over
    from point to point, as the gateway's cache does)."""

    def __init__(self, sym, system: str, subjects: list, a):
        from apc_sim import APC
        from bench_overload import load_tokenizer
        from symphony.engine.loader import default_model_path
        from symphony.lip.tools import render
        self.tok, self.render, self.system, self.subjects, self.a = (load_tokenizer(default_model_path()), render,
                                                                    system, subjects, a)
        self.pages = sym.stats()["kv_pages_total"]
        self.apcs = {b: APC(self.pages * 16 // b, b, a.concurrency) for b in (16, 128)}

    def run(self, picks: list[int]) -> dict:
        prompts = [self.tok.encode_chat(self.render(messages(self.system, self.subjects[i][1], self.subjects[i][0])))
                   for i in picks]
        return {b: apc.run(prompts, [self.a.max_tokens] * len(prompts))["hit_rate"] for b, apc in self.apcs.items()}


def label(alpha: float) -> str:
    return "inf (uniform)" if math.isinf(alpha) else f"{alpha:g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--sentences", type=int, default=24)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--alphas", default="inf,1.43,1.13,0.7,0.3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-memory-mb", type=int, default=384)
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    ap.add_argument("--plot", default=str(Path(__file__).with_name("rag_skew.png")))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    alphas = [float(x) for x in a.alphas.split(",")]
    contenders = [c for c in a.contenders.split(",") if c]
    if set(contenders) - set(CONTENDERS) or not contenders or any(x <= 0 for x in alphas):
        ap.error(f"--contenders from {CONTENDERS}; --alphas > 0 (inf for uniform)")
    if a.docs < 2 or a.queries < 1 or a.concurrency < 1 or a.rounds < 1:
        ap.error("--docs >= 2, --queries, --concurrency, --rounds >= 1")

    tmp = Path(tempfile.mkdtemp(prefix="paper-rag-"))
    ddir, home = tmp / "docs", tmp / "kernel"
    ddir.mkdir()
    home.mkdir()                       # the kernel refuses read grants under its socket's directory
    os.chmod(tmp, 0o755)
    docs = make_docs(a.docs, a.sentences)
    for fname, (_, text) in docs.items():
        (ddir / fname).write_text(text)
    subjects = list(docs.values())
    system = rag_instruction()
    sym = Symphony(home, kv_memory_mb=a.kv_memory_mb)
    llama = None
    if "llamacpp" in contenders:
        from symphony.engine.loader import default_model_path
        llama = LlamaCpp(tmp, str(default_model_path()), a.threads)
    source = (REPO / "userland" / "rag.py").read_text()
    print(f"# RAG under skew: SmolLM2-135M-Instruct Q4_1, {cpu_name()}, {os.cpu_count()} vCPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {a.docs} documents, {a.queries} queries "
          f"{a.concurrency} at a time, KV pool {a.kv_memory_mb} MiB, max_tokens {a.max_tokens}", flush=True)

    def fn_for(c):
        if c == "app":
            return lambda i: rag_query(sym.sock, source, ddir, subjects[i][0], a.max_tokens)
        url, model = {"recompute": (f"http://127.0.0.1:{sym.port_nocache}", sym.model),
                      "lru": (f"http://127.0.0.1:{sym.port}", sym.model),
                      "llamacpp": (f"http://127.0.0.1:{llama.port}" if llama else "", "llamacpp")}[c]
        return lambda i: http_query(url, model, system, subjects[i][1], subjects[i][0], a.max_tokens,
                                    usage=c == "lru")

    res: dict = {label(x): {c: [] for c in contenders} for x in alphas}
    sims = BlockSims(sym, system, subjects, a) if "lru" in contenders else None
    try:
        for c in contenders:                              # warm-up: each path once
            run_point(fn_for(c), [0, 1], 2)
            if c == "lru":
                sims.run([0, 1])
        for r in range(a.rounds):
            for alpha in alphas:
                picks = draw(a.docs, a.queries, alpha, seed=1000 * r + int(0 if math.isinf(alpha) else alpha * 100))
                order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                for c in order:
                    res[label(alpha)][c].append(run_point(fn_for(c), picks, a.concurrency))
                    if c == "lru":                        # vLLM's APC on the same queries, in the same order
                        res[label(alpha)][c][-1]["apc"] = sims.run(picks)
                print(f"  round {r + 1}/{a.rounds} alpha {label(alpha)} ({len(set(picks))} distinct documents): "
                      + ", ".join(f"{c} {res[label(alpha)][c][-1]['qps']:.2f} q/s" for c in contenders), flush=True)
    finally:
        sym.stop()
        if llama is not None:
            llama.stop()

    fmt = spread
    print("\nqueries/s, median (per-round spread); ratio to recompute per round; TTFT p50 s")
    print("| alpha | " + " | ".join(contenders) + " | " + " | ".join(f"{c}/recompute" for c in contenders
                                                                 if c != "recompute" and "recompute" in contenders)
          + " | " + " | ".join(f"TTFT {c}" for c in contenders) + " |")
    print("|---" * (1 + 2 * len(contenders) + (len(contenders) - 1 if "recompute" in contenders else 0)) + "|")
    for lab, row in res.items():
        cells = [fmt([x["qps"] for x in row[c]]) for c in contenders]
        ratios = ([fmt([x["qps"] / y["qps"] for x, y in zip(row[c], row["recompute"])])
                   for c in contenders if c != "recompute"] if "recompute" in contenders else [])
        ttft = [f"{statistics.median(x['ttft_p50'] for x in row[c]):.2f}" for c in contenders]
        print(f"| {lab} | " + " | ".join(cells + ratios + ttft) + " |")
    if sims is not None:
        print(f"\nthe block cache (lru) vs vLLM's automatic prefix caching simulated on the same queries in the "
              f"same order with a pool of as many blocks (perf/apc_sim.py; {sims.pages} pages of 16 tokens): "
              "prompt tokens reused / prompt tokens, median (per-round spread)")
        print("| alpha | block cache | APC, 16-token blocks | APC, 128-token blocks |\n|---|---|---|---|")
        for lab, row in res.items():
            got = [x for x in row["lru"] if x.get("hit") is not None]
            if got:
                print(f"| {lab} | {fmt([x['hit'] for x in got], 3)} | {fmt([x['apc'][16] for x in got], 3)} | "
                      f"{fmt([x['apc'][128] for x in got], 3)} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    plt = pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = list(range(len(alphas)))
    for c in contenders:
        ax.plot(xs, [statistics.median(x["qps"] for x in res[label(al)][c]) for al in alphas], marker="o", label=c)
    ax.set_xticks(xs, [label(al) for al in alphas])
    ax.set_xlabel("Pareto index alpha (popularity of rank i ~ i^(-1/alpha)); right = more skewed")
    ax.set_ylabel("queries/s (median)")
    ax.set_title(f"RAG under skew: {a.docs} documents, {a.kv_memory_mb} MiB KV pool, {a.concurrency} concurrent\n"
                 f"SmolLM2-135M Q4_1, {cpu_name()[:40]}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
