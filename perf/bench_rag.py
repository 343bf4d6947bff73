"""userland/rag.py with its KV policy (document modules kept as files) vs --no-cache.

    python perf/bench_rag.py [--docs 8] [--sentences 24] [--questions 4] [--rounds 3]
                             [--k 2] [--max-tokens 16] [--kv-memory-mb 256]

Starts ``symphony-kernel`` in a subprocess on its own socket (as tests/conftest.py's
KernelProc does) and writes --docs synthetic documents of --sentences sentences
each (about 12 tokens a sentence) into a temporary directory.  Every question
names one document's subject, so BM25 ranks it first; --k documents are used.

The LIP runs through the Python client (spawn, events until exit), timed from
the spawn request to the exit event; client start-up is not included.  One
cold pass with the policy comes first (it computes and names the instruction
and the documents) and is reported on its own.  Then --rounds rounds, each
running every question once with the policy and once with --no-cache, the
order of the two alternating from round to round.  Figures are medians over
all runs of a contender; the ratio is no-cache time / cached time per question.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from symphony.client import Client  # noqa: E402

SYL = ["ka", "lo", "mir", "ten", "vas", "qu", "dor", "bel", "zu", "rin", "fa", "gol", "ny", "sep"]
VERBS = ["grows", "sells", "collects", "repairs", "paints", "studies", "guards", "trades", "builds", "measures"]
NOUNS = ["copper lanterns", "river stones", "glass bells", "wool maps", "silver keys", "clay owls",
         "old clocks", "blue kites", "salt jars", "cedar boxes", "iron gears", "paper boats"]
PLACES = ["the northern valley", "the harbour town", "the high plateau", "the salt marsh", "the old city",
          "the eastern forest", "the canal district", "the island chain"]


def make_docs(n: int, sentences: int, seed: int = 0) -> dict[str, tuple[str, str]]:
    """{filename: (subject, text)}: each document is about one invented subject."""
    rnd = random.Random(seed)
    docs = {}
    while len(docs) < n:
        name = "".join(rnd.choice(SYL) for _ in range(3)).capitalize()
        lines = [f"This report describes {name}."]
        for _ in range(sentences - 1):
            lines.append(f"{name} {rnd.choice(VERBS)} {rnd.randint(2, 900)} {rnd.choice(NOUNS)} "
                         f"in {rnd.choice(PLACES)} every {rnd.choice(['spring', 'winter', 'week', 'year'])}.")
        docs[f"{name.lower()}.txt"] = (name, " ".join(lines))
    return docs


class Kernel:
    def __init__(self, tmp: Path, kv_memory_mb: int):
        # the kernel's own directory, beside the documents': a kernel refuses read grants under
        # the directory of its socket
        home = tmp / "kernel"
        home.mkdir(exist_ok=True)
        self.socket = str(home / "kernel.sock")
        self.log = open(home / "kernel.log", "w+")
        env = dict(os.environ, SYMPHONY_SOCKET=self.socket, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())",
             "--socket", self.socket, "--kv-memory-mb", str(kv_memory_mb)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        deadline = time.time() + 300
        while "ready on" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("kernel did not start:\n" + Path(self.log.name).read_text()[-3000:])
            time.sleep(0.2)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_rag(sock: str, source: str, docs: str, args: list[str]) -> tuple[float, dict, str]:
    """(seconds from spawn to exit, the stats line, the answer)."""
    with Client(sock) as c:
        t0 = time.perf_counter()
        c.spawn(source, ["--docs", docs, *args], filename="rag.py", grants={"http": [], "read": [docs]})
        evs = list(c.events(timeout=600))
        dt = time.perf_counter() - t0
    if evs[-1].get("status") != 0:
        raise RuntimeError(f"rag.py failed: {evs}")
    outs = [e["data"] for e in evs if e["event"] == "out"]
    return dt, outs[-1], "".join(o for o in outs if isinstance(o, str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--sentences", type=int, default=24)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-memory-mb", type=int, default=256)
    a = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-rag-"))
    ddir = tmp / "docs"
    ddir.mkdir()
    docs = make_docs(a.docs, a.sentences)
    for fname, (_, text) in docs.items():
        (ddir / fname).write_text(text)
    subjects = [s for s, _ in docs.values()][:a.questions]
    questions = [f"Which lanterns does {s} sell in the harbour town?" for s in subjects]
    source = (REPO / "userland/rag.py").read_text()
    common = ["--k", str(a.k), "--max-tokens", str(a.max_tokens)]
    modes = {"KV policy (kept modules)": common, "--no-cache (recompute)": common + ["--no-cache"]}

    print(f"starting the kernel ({tmp}/kernel/kernel.log) ...", file=sys.stderr)
    k = Kernel(tmp, a.kv_memory_mb)
    try:
        cold = []
        for q in questions:                                  # cold: modules computed and named
            dt, st, _ = run_rag(k.socket, source, str(ddir), common + [q])
            cold.append((dt, st))
        times = {m: [] for m in modes}
        computed = {m: [] for m in modes}
        reused = {m: [] for m in modes}
        answers = {m: {} for m in modes}
        for r in range(a.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for q in questions:
                for m in order:
                    dt, st, ans = run_rag(k.socket, source, str(ddir), modes[m] + [q])
                    times[m].append(dt)
                    computed[m].append(st["prefill_computed"])
                    reused[m].append(st["prefill_reused"])
                    answers[m].setdefault(q, ans)
            print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    finally:
        k.stop()

    cached, base = list(modes)
    same = sum(answers[cached][q] == answers[base][q] for q in questions)
    doc_tokens = statistics.median(st["prefill_computed"] + st["prefill_reused"] for _, st in cold)
    print("\n### userland/rag.py: kept document KV files vs --no-cache\n")
    print(f"{a.docs} documents of {a.sentences} sentences, k={a.k} documents per question "
          f"(median prompt {doc_tokens:.0f} tokens), {a.max_tokens} answer tokens at most, "
          f"{len(questions)} questions x {a.rounds} interleaved rounds; CPU kernel, embedded SmolLM2-135M.\n")
    print("| contender | s / question (median) | questions / s | prefill computed | prefill reused |")
    print("|---|---|---|---|---|")
    cold_t = statistics.median(dt for dt, _ in cold)
    print(f"| KV policy, cold (first use: modules computed and named) | {cold_t:.2f} | {1 / cold_t:.2f} | "
          f"{statistics.median(st['prefill_computed'] for _, st in cold):.0f} | "
          f"{statistics.median(st['prefill_reused'] for _, st in cold):.0f} |")
    for m in modes:
        t = statistics.median(times[m])
        print(f"| {m} | {t:.2f} | {1 / t:.2f} | {statistics.median(computed[m]):.0f} | "
              f"{statistics.median(reused[m]):.0f} |")
    ratio = statistics.median(times[base]) / statistics.median(times[cached])
    print(f"\n**Throughput, KV policy / no-cache: {ratio:.2f}x** "
          f"(identical answers: {same}/{len(questions)} questions).")
    print(json.dumps({"ratio": ratio, "times": times}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
