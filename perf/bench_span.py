"""Across kernels: what moving a KV file costs, against recomputing it, and how long a gateway
takes to fail over from a remote kernel.

    python perf/bench_span.py [--tokens 1000,4000] [--rounds 5] [--kv-memory-mb 1024] [--model PATH]
                              [--failover-rounds 3] [--only move,failover]

Two kernels on the same model (default: the embedded SmolLM2-135M, Q4_1 GGUF; its KV is
float32 on a CPU, 92,160 bytes a token), each also listening on TLS (loopback, a self-signed
certificate, the shared-secret handshake).

  move      a file of N tokens made on kernel A (a LIP prefills it), then per round:
            export from A + import into B, through the Unix sockets and through TLS
            (symphony.client), and, as the baseline in the same round, B recomputing the
            same N tokens (a LIP's prefill of them, timed inside the LIP).  Reported:
            median and spread (min..max) of the move's milliseconds, MB/s (file bytes /
            seconds), ms per 1,000 tokens, and recompute / move.
  failover  a gateway in front of A and B (tls://); a client sends short completions one
            after another; B's process is killed (SIGKILL: its port answers RST at once).
            Reported: the latency of the requests just after the kill (a spawn that finds B
            gone is retried on A), the time until the gateway shows B out of rotation, and
            whether any request failed.  (A host that vanishes without a RST costs the
            connect timeout instead, symphony/gateway/kernel.py CONNECT_TIMEOUT_S, 10 s:
            stated, not measured here.)

The CPU, its load average and the share of the CPUs other processes took (the box is shared)
are printed with the figures.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

from bench_gateway import cpu_name, free_port  # noqa: E402
from bench_kernel import CpuWatch  # noqa: E402

KERNEL = [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())"]
MAKE = '''from symphony.lip import kv, pred, send
def main(path, n):
    f = kv.create(path)
    pred(f, [(i * 7919) % 9000 + 10 for i in range(int(n))], output="argmax")
    f.close()
    send("made")
'''
PREFILL = '''import time
from symphony.lip import kv, pred, send
def main(n):
    toks = [(i * 7919) % 9000 + 10 for i in range(int(n))]
    with kv.create() as f:
        t0 = time.perf_counter()
        pred(f, toks, output="argmax")
        send(time.perf_counter() - t0)
'''


class Kernel:
    def __init__(self, d: Path, pki: dict, args, *extra):
        d.mkdir(parents=True, exist_ok=True)
        self.socket = str(d / "k.sock")
        self.log = open(d / "kernel.log", "w+")
        model = ["--model", args.model] if args.model else []
        self.proc = subprocess.Popen([*KERNEL, "--socket", self.socket, "--kv-memory-mb", str(args.kv_memory_mb),
                                      "--listen", "127.0.0.1:0", "--listen-secret", pki["secret"],
                                      "--listen-tls-cert", pki["cert"], "--listen-tls-key", pki["key"], *model, *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=dict(os.environ, PYTHONPATH=str(REPO)))
        deadline = time.time() + 300
        while "ready on" not in self.text():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(self.text()[-3000:])
            time.sleep(0.3)
        self.address = re.search(r"listening on (tls://\S+)", self.text()).group(1)

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def client(self, pki=None, user="bench"):
        from symphony.client import Client
        from symphony.ipc.transport import Credentials
        if pki is None:
            return Client(self.socket, user=user, timeout=600)
        return Client(self.address, user=user, timeout=600, credentials=Credentials.load(pki["secret"], ca=pki["ca"]))

    def run(self, src, *args):
        with self.client() as c:
            c.spawn(src, [str(a) for a in args])
            evs = list(c.events())
        if evs[-1].get("status") != 0:
            raise RuntimeError(evs)
        return [e["data"] for e in evs if e["event"] == "out"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_pki(d: Path) -> dict:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "2", "-subj", "/CN=kernel", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=d, check=True, capture_output=True)
    s = d / "secret"
    s.write_text(os.urandom(24).hex())
    s.chmod(0o600)
    return {"cert": str(d / "cert.pem"), "key": str(d / "key.pem"), "ca": str(d / "cert.pem"), "secret": str(s)}


def spread(xs) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}..{max(xs):.1f})"


def bench_move(a: Kernel, b: Kernel, pki: dict, args) -> None:
    print("\n## Moving a KV file between two kernels (export + import) vs recomputing it there\n", flush=True)
    print("| tokens | file MB | path | move ms | MB/s | ms per 1k tokens | recompute ms | recompute / move | "
          "others' CPU |", "|---|---|---|---|---|---|---|---|---|", sep="\n", flush=True)
    watch = CpuWatch(a.proc.pid, b.proc.pid)
    for n in args.tokens:
        path = f"/home/bench/doc-{n}.kv"
        a.run(MAKE, path, n)
        results = {"unix": [], "tls": []}
        recompute, size, others = [], 0, []
        for r in range(args.rounds):
            watch.start()
            for how in ("unix", "tls"):
                dest = f"/home/bench/in-{n}-{how}-{r}.kv"
                with a.client(pki if how == "tls" else None) as ca, b.client(pki if how == "tls" else None) as cb:
                    t0 = time.perf_counter()
                    blob = ca.kv_export(path)
                    cb.kv_import(dest, blob)
                    results[how].append(time.perf_counter() - t0)
                size = len(blob)
                with b.client() as cb:
                    cb.kv_rm(dest)
            recompute.append(float(b.run(PREFILL, n)[0]))
            others.append(watch.stop())
        rc = statistics.median(recompute)
        for how, ts in results.items():
            ms = [1e3 * t for t in ts]
            mbs = [size / 1e6 / t for t in ts]
            print(f"| {n} | {size / 1e6:.1f} | {how} | {spread(ms)} | {spread(mbs)} | "
                  f"{spread([m * 1000 / n for m in ms])} | {1e3 * rc:.0f} | {rc / statistics.median(ts):.1f}x | "
                  f"{statistics.median(others):.0f}% |", flush=True)


def bench_failover(a: Kernel, b: Kernel, pki: dict, args, d: Path) -> None:
    print("\n## Failover from a remote kernel (killed: its port answers RST)\n", flush=True)
    print("| round | requests after the kill | their latency ms (median, max) | failed | B out of rotation after ms |",
          "|---|---|---|---|---|", sep="\n", flush=True)
    for r in range(args.failover_rounds):
        port = free_port()
        glog = open(d / f"gateway-{r}.log", "w+")
        gw = subprocess.Popen([sys.executable, "-m", "symphony.gateway", "--http", f"127.0.0.1:{port}", "--kernel",
                               a.address, "--kernel", b.address, "--kernel-secret", pki["secret"], "--kernel-ca",
                               pki["ca"], "--prefix-cache", "off"] + (["--run-as", "2190"] if os.geteuid() == 0 else []),
                              stdout=glog, stderr=subprocess.STDOUT, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 60
            while "serving" not in Path(glog.name).read_text():
                if gw.poll() is not None or time.time() > deadline:
                    raise RuntimeError(Path(glog.name).read_text()[-2000:])
                time.sleep(0.2)
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
            for _ in range(4):
                httpx.post(url + "/v1/completions", json=body, timeout=120)
            b.proc.send_signal(signal.SIGKILL)
            t_kill = time.perf_counter()
            b.proc.wait(10)
            lat, failed, out_at = [], 0, None
            for _ in range(8):
                t0 = time.perf_counter()
                resp = httpx.post(url + "/v1/completions", json=body, timeout=120)
                lat.append(1e3 * (time.perf_counter() - t0))
                failed += resp.status_code != 200
                if out_at is None and "out of rotation" in Path(glog.name).read_text():
                    out_at = 1e3 * (time.perf_counter() - t_kill)
            print(f"| {r + 1} | {len(lat)} | {statistics.median(lat):.0f}, {max(lat):.0f} | {failed} | "
                  f"{out_at:.0f} |" if out_at is not None else f"| {r + 1} | {len(lat)} | - | {failed} | never |",
                  flush=True)
        finally:
            gw.terminate()
            gw.wait(20)
        b.stop()
        b.__init__(d / f"b{r + 1}", pki, args)      # a fresh B for the next round


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1000,4000")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--failover-rounds", type=int, default=3)
    ap.add_argument("--kv-memory-mb", type=int, default=1024)
    ap.add_argument("--model", default=None)
    ap.add_argument("--only", default="move,failover")
    args = ap.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",")]
    d = Path(tempfile.mkdtemp(prefix="bench-span-"))
    pki = make_pki(d)
    print(f"# bench_span: {cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start; "
          f"model {args.model or 'embedded SmolLM2-135M Q4_1'}; {args.rounds} rounds", flush=True)
    a = Kernel(d / "a", pki, args)
    b = Kernel(d / "b", pki, args)
    try:
        if "move" in args.only:
            bench_move(a, b, pki, args)
        if "failover" in args.only:
            bench_failover(a, b, pki, args, d)
    finally:
        a.stop()
        b.stop()
    print(f"\n# load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
