"""The KV pool committed ahead (``--kv-commit background``) against committed lazily, on memory
the machine has not used before.

    python perf/bench_kv_commit.py [--hog-gb 8] [--rounds 2] [--clients 16] [--activations int8]

On a virtual machine a page the guest has not used before is backed by the host on its first
write, which costs far more than a page the guest used already. Another process holding the
memory used before (a second server on the box, here a "hog") leaves the kernel fresh pages.
This measures, in one run:

  1. what a first write costs a 4 KiB page, on memory used before and on fresh memory (the
     hog's own pages, touched once);
  2. the plain workload of perf/bench_gateway.py (--clients concurrent clients, 2 distinct
     ~400-token prompts each, 32 tokens out, streamed) on a kernel with --kv-commit lazy, then
     on one with the default background commit, each with a 2 GiB pool, each after --hog-gb
     more GiB of fresh memory were taken (so that each kernel starts on fresh memory, not on
     the pages the one before it freed): generated tokens/s per round, the page faults the
     kernel's threads took during the round, and how long the commit took.

Prints medians and the per-round spread (min..max) and the ratio background / lazy, with the
CPU named. Needs about 2 x --hog-gb + 6 GiB of RAM.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway as bg  # noqa: E402
from symphony.engine.hostmem import commit_ended  # noqa: E402

HOG = """
import mmap, signal, sys, time
n = int(float(sys.argv[1]) * 2**30)
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
t = time.perf_counter()
for o in range(0, n, 4096):
    m[o] = 1
print(f"{(time.perf_counter() - t) / (n / 4096) * 1e6:.2f}", flush=True)
signal.pause()
"""


def touch_us(gib: float) -> float:
    """Microseconds a first write of a 4 KiB page costs, over ``gib`` GiB mapped here."""
    n = int(gib * 2**30)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = time.perf_counter()
    for o in range(0, n, 4096):
        m[o] = 1
    us = (time.perf_counter() - t) / (n / 4096) * 1e6
    m.close()
    return us


def hog(gib: float) -> tuple[subprocess.Popen, float]:
    """A process holding ``gib`` GiB it wrote once; (it, microseconds a page cost it)."""
    p = subprocess.Popen([sys.executable, "-c", HOG, str(gib)], stdout=subprocess.PIPE, text=True)
    return p, float(p.stdout.readline())


def faults(pid: int) -> int:
    """Minor page faults the threads of process ``pid`` took so far."""
    total = 0
    for t in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            s = open(t).read()
        except OSError:
            continue
        total += int(s[s.rindex(")") + 2:].split()[7])
    return total


def run_kernel(tmp: Path, commit: str, a) -> dict:
    extra = ("--kv-commit", commit) + (("--activations", a.activations) if a.activations else ())
    sym = bg.Symphony(tmp / commit, kv_memory_mb=2048, nocache=False, extra=extra)
    try:
        line = [x for x in sym.text().splitlines() if commit_ended(x)]
        out = {"commit_log": line[-1].split(": ", 1)[-1] if line else None, "tok_s": [], "faults": []}
        for r in range(a.rounds):
            f0, tally, t0 = faults(sym.proc.pid), bg.Tally(), time.perf_counter()
            asyncio.run(bg.plain(sym.url, sym.model, a.clients, 2, 32, f"{commit}/{r}", 400, tally))
            out["tok_s"].append(tally.tokens / (time.perf_counter() - t0))
            out["faults"].append(faults(sym.proc.pid) - f0)
            if tally.failures:
                out["error"] = tally.error
        return out
    finally:
        sym.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hog-gb", type=float, default=8.0, help="fresh memory taken before each kernel (GiB)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--activations", default="int8", choices=("int8", "auto", ""))
    a = p.parse_args(argv)
    if a.rounds < 1 or a.clients < 1 or a.hog_gb <= 0:
        p.error("--rounds, --clients and --hog-gb must be positive")
    print(f"CPU: {bg.cpu_name()}, {len(os.sched_getaffinity(0))} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; symphony {bg._git_commit()}")
    print(f"a first write, memory used before: {touch_us(1.0):.2f} us a 4 KiB page", flush=True)
    hogs, res = [], {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-kv-commit-", dir="/tmp") as tmp:
            os.chmod(tmp, 0o755)                # a root kernel's gateway runs as another uid
            for commit in ("lazy", "background"):
                h, us = hog(a.hog_gb)
                hogs.append(h)
                print(f"{a.hog_gb:g} GiB taken by another process: {us:.2f} us a page", flush=True)
                res[commit] = r = run_kernel(Path(tmp), commit, a)
                print(f"  --kv-commit {commit:10s} {statistics.median(r['tok_s']):6.1f} tok/s "
                      f"({min(r['tok_s']):.1f}..{max(r['tok_s']):.1f}), page faults a round "
                      f"{statistics.median(r['faults']):,.0f}" + (f"; {r['commit_log']}" if r["commit_log"] else "")
                      + (f"; errors: {r['error']}" if r.get("error") else ""), flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    ratios = [b / l for b, l in zip(res["background"]["tok_s"], res["lazy"]["tok_s"])]
    print(f"background / lazy: {statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) "
          f"at {a.clients} clients, plain")
    return 0


if __name__ == "__main__":
    sys.exit(main())
