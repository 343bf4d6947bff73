"""Routing a skewed RAG workload across N kernels: a discrete-event simulation.

    python perf/sim_routing.py [--quick | --scale] [--kernels 2,4,8,16] [--alphas 0,1.13,1.43,inf]
                               [--policies shipped,random,least,affinity,bounded] [--docs 1000]
                               [--slack 32] [--entries 100000] [--fail F] [--drain D] [--restart-s S]
                               [--capacity 0.05] [--queries 20000] [--load 0.8]
                               [--costs cpu|h200] [--seed 0] [--plot PNG] [--json OUT]

This is a model, not a measurement: no kernel runs, no token is computed.  It asks what a
gateway's routing policy does to prefix hits, recomputation, balance and latency once
several kernels stand behind it, with per-token costs taken from perf/RESULTS.md.

Workload.  --docs documents, each of a length drawn once (uniform in 0.5..1.5 x
--doc-tokens).  A query asks about one document, drawn by popularity with
perf/paper/rag_skew.py's ``draw``: the document of rank i is asked about with probability
~ i^(-1/alpha), a Pareto popularity of index alpha (alpha = inf: uniform; the paper's RAG
skews 1.43 and 1.13; small alpha concentrates the queries).  alpha = 0 is that law's limit:
every query asks about the rank-1 document.  A query prefills its document (unless the
kernel holds it), --question-tokens more, then decodes --answer-tokens.  Arrivals are
Poisson at --load x N / S0 queries/s, where S0 is one query's time alone on a kernel that
holds nothing: the offered load as a fraction of the cluster's capacity without a cache and
without batching.  Every (N, alpha) point gives every policy the same arrivals and the same
documents.

Kernel.  One batch server: when idle, it takes up to max_batch waiting queries (first come
first served) and runs them as one batch, their prefills then their decode steps together;
a query arriving meanwhile waits for the next batch (no continuous batching, so its
latencies run above an iteration-level scheduler's).  A batch of B queries takes
  (uncached document tokens + B x question tokens) / prefill_rate + answer_tokens x step(B),
  step(B) = step(1) + (B - 1) x step_extra      (a line through the two decode figures).
Each kernel keeps an LRU of whole document prefixes, --capacity x --docs documents (counted
in documents, not tokens).  A query whose document is in the LRU when its batch starts is a
hit and prefills only its question; a miss prefills the document and inserts it, evicting
the least recently used.  Two queries on one uncached document in one batch compute it once
(the second forks the first's file).

Costs (--costs), from perf/RESULTS.md:
  cpu   the embedded SmolLM2-135M-Instruct on quantized weights, one thread, Intel Xeon
        2 vCPUs ("Decode on the CPU", 2026-11-24 04:46 UTC): prefill 445.4 tok/s (1,500-token
        prompt), single-stream decode 101.1 tok/s, batch-32 decode 332.4 tok/s; max batch 32;
  h200  the Llama-3.2-1B shape, bfloat16, CUDA graphs on, NVIDIA H200 ("GPU", first loan):
        a 2,000-token prompt in 11 ms, decode 541.3 tok/s at batch 1 and 26,268 tok/s at
        batch 64; max batch 64.

Policies (the gateway's choice of kernel for each query, at its arrival):
  shipped   the router Symphony ships, imported and run as the gateway runs it
            (symphony.gateway.router.RoutingTable): a query is a chat request
            [document message, question message] whose affinity keys are the gateway's
            own (request_keys: chained digests of the messages), remembered where it is
            sent; it follows its document's key unless that kernel has more than --slack
            requests in flight beyond the least loaded (then least loaded, ties in turn);
            the table keeps --entries keys (LRU); in flight is the gateway's count
            (routed, not yet finished), as in kernels.py;
  random    uniform over the kernels;
  least     least-loaded: fewest queries waiting or running (ties broken at random);
  affinity  consistent hashing of the document onto a ring of --vnodes points per kernel;
  bounded   affinity unless the affine kernel is overloaded, then least-loaded.  Overloaded
            is SGLang's router's test of imbalance (both its load gap and its load ratio over
            the least-loaded kernel pass a bound: --bound-abs, --bound-rel), applied to the
            affine kernel rather than to the busiest one.  Load is queries waiting or running.
            The defaults, 2 and 1.5, suit these small batch servers; SGLang's library defaults
            (32 and 1.1) are sized for GPU servers with hundreds of requests in flight.

Faults (--fail F, --drain D, fractions of the run's arrival span): at F kernel 0
dies: its running batch is lost (those queries are counted as lost: their clients get
an error), its waiting queries are routed again at once (a spawn the gateway retries),
its cache is gone, and (shipped) the router takes it out, dropping its keys; it comes
back empty --restart-s later.  At D kernel 1 drains: it takes nothing new, finishes
what it has, and stays out.  Random and least-loaded skip a dead or draining kernel;
affinity and bounded hash to the next live point.

--scale runs the shipped router (and bounded, for comparison) at 16, 128 and 1,000
kernels with documents and queries growing with N (80 documents and 200 queries per
kernel, an LRU of 50 documents each: the shape of the 128-kernel run below), kernel 0
failing at 40 % and kernel 1 draining at 60 %, and measures the
router itself: the mean time of one choose() (this machine, the simulation's own
load), of a take_out() (the table scan when a kernel dies), and the table's size.

Reported per policy, N and alpha, over the queries after the first --warmup fraction: the
prefix-hit rate, document tokens recomputed per query, load balance (busiest kernel's busy
time / the mean), and the p50 / p99 latency (arrival to last answer token).  A row marked
* is overloaded: the last tenth of its queries waited on average over twice as long as the
20-30 % band, so its queue grows with the run and its latencies grow with --queries.  The
plot shows hit rate and p99 latency against N, one column per alpha.  Deterministic for a
given --seed.
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import random
import sys
import time
from bisect import bisect_right
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "paper"))

from common import pyplot, save  # noqa: E402
from rag_skew import draw  # noqa: E402  # the repository's popularity law (rank^(-1/alpha))

sys.path.insert(0, str(HERE.parent))
from symphony.gateway.router import RoutingTable, request_keys  # noqa: E402  # the router the gateway ships

POLICIES = ("shipped", "random", "least", "affinity", "bounded")
GROWING = 2.0                        # the last tenth's mean latency over the 20-30 % band's: * in the tables


@dataclass(frozen=True)
class Costs:
    """Per-token costs of one kernel: prefill rate and a linear decode-step time."""
    name: str
    prefill_tok_s: float             # prompt tokens/s
    step1_s: float                   # one decode step at batch 1
    step_extra_s: float              # each further sequence in a decode step
    max_batch: int
    source: str

    @classmethod
    def from_rates(cls, name: str, prefill_tok_s: float, decode1_tok_s: float, decode_b_tok_s: float,
                   b: int, source: str) -> "Costs":
        s1, sb = 1.0 / decode1_tok_s, b / decode_b_tok_s
        return cls(name, prefill_tok_s, s1, (sb - s1) / (b - 1), b, source)

    def step(self, b: int) -> float:
        return self.step1_s + (b - 1) * self.step_extra_s

    def batch_time(self, prefill_tokens: int, b: int, answer_tokens: int) -> float:
        return prefill_tokens / self.prefill_tok_s + answer_tokens * self.step(b)


COSTS = {
    "cpu": Costs.from_rates("cpu", 445.4, 101.1, 332.4, 32,
                            "perf/RESULTS.md, Decode on the CPU, 2026-11-24 04:46 UTC: SmolLM2-135M quantized, "
                            "Intel Xeon 2 vCPUs, one thread: prefill 445.4 tok/s, decode 101.1 tok/s (batch 1), "
                            "332.4 tok/s (batch 32)"),
    "h200": Costs.from_rates("h200", 2000 / 0.011, 541.3, 26268.0, 64,
                             "perf/RESULTS.md, GPU, first loan: Llama-3.2-1B shape bf16 on an H200: a 2,000-token "
                             "prompt in 11 ms, decode 541.3 tok/s (batch 1), 26,268 tok/s (batch 64)"),
}


@dataclass(frozen=True)
class Workload:
    doc_tokens: np.ndarray           # [n_docs] int: each document's prefix length
    arrivals: np.ndarray             # [n_queries] float s, increasing
    docs: list                       # [n_queries] the document each query asks about
    question_tokens: int
    answer_tokens: int


@dataclass(frozen=True)
class Bound:
    """SGLang's imbalance test: the gap and the ratio to the least-loaded kernel both pass."""
    abs: int = 2
    rel: float = 1.5


@dataclass(frozen=True)
class Faults:
    """When kernel 0 fails and kernel 1 drains, as fractions of the arrival span (None: never)."""
    fail: float | None = None
    drain: float | None = None
    restart_s: float = 30.0


@dataclass(frozen=True)
class Shipped:
    """The shipped router's settings (symphony-gateway --affinity-slack, --affinity-entries)."""
    slack: int = 32
    entries: int = 100_000


@dataclass
class Result:
    policy: str
    n_kernels: int
    kernel: np.ndarray               # [Q] int: where each query ran
    end: np.ndarray                  # [Q] float s: its last answer token
    hit: np.ndarray                  # [Q] bool: its document was held when its batch started
    recomputed: np.ndarray           # [Q] int: document tokens it prefilled
    served: np.ndarray               # [Q] int: how many times it was served (must be 1)
    busy: np.ndarray                 # [N] float s: each kernel's time in batches
    max_lru: int                     # the most documents any kernel's LRU held
    router: dict                     # shipped: choose_us, take_out_ms, entries

    def summary(self, w: Workload, warmup: float) -> dict:
        m = slice(int(warmup * len(w.arrivals)), None)
        all_lat = self.end - w.arrivals
        ok = ~np.isnan(all_lat)
        lat = all_lat[m][ok[m]]
        q = len(all_lat)
        a, b = all_lat[q - q // 10:], all_lat[q // 5:q * 3 // 10]
        growing = np.nanmean(a) > GROWING * np.nanmean(b)
        return {"policy": self.policy, "n": self.n_kernels,
                "hit": float(self.hit[m].mean()),
                "recomputed": float(self.recomputed[m].mean()),
                "balance": float(self.busy.max() / self.busy.mean()),
                "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
                "lost": int((self.served == 0).sum()), "growing": bool(growing), **self.router}


def workload(n_docs: int, n_queries: int, alpha: float, n_kernels: int, load: float, costs: Costs,
             doc_tokens: int = 300, question_tokens: int = 20, answer_tokens: int = 16, seed: int = 0) -> Workload:
    """The queries of one (N, alpha) point: document lengths and unit interarrivals depend on
    ``seed`` alone, the documents on ``seed`` and alpha, the rate on N and ``load``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(doc_tokens // 2, doc_tokens * 3 // 2 + 1, n_docs)
    unit_gaps = rng.exponential(1.0, n_queries)
    s0 = costs.batch_time(int(lengths.mean()) + question_tokens, 1, answer_tokens)
    rate = load * n_kernels / s0
    arrivals = np.cumsum(unit_gaps) / rate
    return Workload(lengths, arrivals, pick_docs(n_docs, n_queries, alpha, seed), question_tokens, answer_tokens)


def pick_docs(n_docs: int, n: int, alpha: float, seed: int) -> list:
    """rag_skew's draw; alpha = 0, its limit, puts every query on the rank-1 document
    (the one the same seed's shuffle puts first)."""
    if alpha == 0:
        order = list(range(n_docs))
        random.Random(seed).shuffle(order)
        return [order[0]] * n
    return draw(n_docs, n, alpha, seed)


def simulate(w: Workload, n_kernels: int, policy: str, costs: Costs, capacity: int,
             bound: Bound = Bound(), vnodes: int = 64, seed: int = 0, faults: Faults = Faults(),
             shipped: Shipped = Shipped()) -> Result:
    """Run every query of ``w`` through ``n_kernels`` batch servers under ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {POLICIES}")
    return _Sim(w, n_kernels, policy, costs, capacity, bound, vnodes, seed, faults, shipped).run()


def sweep(a) -> list[dict]:
    """Every (alpha, N, policy) point of the command line's arguments, summarised."""
    costs = COSTS[a.costs]
    capacity = max(1, round(a.capacity * a.docs))
    rows = []
    for alpha in a.alphas:
        for n in a.kernels:
            w = workload(a.docs, a.queries, alpha, n, a.load, costs, a.doc_tokens, a.question_tokens,
                         a.answer_tokens, a.seed)
            for p in a.policies:
                r = simulate(w, n, p, costs, capacity, Bound(a.bound_abs, a.bound_rel), a.vnodes, a.seed,
                             Faults(a.fail, a.drain, a.restart_s), Shipped(a.slack, a.entries))
                rows.append({"alpha": alpha, **r.summary(w, a.warmup)})
    return rows


def table(rows: list[dict]) -> str:
    """Markdown tables, one per alpha."""
    out = []
    for alpha in dict.fromkeys(r["alpha"] for r in rows):
        out += [f"\nalpha = {label(alpha)}\n",
                "| N | policy | prefix hits | recomputed tok/query | busy max/mean | p50 s | p99 s | lost |",
                "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["alpha"] == alpha:
                star = " *" if r["growing"] else ""
                out.append(f"| {r['n']} | {r['policy']} | {100 * r['hit']:.1f} % | {r['recomputed']:.0f} | "
                           f"{r['balance']:.2f} | {r['p50']:.3g} | {r['p99']:.3g}{star} | {r['lost']} |")
    shipped = [r for r in rows if r["policy"] == "shipped"]
    if shipped:
        out += ["\nThe shipped router itself (this machine, inside the simulation):\n",
                "| alpha | N | choose() mean µs | choose() p99 µs | take_out() ms | affinity entries | "
                "routed by affinity | spilled (busy) |", "|---|---|---|---|---|---|---|---|"]
        for r in shipped:
            out.append(f"| {label(r['alpha'])} | {r['n']} | {r['choose_us']:.1f} | {r['choose_p99_us']:.1f} | "
                       f"{r['take_out_ms']:.2f} | {r['entries']} | {100 * r['affinity']:.1f} % | "
                       f"{100 * r['spilled']:.1f} % |")
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    alphas = list(dict.fromkeys(r["alpha"] for r in rows))
    fig, axes = plt.subplots(2, len(alphas), figsize=(3.2 * len(alphas), 5.6), squeeze=False, sharex=True)
    for j, alpha in enumerate(alphas):
        for p in dict.fromkeys(r["policy"] for r in rows):
            pts = [r for r in rows if r["alpha"] == alpha and r["policy"] == p]
            ns = [r["n"] for r in pts]
            axes[0][j].plot(ns, [100 * r["hit"] for r in pts], marker="o", label=p)
            axes[1][j].plot(ns, [r["p99"] for r in pts], marker="o", label=p)
        axes[0][j].set_title(f"alpha = {label(alpha)}", fontsize=9)
        axes[0][j].set_ylim(0, 102)
        axes[1][j].set_xlabel("kernels N")
        axes[1][j].set_yscale("log")
        lo, hi = axes[1][j].get_ylim()
        axes[1][j].yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
        minor = plt.FuncFormatter(lambda y, _: f"{y:g}") if hi < 10 * lo else plt.NullFormatter()
        axes[1][j].yaxis.set_minor_formatter(minor)  # label minor ticks within a decade only
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("prefix hits, %")
    axes[1][0].set_ylabel("p99 latency, s")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def label(alpha: float) -> str:
    return "inf (uniform)" if math.isinf(alpha) else f"{alpha:g}"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="N 2,8; 300 documents, 2,000 queries")
    ap.add_argument("--scale", action="store_true",
                    help="the shipped router and bounded at 16, 128, 1000 kernels, 80 documents, 200 queries and an "
                         "LRU of 50 documents per kernel, alpha 1.13, kernel 0 failing at 40 %% and kernel 1 "
                         "draining at 60 %%")
    ap.add_argument("--slack", type=int, default=Shipped.slack, help="shipped: --affinity-slack")
    ap.add_argument("--entries", type=int, default=Shipped.entries, help="shipped: --affinity-entries")
    ap.add_argument("--fail", type=float, default=None, help="kernel 0 fails at this fraction of the run")
    ap.add_argument("--drain", type=float, default=None, help="kernel 1 drains at this fraction of the run")
    ap.add_argument("--restart-s", type=float, default=30.0, help="a failed kernel is back after this long")
    ap.add_argument("--kernels", default="2,4,8,16")
    ap.add_argument("--alphas", default="0,1.13,1.43,inf")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--capacity", type=float, default=0.05, help="each kernel's LRU, a fraction of --docs")
    ap.add_argument("--queries", type=int, default=20000)
    ap.add_argument("--load", type=float, default=0.8, help="offered load / the cluster's uncached capacity")
    ap.add_argument("--doc-tokens", type=int, default=300, help="mean document length")
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--costs", choices=sorted(COSTS), default="cpu")
    ap.add_argument("--bound-abs", type=int, default=Bound.abs)
    ap.add_argument("--bound-rel", type=float, default=Bound.rel)
    ap.add_argument("--vnodes", type=int, default=64, help="ring points per kernel (affinity)")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of queries left out of the figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=str(HERE / "sim_routing.png"), help="PNG path; '' for none")
    ap.add_argument("--json", default=None)
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.quick:
        a.kernels, a.docs, a.queries = "2,8", 300, 2000
    if a.scale:
        return scale(a)
    a.kernels = [int(x) for x in a.kernels.split(",")]
    a.alphas = [float(x) for x in a.alphas.split(",")]
    a.policies = [p for p in a.policies.split(",") if p]
    if set(a.policies) - set(POLICIES) or not a.policies:
        ap.error(f"--policies from {POLICIES}")
    if any(n < 1 for n in a.kernels) or any(x < 0 for x in a.alphas) or a.docs < 2 or a.queries < 10:
        ap.error("--kernels >= 1, --alphas >= 0 (inf for uniform), --docs >= 2, --queries >= 10")
    if not (0 < a.capacity and 0 < a.load and 0 <= a.warmup < 1):
        ap.error("--capacity > 0, --load > 0, 0 <= --warmup < 1")
    costs = COSTS[a.costs]
    head = (f"# sim_routing (a simulation, not a measurement): {a.docs} documents of ~{a.doc_tokens} tokens, "
            f"LRU {a.capacity:g} of them per kernel, {a.queries} Poisson queries at load {a.load:g}, "
            f"{a.question_tokens} question + {a.answer_tokens} answer tokens, batch server (max {costs.max_batch}), "
            f"bound abs {a.bound_abs} rel {a.bound_rel:g}, seed {a.seed}\n# costs {a.costs}: {costs.source}")
    print(head, flush=True)
    rows = sweep(a)
    print(table(rows))
    if any(r["growing"] for r in rows):
        print(f"\n* overloaded: the last tenth of the queries waited over {GROWING:g}x as long as the 20-30 % band; "
              "the queue grows with the run, so these latencies grow with --queries")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.plot:
        plot(rows, a.plot, f"Routing a skewed RAG workload (simulation; costs: {a.costs}, load {a.load:g}, "
                           f"LRU {a.capacity:g} of {a.docs} documents per kernel)")
    return 0


def scale(a) -> int:
    """--scale: each N with its own documents and queries (see the module docstring)."""
    a.alphas, a.policies = [1.13], ["shipped", "bounded"]
    a.fail, a.drain = (0.4 if a.fail is None else a.fail), (0.6 if a.drain is None else a.drain)
    costs, rows = COSTS[a.costs], []
    print(f"# sim_routing --scale (a simulation, not a measurement): per kernel 80 documents of ~{a.doc_tokens} "
          f"tokens, an LRU of 50 of them, 200 Poisson queries at load {a.load:g}; alpha 1.13; "
          f"kernel 0 fails at {a.fail:g} (back {a.restart_s:g} s later), kernel 1 drains at {a.drain:g}; "
          f"shipped slack {a.slack}, entries {a.entries}\n# costs {a.costs}: {costs.source}", flush=True)
    for n in (16, 128, 1000):
        docs, queries = 80 * n, 200 * n
        w = workload(docs, queries, 1.13, n, a.load, costs, a.doc_tokens, a.question_tokens, a.answer_tokens, a.seed)
        for p in a.policies:
            r = simulate(w, n, p, costs, 50, Bound(a.bound_abs, a.bound_rel), a.vnodes,
                         a.seed, Faults(a.fail, a.drain, a.restart_s), Shipped(a.slack, a.entries))
            rows.append({"alpha": 1.13, **r.summary(w, a.warmup)})
            print(f"# N={n} {p} done", file=sys.stderr, flush=True)
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


# -- helpers ----------------------------------------------------------------------------------------


class _Ring:
    """Consistent hashing: ``vnodes`` points per kernel on a 64-bit ring; a document goes
    to the first point at or after its own hash."""

    def __init__(self, n: int, vnodes: int):
        pts = sorted((_h(f"kernel-{k}-{v}"), k) for k in range(n) for v in range(vnodes))
        self.keys = [p for p, _ in pts]
        self.owner = [k for _, k in pts]

    def __call__(self, doc: int, alive=None) -> int:
        i = bisect_right(self.keys, _h(f"doc-{doc}"))
        for j in range(len(self.owner)):                 # the first live kernel at or after it
            k = self.owner[(i + j) % len(self.owner)]
            if alive is None or alive[k]:
                return k
        raise RuntimeError("no live kernel")


def _h(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


class _Sim:
    """The event loop: arrivals in order; before each, every batch end and fault by then."""

    def __init__(self, w, n, policy, costs, capacity, bound, vnodes, seed, faults, shipped):
        self.w, self.n, self.policy, self.costs, self.cap, self.bound = w, n, policy, costs, capacity, bound
        self.rng = random.Random(f"{seed}-{n}-{policy}")
        self.ring = _Ring(n, vnodes)
        self.queue = [deque() for _ in range(n)]
        self.running = [0] * n                           # queries in each kernel's current batch
        self.batch_seq = [0] * n                         # the seq of each kernel's current batch
        self.lru = [OrderedDict() for _ in range(n)]
        self.alive = [True] * n                          # takes new queries (not dead, not draining)
        self.busy = np.zeros(n)
        self.ends: list = []                             # heap of (end, seq, kernel, batch)
        self.seq = 0
        self.cancelled: set = set()                      # batches lost with their kernel
        q = len(w.arrivals)
        self.kernel = np.full(q, -1)
        self.end = np.full(q, np.nan)
        self.hit = np.zeros(q, bool)
        self.recomputed = np.zeros(q, np.int64)
        self.served = np.zeros(q, np.int64)
        self.max_lru = 0
        span = float(w.arrivals[-1])
        self.faults = []                                 # (time, what, kernel), in time order
        if faults.fail is not None and n > 1:
            self.faults.append((faults.fail * span, "fail", 0))
        if faults.drain is not None and n > 2:
            self.faults.append((faults.drain * span, "drain", 1))
        self.faults.sort()
        self.restart_s = faults.restart_s
        self.table = RoutingTable(n, shipped.entries, shipped.slack) if policy == "shipped" else None
        self.keys: dict = {}                             # query -> its affinity keys
        self.why: Counter = Counter()
        self.choose_ns: list = []
        self.take_out_ms = 0.0

    def run(self) -> Result:
        for i, t in enumerate(self.w.arrivals.tolist()):
            self._advance(t)
            self._route_in(i, t)
        self._advance(math.inf)
        router = {}
        if self.table is not None:
            ns = np.array(self.choose_ns) / 1e3
            total = max(1, sum(self.why.values()))
            router = {"choose_us": float(ns.mean()), "choose_p99_us": float(np.percentile(ns, 99)),
                      "take_out_ms": self.take_out_ms, "entries": len(self.table.affinity),
                      "affinity": self.why["affinity"] / total, "spilled": self.why["spilled"] / total}
        return Result(self.policy, self.n, self.kernel, self.end, self.hit, self.recomputed, self.served,
                      self.busy, self.max_lru, router)

    def _advance(self, t: float) -> None:
        """Every batch end and fault up to ``t``, in time order."""
        while True:
            te = self.ends[0][0] if self.ends else math.inf
            tf = self.faults[0][0] if self.faults else math.inf
            if min(te, tf) > t or min(te, tf) == math.inf:
                return
            if tf < te:
                self._fault(*self.faults.pop(0))
            else:
                self._finish(*heapq.heappop(self.ends))

    def _route_in(self, i: int, t: float) -> None:
        k = self._route(i, self.w.docs[i])
        self.kernel[i] = k
        self.queue[k].append(i)
        if not self.running[k]:
            self._start(k, t)

    def _load(self, k: int) -> int:
        return len(self.queue[k]) + self.running[k]

    def _least(self) -> int:
        loads = [self._load(k) if self.alive[k] else math.inf for k in range(self.n)]
        lo = min(loads)
        ties = [k for k, x in enumerate(loads) if x == lo]
        return ties[0] if len(ties) == 1 else self.rng.choice(ties)

    def _route(self, i: int, doc: int) -> int:
        if self.policy == "shipped":
            return self._shipped(i, doc)
        if self.policy == "random":
            return self.rng.choice([k for k in range(self.n) if self.alive[k]])
        if self.policy == "least":
            return self._least()
        k = self.ring(doc, self.alive)
        if self.policy == "bounded":
            lo = min(self._load(j) for j in range(self.n) if self.alive[j])
            mine = self._load(k)
            if mine - lo > self.bound.abs and mine > self.bound.rel * lo:
                return self._least()
        return k

    def _shipped(self, i: int, doc: int) -> int:
        keys = self.keys.get(i)
        if keys is None:                                 # the gateway's keys of a chat request
            req = {"mode": "chat", "cache": {"dir": "/shared/serve-cache", "trust": []},
                   "messages": [{"role": "system", "content": f"document {doc}"},
                                {"role": "user", "content": f"question {i}"}]}
            keys = self.keys[i] = request_keys(req)
        t0 = time.perf_counter_ns()
        k, why = self.table.choose(keys)
        self.choose_ns.append(time.perf_counter_ns() - t0)
        followed = any(self.table.affinity.get(key) is not None for key in keys)
        self.why["spilled" if why == "least_loaded" and followed else why] += 1
        self.table.begin(k)
        self.table.remember(keys, k)
        return k

    def _fault(self, t: float, what: str, k: int) -> None:
        if what == "restart":
            self.alive[k] = True
            if self.table is not None:
                self.table.put_back(k)
            return
        self.alive[k] = False
        if self.table is not None:
            t0 = time.perf_counter()
            self.table.take_out(k)
            self.take_out_ms = max(self.take_out_ms, 1e3 * (time.perf_counter() - t0))
        if what == "drain":
            return                                       # it finishes what it has, then stays out
        if self.running[k]:                              # its batch is lost with it
            self.cancelled.add(self.batch_seq[k])
            self.running[k] = 0
        waiting = list(self.queue[k])
        self.queue[k].clear()
        self.lru[k].clear()
        if self.table is not None:                       # the requests it had are over for the table
            self.table.in_flight[k] = 0
        for i in waiting:                                # spawns the gateway retries elsewhere
            self._route_in(i, t)
        bisect_insert(self.faults, (t + self.restart_s, "restart", k))

    def _start(self, k: int, t: float) -> None:
        q, lru, w = self.queue[k], self.lru[k], self.w
        batch = [q.popleft() for _ in range(min(len(q), self.costs.max_batch))]
        prefill = len(batch) * w.question_tokens
        for i in batch:
            d = w.docs[i]
            if d in lru:
                lru.move_to_end(d)
                self.hit[i] = True
            else:
                n = int(w.doc_tokens[d])
                self.recomputed[i] = n
                prefill += n
                lru[d] = True
                if len(lru) > self.cap:
                    lru.popitem(last=False)
        self.max_lru = max(self.max_lru, len(lru))
        dur = self.costs.batch_time(prefill, len(batch), w.answer_tokens)
        self.busy[k] += dur
        self.running[k] = len(batch)
        self.seq += 1
        self.batch_seq[k] = self.seq
        heapq.heappush(self.ends, (t + dur, self.seq, k, batch))

    def _finish(self, t: float, seq: int, k: int, batch: list) -> None:
        if seq in self.cancelled:                        # lost with its kernel
            return
        self.end[batch] = t
        np.add.at(self.served, batch, 1)
        if self.table is not None:
            for _ in batch:
                self.table.end(k)
        self.running[k] = 0
        if self.queue[k]:
            self._start(k, t)


def bisect_insert(events: list, ev: tuple) -> None:
    events.insert(bisect_right(events, ev), ev)


if __name__ == "__main__":
    sys.exit(main())
