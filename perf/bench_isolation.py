"""Isolation between users over HTTP: one key attacks, another key's request is timed alone and during.

    python perf/bench_isolation.py [--trees before=PATH,after=.] [--attacks streams,prompts,slowloris,noread,lips]
                                   [--rounds 1] [--quick] [--churn] [--json FILE]

Each tree (a checkout of Symphony: ``before`` the code without the per-user shares and the
front door, ``after`` this one) runs `symphony-kernel --http` on the embedded SmolLM2 with its
default flags, two keys with their default limits (alice, bob: 16 requests at once, 600 a
minute).  For each attack, bob's greedy 32-token chat (finish "length") is timed three times
alone and three times while alice attacks from another client address (127.0.0.2..6):

  streams     48 clients of alice's key keep long streamed chats going (400 tokens, temperature
              1); the key admits 16, the rest are answered 429 and ask again 0.2 s later
  prompts     16 clients send distinct ~3,000-token prompts back to back (a prompt flood:
              none cached), max_tokens 1
  slowloris   3,000 connections send a request line and part of the headers, then a header
              line every 2 s (--churn: each one the gateway closes is replaced at once)
  noread      16 streamed chats of 2,000 tokens whose clients read nothing
  lips        32 clients submit a program to /v1/lips back to back

Per attack and tree: bob's median time alone and during (and the ratio; the rule the tests check
is during <= 3x alone + 1 s), bob's requests refused, alice's answers by status, the peak growth of
the kernel's and the gateway's RSS during the attack, and the CPU other processes took (the box
is shared).  Rounds alternate the trees (before, after, before, ...), each on a fresh kernel.
--quick: a third of each attack's size (smoke run).  Needs root (the kernel serves two users).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e" / "gateway"))
from attacks import Flood, SlowHeaders, gateway_pid, never_reading_streams, rss_mib  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point home "
         "water room mother area money story fact month lot right study book eye job word business issue side kind "
         "head house service friend father power hour game line end member law car city community name").split()
BOB_ASKS = [{"role": "user", "content": "Count from 1 to 200, separated by commas."}]
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the machine
def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def _busy() -> int:
    v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return sum(v) - v[3] - v[4]


def _tree_ticks(pid: int) -> int:
    """CPU ticks of ``pid`` and every live descendant, and the reaped children of each."""
    kids: dict = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                kids.setdefault(int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            v = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += int(v[11]) + int(v[12]) + int(v[13]) + int(v[14])
        except (OSError, IndexError):
            pass
        todo += kids.get(p, [])
    return total


class Watch:
    """During an attack: the peak RSS growth of the kernel and the gateway (sampled every
    0.25 s), and the share of all CPUs that processes other than this benchmark and its
    kernel took."""

    def __init__(self, kernel: int, gateway: int):
        self.kernel, self.gateway = kernel, gateway
        self.base = (rss_mib(kernel), rss_mib(gateway))
        self.peak = [0.0, 0.0]
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self.stop.wait(0.25):
            try:
                self.peak[0] = max(self.peak[0], rss_mib(self.kernel) - self.base[0])
                self.peak[1] = max(self.peak[1], rss_mib(self.gateway) - self.base[1])
            except (OSError, AssertionError):
                return

    def __enter__(self):
        self.t0, self.busy0 = time.monotonic(), _busy()
        self.ours0 = _tree_ticks(os.getpid()) + _tree_ticks(self.kernel)
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(5)
        dt = time.monotonic() - self.t0
        ours = _tree_ticks(os.getpid()) + _tree_ticks(self.kernel) - self.ours0
        self.other_cpu = max(0.0, 100.0 * ((_busy() - self.busy0) - ours) / TICK / (dt * (os.cpu_count() or 1)))


# ---------------------------------------------------------------- a kernel of a tree
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kernel:
    """`symphony-kernel --http` of the checkout ``tree``, default flags, keys alice and bob."""

    def __init__(self, tree: Path, work: Path):
        from symphony.gateway.keys import add_key
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        keys = work / "keys.json"
        self.keys = {u: add_key(str(keys), u, u)[0] for u in ("alice", "bob")}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(work / "kernel.log", "w+")
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())",
             "--socket", str(work / "k.sock"), "--http", f"127.0.0.1:{self.port}", "--keys", str(keys)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=tree, start_new_session=True)
        deadline = time.time() + 300
        while "symphony-gateway: serving" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the kernel did not start:\n" + Path(self.log.name).read_text()[-3000:])
            time.sleep(0.2)
        self.gateway = gateway_pid(self.proc.pid)
        r = httpx.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {self.keys['bob']}"}, timeout=30)
        self.model = r.json()["data"][0]["id"]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bob(k: Kernel) -> tuple[float, object]:
    """Bob's chat: (seconds, 200 or what refused it)."""
    t0 = time.monotonic()
    try:
        r = httpx.post(k.url + "/v1/chat/completions", timeout=600, headers={"Authorization": f"Bearer {k.keys['bob']}"},
                       json={"model": k.model, "messages": BOB_ASKS, "max_tokens": 32, "temperature": 0})
        status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return time.monotonic() - t0, status


# ---------------------------------------------------------------- the attacks
def attack(name: str, k: Kernel, scale: float, churn: bool):
    """A context manager running attack ``name`` against ``k``; its ``codes`` say what alice got."""
    alice = k.keys["alice"]
    n = lambda full: max(2, int(full * scale))                                     # noqa: E731
    if name == "streams":
        return Flood(k.url, alice, n(48), lambda i, j: {
            "model": k.model, "stream": True, "max_tokens": 400, "temperature": 1.0,
            "messages": [{"role": "user", "content": f"Write a long story about dragon number {i}-{j}."}]})
    if name == "prompts":
        words = n(3000)

        def prompt(i, j):
            import random
            rng = random.Random(i * 100003 + j)
            return {"model": k.model, "max_tokens": 1, "temperature": 0, "stream": False, "messages": [
                {"role": "user", "content": "Summarize: " + " ".join(rng.choice(WORDS) for _ in range(words))}]}
        return Flood(k.url, alice, 16, prompt)
    if name == "lips":
        prog = {"source": "import time\n\ndef main():\n    time.sleep(0.2)\n"}
        return Flood(k.url, alice, n(32), lambda i, j: prog, path="/v1/lips", addr="127.0.0.6", retry_s=0)
    if name == "slowloris":
        return _Slow(SlowHeaders(k.port, n=n(3000), every=2.0, reconnect=churn, rate=500.0))
    if name == "noread":
        return _NoRead(k, n(16))
    raise ValueError(f"unknown attack {name!r}")


class _Slow:
    def __init__(self, sh: SlowHeaders):
        self.sh, self.stop = sh, threading.Event()

    def __enter__(self):
        self.t = threading.Thread(target=self.sh.run, args=(self.stop,), daemon=True)
        self.t.start()
        deadline = time.monotonic() + 60
        while self.sh.opened < self.sh.n and time.monotonic() < deadline:
            time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join(30)

    @property
    def codes(self):
        return {"opened": self.sh.opened, "closed by the gateway": self.sh.closed_by_server, **self.sh.statuses}


class _NoRead:
    def __init__(self, k: Kernel, n: int):
        self.k, self.n, self.socks = k, n, []

    def __enter__(self):
        body = {"model": self.k.model, "stream": True, "max_tokens": 2000, "temperature": 1.0,
                "messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}]}
        self.socks = never_reading_streams(self.k.port, self.k.keys["alice"], body, self.n)
        return self

    def __exit__(self, *exc):
        for s in self.socks:
            s.close()

    @property
    def codes(self):
        return {"streams not read": self.n}


def one(k: Kernel, name: str, scale: float, churn: bool, times: int) -> dict:
    bob(k)                                                            # warm: bob's program is known
    alone = [bob(k) for _ in range(times)]
    with Watch(k.proc.pid, k.gateway) as w:
        with attack(name, k, scale, churn) as a:
            time.sleep(3.0)
            during = [bob(k) for _ in range(times)]
    return {"alone": statistics.median(t for t, _ in alone), "during": statistics.median(t for t, _ in during),
            "bob_refused": [s for _, s in alone + during if s != 200], "alice": dict(a.codes),
            "kernel_rss_mib": round(w.peak[0]), "gateway_rss_mib": round(w.peak[1]),
            "other_cpu_pct": round(w.other_cpu)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default="after=.", help="NAME=PATH,... checkouts to compare (default after=.)")
    ap.add_argument("--attacks", default="streams,prompts,slowloris,noread,lips")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--times", type=int, default=3, help="bob's requests alone and during each attack (default 3)")
    ap.add_argument("--quick", action="store_true", help="a third of each attack's size")
    ap.add_argument("--churn", action="store_true", help="slowloris: replace each closed connection at once")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_isolation: needs root (the kernel serves two users)", file=sys.stderr)
        return 2
    trees = [(t.split("=", 1)[0], (REPO / t.split("=", 1)[1]).resolve()) for t in a.trees.split(",")]
    names = a.attacks.split(",")
    scale = 1 / 3 if a.quick else 1.0
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs; load average {os.getloadavg()}; scale {scale:.2f}", flush=True)
    results: list = []
    with tempfile.TemporaryDirectory(prefix="bench-iso-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        for r in range(a.rounds):
            for label, tree in trees:
                k = Kernel(tree, Path(tmp) / f"{label}{r}")
                try:
                    for name in names:
                        row = dict(round=r, tree=label, attack=name, **one(k, name, scale, a.churn, a.times))
                        results.append(row)
                        print(json.dumps(row), flush=True)
                        if a.json:
                            Path(a.json).write_text(json.dumps(results, indent=1))
                finally:
                    k.stop()
    print(f"\n# load average after: {os.getloadavg()}")
    print("| attack | tree | bob alone s | bob during s | during / alone | bob refused | alice got | "
          "kernel RSS + MiB | gateway RSS + MiB | other CPU % |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for label, _ in trees:
            rows = [x for x in results if x["attack"] == name and x["tree"] == label]
            al = statistics.median(x["alone"] for x in rows)
            du = statistics.median(x["during"] for x in rows)
            spread = "" if len(rows) < 2 else f" ({min(x['during'] for x in rows):.2f}..{max(x['during'] for x in rows):.2f})"
            refused = sum(len(x["bob_refused"]) for x in rows)
            kinds = sorted({str(s) for x in rows for s in x["bob_refused"]})
            print(f"| {name} | {label} | {al:.2f} | {du:.2f}{spread} | {du / al:.1f}x | "
                  f"{refused}{' (' + ', '.join(kinds) + ')' if kinds else ''} | {rows[-1]['alice']} | "
                  f"{max(x['kernel_rss_mib'] for x in rows)} | {max(x['gateway_rss_mib'] for x in rows)} | "
                  f"{max(x['other_cpu_pct'] for x in rows)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
