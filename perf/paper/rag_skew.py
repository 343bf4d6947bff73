"""RAG at steady state under skewed document popularity: recomputation, our block prefix cache,
vLLM's automatic prefix caching, llama-server, and the rag LIP's own policy, on the same queries.

    python perf/paper/rag_skew.py [--docs 200] [--sentences 24] [--k 3] [--queries 500] [--warmup 100]
        [--concurrency 8] [--skews 0,1.13] [--rounds 1] [--kv-tokens 23301] [--pin-tokens N]
        [--contenders recompute,lru,vllm,llama-server,app,app-prefix,app-retrieve,app-ttl,app-nocache]
        [--max-tokens 16] [--data JSON] [--plot PNG]
    python perf/paper/rag_skew.py --report JSON [--plot PNG]     # the tables again, from the raw data

Workload.  --docs synthetic documents (perf/bench_rag's generator: --sentences sentences, 24 give
~330 tokens), each stating facts "Name sells 412 glass bells in the old city every spring.".  A
query asks about the second sentence's number ("How many glass bells does Name sell in the old
city every spring?"; correct when the answer contains 412) with --k documents in the prompt: the
one asked about first, then k-1 others, all drawn by popularity (ordered by popularity rank, as a
retriever's ranking would be: a fixed order for a fixed set).  Popularity: the document of rank
i (1-based) is drawn with probability ~ i^(-s), the Zipf exponent s of --skews (0 uniform; the
larger, the more skewed; a Pareto index a is s = 1/a; ``one``: every query on one document).  Which
document holds which rank is fixed for the run (the same hot documents at every skew).  A point
(one skew) is --warmup queries to reach the steady state (not counted), then --queries measured,
--concurrency at a time; the same draw for every contender; contenders run one after the other,
their order rotating from round to round.

The KV pool is the same number of tokens for every contender (--kv-tokens, float32 KV, 45 KiB a
token: 23,301 tokens = vLLM's smallest, 1 GiB): our kernel gets as many MiB with no host tier
(--host-pages 0) and the whole pool for one user (--user-quota 100%); vLLM gets
VLLM_CPU_KVCACHE_SPACE in GiB (so --kv-tokens should be a multiple of 23,301).

Contenders (only one server computes at a time: a paused peer is SIGSTOPped):
  recompute     our gateway with its prefix cache off: every query computes its whole prompt;
  lru           our gateway's block prefix cache (16-token blocks, least recently used dropped);
  vllm          vLLM's OpenAI server, automatic prefix caching (128-token blocks on the CPU),
                float32 weights dequantized from the same GGUF (perf/peers.py);
  llama-server  llama.cpp's server, -np --concurrency slots, --cache-reuse 256 (perf/peers.py);
  app           the stock rag LIP handed the same documents (--doc, no retrieval: the same work as
                the prompt contenders) with the popularity policy: the most-hit documents' KV
                modules pinned within --pin-tokens (default half the pool), the rest cache files
                dropped least recently used first.  Each document is a module computed once
                after the instruction and merged at its own positions (parallel encoding): with
                k > 1 the documents do not attend to each other, an approximation that the
                answers' correctness and agreement with recompute measure;
  app-prefix    the same with ``--compose prefix``: exact, only the first document a module, the
                others computed after it with the question;
  app-retrieve  the same, retrieving --k documents itself by BM25 over the --docs files (its own
                documents: the answers, not the prompts, are comparable);
  app-ttl       the rag LIP's default policy (hit counts, sliding expiry; LRU under pressure);
  app-nocache   ``rag.py --no-cache``: the same modules computed every time (the LIP's recompute).
The prompt contenders send [system: rag.py's instruction, user: "Document: ...\\n\\n" x k +
"Question: ..."], the text the rag LIP assembles, greedy, --max-tokens.

Reported per skew and contender: queries/s, latency p50/p99 (to the whole answer: the LIP sends
its answer whole), prompt tokens computed per query (usage's cached_tokens for the servers, the
LIP's own counts), the hit rate (reused / prompt tokens), answers correct, and answers equal to
recompute's; medians over rounds with the per-round range.  --data writes every query (documents,
times, tokens, answer) with the commit, the machine, the command and the load before and after
each block (perf/paper/data/).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

import peers  # noqa: E402
import sse  # noqa: E402
from bench_gateway import Symphony, pct  # noqa: E402
from bench_rag import make_docs  # noqa: E402
from common import cpu_name, pyplot, save, spread  # noqa: E402
from symphony.client import Client  # noqa: E402

CONTENDERS = ("recompute", "lru", "vllm", "llama-server", "app", "app-prefix", "app-retrieve", "app-ttl",
              "app-nocache")
KV_TOKEN_BYTES = 30 * 3 * 64 * 2 * 4          # SmolLM2-135M, float32 K and V
FACT = re.compile(r"^(\w+) (\w+) (\d+) (.+?) in (.+?) every (\w+)\.$")


def rag_instruction() -> str:
    """The rag LIP's system instruction (the prompt contenders send the same text)."""
    spec = importlib.util.spec_from_file_location("rag_lip", REPO / "userland" / "rag.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SYSTEM


def ranks(n_docs: int, seed: int = 0) -> list[int]:
    """Which document holds rank 1, 2, ...: fixed for a run."""
    order = list(range(n_docs))
    random.Random(seed).shuffle(order)
    return order


def draw_zipf(n_docs: int, n: int, s, seed: int, order: list[int] | None = None) -> list[int]:
    """Document indexes of ``n`` draws: rank i+1 with probability ~ (i+1)^(-s) (``s`` = "one":
    always rank 1); ``order`` maps ranks to documents (default: shuffled by ``seed``)."""
    rnd = random.Random(seed)
    if order is None:
        order = list(range(n_docs))
        rnd.shuffle(order)
    if s == "one":
        return [order[0]] * n
    weights = [(i + 1) ** -float(s) for i in range(n_docs)]
    return [order[i] for i in rnd.choices(range(n_docs), weights, k=n)]


def draw(n_docs: int, n: int, alpha: float, seed: int) -> list[int]:
    """The Pareto form (rank i ~ i^(-1/alpha), alpha = inf uniform) of `draw_zipf`, which
    perf/sim_routing.py uses."""
    return draw_zipf(n_docs, n, 0.0 if math.isinf(alpha) else 1.0 / alpha, seed)


def queries(n_docs: int, n: int, s, k: int, seed: int, order: list[int]) -> list[list[int]]:
    """``n`` queries of ``k`` distinct documents each: the one asked about, then the others by rank."""
    rnd, rank = random.Random(seed + 1), {d: r for r, d in enumerate(order)}
    first = draw_zipf(n_docs, n, s, seed, order)
    out = []
    for d in first:
        rest: set[int] = set()
        while len(rest) < k - 1:
            c = draw_zipf(n_docs, 1, s if s != "one" else 0.0, rnd.randrange(1 << 30), order)[0]
            if c != d:
                rest.add(c)
        out.append([d] + sorted(rest, key=rank.get))
    return out


def fact(text: str) -> tuple[str, str]:
    """(question, answer) about a document's second sentence."""
    sentence = re.findall(r"[^.]+\.", text)[1].strip()
    name, verb, num, noun, place, when = FACT.match(sentence).groups()
    base = verb[:-3] + "y" if verb.endswith("ies") else verb[:-1]
    return f"How many {noun} does {name} {base} in {place} every {when}?", num


def user_text(texts: list[str], question: str) -> str:
    return "".join(f"Document: {t}\n\n" for t in texts) + f"Question: {question}"


def http_query(url: str, model: str, system: str, texts: list[str], question: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user_text(texts, question)}]}
    t0 = time.perf_counter()
    ttft, answer, prompt, cached, error = None, [], 0, None, None
    with httpx.Client(timeout=900) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            d = sse.event(line)
            if d is None:
                continue
            if d.get("error"):                                           # kept: the run reports it
                error = d["error"]
            piece = sse.content(d)
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                answer.append(piece)
            if d.get("usage"):
                prompt = d["usage"].get("prompt_tokens") or prompt
                cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            if d.get("timings") and cached is None:                   # llama-server's own counters
                cached = d["timings"].get("cache_n")
    total = time.perf_counter() - t0
    cached = cached or 0
    return {"ttft": ttft if ttft is not None else total, "latency": total, "prompt": prompt, "reused": cached,
            "computed": prompt - cached, "answer": "".join(answer), "error": error}


def lip_query(sock: str, source: str, ddir: Path, names: list[str], question: str, args: list[str]) -> dict:
    argv = ["--docs", str(ddir)] + [x for n in names for x in ("--doc", n)] + args + [question]
    t0 = time.perf_counter()
    with Client(sock, timeout=900) as c:
        c.spawn(source, argv, filename="rag.py", grants={"http": [], "read": [str(ddir)]})
        text, st, err = [], None, []
        for ev in c.events(timeout=900):
            if ev.get("event") == "stderr":
                err.append(str(ev.get("data")))
            elif ev.get("event") == "out":
                if isinstance(ev["data"], str):
                    text.append(ev["data"])
                else:
                    st = ev["data"]
            elif ev.get("event") == "exit":
                if ev.get("status") != 0:
                    raise RuntimeError(f"rag.py {' '.join(argv)} failed: {ev}: {''.join(err)[-2000:]}")
                break
    total = time.perf_counter() - t0
    st = st or {}
    computed, reused = st.get("prefill_computed", 0), st.get("prefill_reused", 0)
    return {"ttft": total, "latency": total, "prompt": computed + reused, "reused": reused, "computed": computed,
            "answer": "".join(text).strip(), "docs": st.get("docs")}


def clear_cache(sock: str, name: str) -> None:
    """Remove the rag LIP's cache ``name`` of this user (its modules, counters and pins)."""
    from symphony.client import KernelError
    with Client(sock, timeout=120) as c:
        home = [e["name"] for e in c.kv_ls("/home")]
        for user in home:
            root = f"/home/{user.rstrip('/')}/{name}"
            try:
                entries = c.kv_ls(root)
            except KernelError:
                continue
            for e in entries:
                path = f"{root}/{e['name'].rstrip('/')}"
                if e.get("type") == "dir":
                    for f in c.kv_ls(path):
                        c.kv_rm(f"{path}/{f['name']}")
                else:
                    c.kv_rm(path)


def run_block(fn, qs: list[list[int]], concurrency: int) -> tuple[list[dict], float]:
    out: list = [None] * len(qs)

    def job(i):
        out[i] = fn(qs[i])
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(job, range(len(qs))))
    return out, time.perf_counter() - t0


def summary(recs: list[dict], wall: float, truth: list[str], base: list[dict] | None) -> dict:
    lat = [r["latency"] for r in recs]
    prompt = sum(r["prompt"] for r in recs)
    return {"qps": len(recs) / wall, "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99),
            "ttft_p50": pct([r["ttft"] for r in recs], 50),
            "computed_per_query": sum(r["computed"] for r in recs) / len(recs),
            "hit": sum(r["reused"] for r in recs) / prompt if prompt else None,
            "correct": sum(t in r["answer"] for r, t in zip(recs, truth)) / len(recs),
            "errors": sum(1 for r in recs if r.get("error")),
            "same_as_recompute": agreement(recs, base)}


def agreement(recs: list[dict], base: list[dict] | None):
    """The share of answers equal to recompute's on the same queries (None without them)."""
    return sum(r["answer"] == b["answer"] for r, b in zip(recs, base)) / len(recs) if base else None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--sentences", type=int, default=24)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skews", default="0,1.13")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=23301)
    ap.add_argument("--pin-tokens", type=int, default=None)
    ap.add_argument("--contenders", default="recompute,lru,vllm,app")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the peers' threads")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--data", default=None, help="raw data JSON (default: perf/paper/data/rag_skew-DATE.json)")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the tables (and --plot) of a raw data file written earlier; runs nothing")
    a = ap.parse_args()
    if a.report:
        return report_file(Path(a.report), a.plot)
    contenders = [c for c in a.contenders.split(",") if c]
    try:
        skews = [x if x == "one" else float(x) for x in a.skews.split(",")]
    except ValueError:
        ap.error("--skews: numbers >= 0 or 'one'")
    if set(contenders) - set(CONTENDERS) or not contenders or any(x != "one" and x < 0 for x in skews):
        ap.error(f"--contenders from {CONTENDERS}; --skews >= 0 or 'one'")
    if a.docs < a.k + 1 or a.k < 1 or a.queries < 1 or a.warmup < 0 or a.concurrency < 1 or a.rounds < 1 \
            or a.kv_tokens < 1000:
        ap.error("--docs > --k >= 1, --queries, --concurrency, --rounds >= 1, --warmup >= 0, --kv-tokens >= 1000")
    pin = a.pin_tokens if a.pin_tokens is not None else a.kv_tokens // 2
    data_path = Path(a.data or REPO / "perf" / "paper" / "data" / f"rag_skew-{time.strftime('%Y-%m-%d')}.json")

    tmp = Path(tempfile.mkdtemp(prefix="paper-rag-"))
    ddir, home = tmp / "docs", tmp / "kernel"
    ddir.mkdir()
    home.mkdir()                       # the kernel refuses read grants under its socket's directory
    os.chmod(tmp, 0o755)
    docs = make_docs(a.docs, a.sentences)
    for fname, (_, text) in docs.items():
        (ddir / fname).write_text(text)
    names, texts = list(docs), [t for _, t in docs.values()]
    qa = [fact(t) for t in texts]
    system, source, order = rag_instruction(), (REPO / "userland" / "rag.py").read_text(), ranks(a.docs)
    mib = math.ceil(a.kv_tokens * KV_TOKEN_BYTES / 2 ** 20)
    meta = {"commit": git_commit(), "cpu": cpu_name(), "cores": os.cpu_count(), "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kv_tokens": a.kv_tokens,
            "pin_tokens": pin, "args": vars(a), "servers": {}}
    print(f"# RAG at steady state: SmolLM2-135M-Instruct Q4_1, {meta['cpu']}, {meta['cores']} vCPUs, {meta['date']}, "
          f"commit {meta['commit'][:12]}; {a.docs} documents x ~{a.sentences} sentences, k={a.k}, "
          f"{a.warmup} + {a.queries} queries {a.concurrency} at a time, KV pool {a.kv_tokens} tokens, "
          f"max_tokens {a.max_tokens}", flush=True)

    sym = Symphony(home, kv_memory_mb=mib, extra=("--host-pages", "0", "--user-quota", "100%"))
    meta["servers"]["symphony"] = {"argv": sym.argv, "startup_s": round(sym.startup_s, 1)}
    stack, peer_of = [], {}
    try:
        for name in ("vllm", "llama-server"):
            if name in contenders:
                cm = peers.peer(name, slots=a.concurrency, threads=a.threads, log_dir=tmp,
                                kv_cache_gib=max(1, round(a.kv_tokens * KV_TOKEN_BYTES / 2 ** 30)),
                                ctx_per_slot=max(4096, (a.k + 1) * a.sentences * 16))
                p = cm.__enter__()
                stack.append(cm)
                p.pause()
                peer_of[name] = p
                meta["servers"][name] = p.info()
                print(f"# {p.describe()}", flush=True)

        def fn_for(c):
            if c.startswith("app"):
                args = ["--cache", c] + {"app": ["--policy", "lfu", "--pin-tokens", str(pin)],
                        "app-prefix": ["--policy", "lfu", "--pin-tokens", str(pin), "--compose", "prefix"],
                        "app-retrieve": ["--policy", "lfu", "--pin-tokens", str(pin), "--k", str(a.k)],
                        "app-ttl": [], "app-nocache": ["--no-cache"]}[c] + ["--max-tokens", str(a.max_tokens)]
                return lambda q: lip_query(sym.sock, source, ddir, [] if c == "app-retrieve" else
                                           [names[i] for i in q], qa[q[0]][0], args)
            url, model = {"recompute": (f"http://127.0.0.1:{sym.port_nocache}", sym.model),
                          "lru": (sym.url, sym.model)}.get(c) or (peer_of[c].url, peer_of[c].model)
            return lambda q: http_query(url, model, system, [texts[i] for i in q], qa[q[0]][0], a.max_tokens)

        rows: list[dict] = []
        for r in range(a.rounds):
            for s in skews:
                seed = 1000 * r + (7 if s == "one" else int(s * 100))
                warm = queries(a.docs, a.warmup, s, a.k, seed + 500_000, order)
                qs = queries(a.docs, a.queries, s, a.k, seed, order)
                truth = [qa[q[0]][1] for q in qs]
                shift = r % len(contenders)
                base = None
                for c in contenders[shift:] + contenders[:shift]:
                    p = peer_of.get(c)
                    if p is not None:
                        p.resume()
                    load0 = os.getloadavg()
                    box = peers.BoxLoad()
                    try:
                        if warm:
                            run_block(fn_for(c), warm, a.concurrency)
                        recs, wall = run_block(fn_for(c), qs, a.concurrency)
                    finally:
                        if p is not None:
                            p.pause()
                        if c.startswith("app"):                 # its pinned modules leave the pool to the next
                            clear_cache(sym.sock, c)
                    row = {"skew": s, "round": r, "contender": c, "wall_s": wall, "box": box.stop(),
                           "load_before": load0, "load_after": os.getloadavg(), "queries": qs, "records": recs,
                           "truth": truth}
                    rows.append(row)
                    if c == "recompute":
                        base = recs
                    row["summary"] = summary(recs, wall, truth, None)
                    sm = row["summary"]
                    print(f"  round {r + 1}/{a.rounds} skew {s} {c}: {sm['qps']:.2f} q/s, p50 {sm['latency_p50']:.2f} s, "
                          f"{sm['computed_per_query']:.0f} tokens computed/query, hit {sm['hit'] or 0:.3f}, "
                          f"correct {sm['correct']:.2f} ({len(set(i for q in qs for i in q))} documents)", flush=True)
                for row in rows:                                   # agreement with recompute, same queries
                    if row["skew"] == s and row["round"] == r and base is not None:
                        row["summary"]["same_as_recompute"] = agreement(row["records"], base)
    finally:
        for cm in stack:
            cm.__exit__(None, None, None)
        sym.stop()

    data_path.parent.mkdir(parents=True, exist_ok=True)
    data_path.write_text(json.dumps({"meta": meta, "rows": rows}, separators=(",", ":")))
    print(f"# raw data: {data_path}")
    report(rows, skews, contenders)
    if a.plot:
        plot(rows, skews, contenders, a, meta)
    return 0


def report_file(path: Path, plot_to: str | None) -> int:
    """The tables of a raw data file, every figure recomputed from its queries."""
    d = json.loads(path.read_text())
    meta, rows = d["meta"], d["rows"]
    base = {(r["skew"], r["round"]): r["records"] for r in rows if r["contender"] == "recompute"}
    for r in rows:
        r["summary"] = summary(r["records"], r["wall_s"], r["truth"], base.get((r["skew"], r["round"])))
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    print(f"# {path}: commit {meta['commit'][:12]}, {meta['cpu']}, {meta['cores']} vCPUs, {meta['date']}\n"
          f"# command: {meta['command']}")
    for r in rows:
        print(f"# skew {r['skew']} {r['contender']}: load average before {r['load_before'][0]:.2f}, after "
              f"{r['load_after'][0]:.2f}; box {r['box']}")
    report(rows, skews, contenders)
    if plot_to:
        args = argparse.Namespace(**meta["args"])
        args.plot = plot_to
        plot(rows, skews, contenders, args, meta)
    return 0


def report(rows: list[dict], skews: list, contenders: list[str]) -> None:
    print("\nmedian over rounds (per-round range); latency to the whole answer; tokens computed per query; "
          "hit = prompt tokens reused / prompt tokens; x recompute = queries/s ratio")
    print("| skew | contender | queries/s | x recompute | latency p50 s | p99 s | computed/query | hit | correct "
          "| same as recompute | errors |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for s in skews:
        for c in contenders:
            mine = [x for x in rows if x["skew"] == s and x["contender"] == c]
            base = {x["round"]: x for x in rows if x["skew"] == s and x["contender"] == "recompute"}
            if not mine:
                continue

            def f(key, d=2, xs=mine):
                vals = [x["summary"][key] for x in xs if x["summary"].get(key) is not None]
                return spread(vals, d) if vals else "-"
            ratio = (spread([x["summary"]["qps"] / base[x["round"]]["summary"]["qps"] for x in mine
                             if x["round"] in base]) if base else "-")
            print(f"| {s} | {c} | {f('qps')} | {ratio} | {f('latency_p50')} | {f('latency_p99')} | "
                  f"{f('computed_per_query', 0)} | {f('hit', 3)} | {f('correct')} | {f('same_as_recompute')} | "
                  f"{f('errors', 0)} |")


def plot(rows, skews, contenders, a, meta) -> None:
    plt = pyplot()
    if plt is None:
        return
    skews = sorted(skews, key=lambda x: math.inf if x == "one" else x)     # left to right: more skewed
    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = list(range(len(skews)))
    for c in contenders:
        vals = [[x["summary"]["qps"] for x in rows if x["skew"] == s and x["contender"] == c] for s in skews]
        med = [statistics.median(v) if v else float("nan") for v in vals]
        lo = [m - min(v) if v else 0 for m, v in zip(med, vals)]
        hi = [max(v) - m if v else 0 for m, v in zip(med, vals)]
        ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=c)
    ax.set_xticks(xs, [str(s) for s in skews])
    ax.set_xlabel("Zipf exponent s (rank i drawn ~ i^-s); right = more skewed")
    ax.set_ylabel("queries/s (median, per-round range)")
    ax.set_title(f"RAG, k={a.k}: {a.docs} documents, KV pool {a.kv_tokens} tokens, {a.concurrency} concurrent\n"
                 f"SmolLM2-135M, {meta['cpu'][:40]}, commit {meta['commit'][:10]}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, a.plot)


if __name__ == "__main__":
    sys.exit(main())
