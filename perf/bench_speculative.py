"""Speculative decoding (prompt-lookup drafts) vs plain greedy decoding, through the kernel.

    python perf/bench_speculative.py [--rounds 3] [--max-tokens 96] [--gpus 0]

Starts ``symphony-kernel`` in a subprocess on its own socket (as tests/conftest.py's
KernelProc does) and runs the two stock LIPs on the same prompts:
``userland/generate.py`` (one pred call per token) and ``userland/speculative.py``
(one multi-token verification call per draft).  Each round runs, for every prompt,
both programs one after the other (the order alternates between rounds); a run is
timed client-side from the spawn request to the exit event, so both include the
spawn and the prompt's prefill.  tokens/s = generated tokens / that time.  The
texts must be identical (greedy either way); the table gives medians over rounds
and the speedup (median of the per-round ratios).  The raw-continuation prompt's
plain contender is speculative.py with ``--draft 0`` (generate.py always applies
the chat template): one single-token pred call per token, the same loop as generate.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from symphony.client import Client  # noqa: E402

CODE = ('Write the same Python functions for mul and div:\n```python\n'
        'def add(a, b):\n    """Add a and b."""\n    return a + b\n\n'
        'def sub(a, b):\n    """Subtract b from a."""\n    return a - b\n```')
TABLE = ("<table>\n  <tr><td>Alice</td><td>34</td><td>Paris</td></tr>\n"
         "  <tr><td>Bob</td><td>27</td><td>London</td></tr>\n")
PROMPTS = [  # (name, prompt, raw continuation?)
    ("code: copy functions (chat)", CODE, False),
    ("html table (raw continuation)", TABLE, True),
    ("repeat a list (chat)", "Repeat this list exactly three times: apple, banana, cherry, date, "
                             "elderberry, fig, grape.", False),
    ("story, not repetitive (chat)", "Write a short story about a robot who learns to play the violin.", False),
]


class Kernel:
    def __init__(self, tmp: Path, *extra: str):
        self.socket, self.log = str(tmp / "kernel.sock"), tmp / "kernel.log"
        env = dict(os.environ, SYMPHONY_SOCKET=self.socket, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())",
             "--socket", self.socket, *extra], stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
            env=env, cwd=REPO)
        deadline = time.time() + 300
        while "ready on" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("kernel did not start:\n" + self.log.read_text(errors="replace"))
            time.sleep(0.2)

    def run(self, lip: str, args: list[str]) -> tuple[float, list, int]:
        """(seconds from spawn to exit, what the LIP sent, its pred calls as the kernel counted)."""
        source = (REPO / lip).read_text()
        with Client(self.socket, timeout=600) as c:
            t0 = time.perf_counter()
            c.spawn(source, args, filename=Path(lip).name)
            evs = list(c.events())
            dt = time.perf_counter() - t0
            preds = c.ps()["finished"][-1]["preds"]
        assert evs[-1].get("event") == "exit" and evs[-1]["status"] == 0, evs[-3:]
        return dt, [e["data"] for e in evs if e.get("event") == "out"], preds

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--gpus", default=None, help="passed to symphony-kernel (e.g. 0 for cuda:0)")
    a = ap.parse_args()
    extra = ["--kv-memory-mb", "256"] + (["--gpus", a.gpus] if a.gpus is not None else [])
    with tempfile.TemporaryDirectory(prefix="bench-spec-") as tmp:
        k = Kernel(Path(tmp), *extra)
        try:
            res = {name: {"plain": [], "spec": [], "ratio": []} for name, _, _ in PROMPTS}
            info = {}
            for r in range(a.rounds):
                for name, prompt, raw in PROMPTS:
                    plain_lip = ("userland/speculative.py", [prompt, "--raw", "--max-tokens", str(a.max_tokens),
                                                             "--draft", "0"]) if raw else \
                        ("userland/generate.py", [prompt, str(a.max_tokens)])
                    spec_lip = ("userland/speculative.py", [prompt, "--max-tokens", str(a.max_tokens)]
                                + (["--raw"] if raw else []))
                    order = [("plain", plain_lip), ("spec", spec_lip)]
                    out = {}
                    for which, (lip, args) in (order if r % 2 == 0 else order[::-1]):
                        out[which] = k.run(lip, args)
                    stats = out["spec"][1][-1]
                    spec_text = "".join(out["spec"][1][:-1])
                    plain_text = "".join(x for x in out["plain"][1] if isinstance(x, str))
                    assert spec_text == plain_text, (name, spec_text, plain_text)
                    n = stats["tokens"]
                    tp, ts = n / out["plain"][0], n / out["spec"][0]
                    res[name]["plain"].append(tp)
                    res[name]["spec"].append(ts)
                    res[name]["ratio"].append(ts / tp)
                    info[name] = dict(stats, plain_calls=out["plain"][2])
                    print(f"round {r + 1} {name}: plain {tp:.1f} tok/s, speculative {ts:.1f} tok/s "
                          f"({n} tokens, {stats['pred_calls']} pred calls)", file=sys.stderr, flush=True)
        finally:
            k.stop()
    med = statistics.median
    print(f"\nSpeculative (prompt lookup, --ngram 3, adaptive --draft <= 7) vs plain greedy through the kernel; "
          f"--max-tokens {a.max_tokens}, medians of {a.rounds} interleaved rounds; outputs identical.\n")
    print("| text | tokens | pred calls plain / spec | drafts accepted | plain tok/s | speculative tok/s "
          "| speedup |")
    print("|---|---|---|---|---|---|---|")
    for name, _, _ in PROMPTS:
        s, v = info[name], res[name]
        print(f"| {name} | {s['tokens']} | {s['plain_calls']} / {s['pred_calls']} | "
              f"{s['accepted']}/{s['drafted']} | {med(v['plain']):.1f} | {med(v['spec']):.1f} | "
              f"**{med(v['ratio']):.2f}x** |")


if __name__ == "__main__":
    main()
