"""Soak: a long mixed workload on a real kernel, LIPs killed at random.

    python perf/soak.py [--minutes 30] [--workers 12] [--kill-p 0.3] [--interval 30]
                        [--tiny] [--model PATH] [--kv-memory-mb 256]

Starts ``symphony-kernel`` in a subprocess on its own socket (the embedded
SmolLM2 by default; ``--tiny``: the tests' tiny random model), then keeps
--workers client threads busy for --minutes.  Each loops: spawn one LIP
(decoder, forker, userland/rag.py over a few granted documents, or a quick
send), attached on its own connection; with probability --kill-p it is killed
after a random delay (by `kill`, or by closing the connection), otherwise it
runs to the end.  Every client must get exactly one exit event.

Every --interval seconds it prints: LIPs finished/killed, preds and tokens
per second (kernel stats), the kernel's RSS (its own process, /proc), and
events lost so far.  At the end, once the workers have stopped: leaked KV
pages (pages in use minus the baseline, must be 0), leftover /dev/shm names
of the kernel (must be none but its doorbell), lost events (must be 0), the
RSS growth from the first interval to the last, and the exit reasons.
Exit status 1 if anything leaked or was lost.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from symphony.client import Client, KernelError  # noqa: E402

DECODER = """
from symphony.lip import kv, pred, send, tokenize
def main(n):
    f = kv.create()
    t = tokenize("Once upon a time, in a land far away,")
    out = []
    for _ in range(int(n)):
        t = pred(f, t, output="argmax")
        out.append(t)
        t = [t]
    send(len(out))
"""
FORKER = """
from symphony.lip import kv, pred, send, tokenize
def main(n):
    with kv.create() as f:
        pred(f, tokenize("The three best things about the sea are"), output="argmax")
        kids = [f.fork() for _ in range(4)]
        for g in kids:
            t = [pred(g, [i + 5], output="argmax") for i in range(int(n))]
            g.close()
    send("ok")
"""
QUICK = 'from symphony.lip import send\ndef main():\n    send("hi")\n'


class Soak:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.tmp = Path(tempfile.mkdtemp(prefix="symphony-soak-"))
        os.chmod(self.tmp, 0o755)
        # rag's documents live apart from the kernel's socket directory, which the
        # capability policy denies (grants to it are refused at spawn)
        self.docs = Path(tempfile.mkdtemp(prefix="symphony-soak-docs-"))
        os.chmod(self.docs, 0o755)
        for i, text in enumerate(["Paris is the capital of France. It lies on the Seine.",
                                  "The Nile is the longest river in Africa.",
                                  "Mount Everest is the highest mountain on Earth.",
                                  "Python is a programming language created by Guido van Rossum."]):
            (self.docs / f"doc{i}.txt").write_text(text)
        self.lock = threading.Lock()
        self.count = collections.Counter()
        self.reasons = collections.Counter()
        self.lost = 0
        self.stop = threading.Event()

    # ------------------------------------------------------------ kernel
    def start_kernel(self) -> None:
        self.socket = str(self.tmp / "kernel.sock")
        extra = ["--kv-memory-mb", str(self.a.kv_memory_mb), "--max-lips", "128"]
        if self.a.tiny:
            sys.path.insert(0, str(REPO / "tests"))
            from modelfiles import hf_state_dict, tiny_hf_config, write_gguf
            cfg = tiny_hf_config()
            extra += ["--model", str(write_gguf(self.tmp / "tiny.gguf", cfg, hf_state_dict(cfg, seed=1)))]
        elif self.a.model:
            extra += ["--model", self.a.model]
        self.log = open(self.tmp / "kernel.log", "w+")
        self.kernel = subprocess.Popen(
            [sys.executable, "-m", "symphony.kernel", "--socket", self.socket, *extra],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)))
        deadline = time.time() + 600
        while "ready on" not in Path(self.log.name).read_text():
            if self.kernel.poll() is not None or time.time() > deadline:
                raise SystemExit("kernel did not start:\n" + Path(self.log.name).read_text()[-3000:])
            time.sleep(0.2)
        st = Client(self.socket).stats()
        self.instance, self.base_pages = st["instance"], st["kv_pages_used"]
        self.base_shm = set(self.shm())

    def shm(self) -> list:
        return [n for n in os.listdir("/dev/shm") if f"sym{self.instance}" in n]

    def rss_mb(self) -> float:
        with open(f"/proc/{self.kernel.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    # ------------------------------------------------------------ workers
    def job(self):
        r = self.rng.random()
        if r < 0.4:
            return DECODER, [str(self.rng.randint(4, 24))], "decoder.py", {}
        if r < 0.7:
            return FORKER, [str(self.rng.randint(1, 4))], "forker.py", {}
        if r < 0.85 and not self.a.tiny:
            src = (REPO / "userland/rag.py").read_text()
            q = self.rng.choice(["What is the capital of France?", "Which river is longest?"])
            return src, ["--docs", str(self.docs), "--max-tokens", "6", q], "rag.py", \
                {"read": [str(self.docs)]}
        return QUICK, [], "quick.py", {}

    def worker(self) -> None:
        rng = random.Random(self.rng.random())
        while not self.stop.is_set():
            src, args, name, grant = self.job()
            try:
                c = Client(self.socket, timeout=120)
                lip = c.spawn(src, args, filename=name, grants={"read": grant.get("read", [])})
            except (KernelError, ConnectionError, OSError) as e:
                with self.lock:
                    self.count["spawn_refused"] += 1
                    self.reasons[f"spawn refused: {str(e)[:60]}"] += 1
                time.sleep(0.2)
                continue
            kill = rng.random() < self.a.kill_p
            disconnect = kill and rng.random() < 0.3
            if kill:
                time.sleep(rng.uniform(0, 1.5))
                if disconnect:
                    c.close()
                else:
                    try:
                        Client(self.socket).kill(lip)
                    except KernelError:
                        pass                         # it had already finished
            if disconnect:
                with self.lock:
                    self.count["disconnected"] += 1
                continue
            try:
                ex = [e for e in c.events(timeout=300) if e["event"] == "exit"]
            except OSError:
                ex = []
            c.close()
            with self.lock:
                if len(ex) != 1 or ex[0].get("lost"):
                    self.lost += 1
                else:
                    self.count["killed" if ex[0]["reason"].startswith("killed") else "ended"] += 1
                    self.reasons[ex[0]["reason"][:60]] += 1

    def remove_named(self, path: str) -> int:
        """Remove every KV file under ``path`` (as its owner); returns how many."""
        n = 0
        for e in Client(self.socket).kv_ls(path):
            full = path.rstrip("/") + "/" + e["name"].rstrip("/")
            if e["type"] == "file":
                try:
                    Client(self.socket, user=e["owner"]).kv_rm(full)
                    n += 1
                except KernelError as err:
                    print(f"could not remove {full}: {err}")
            else:
                n += self.remove_named(full)
        return n

    # ------------------------------------------------------------ run
    def run(self) -> int:
        self.start_kernel()
        print(f"kernel {self.instance} ready; baseline {self.base_pages} pages, RSS {self.rss_mb():.0f} MiB; "
              f"{self.a.workers} workers for {self.a.minutes} min", flush=True)
        threads = [threading.Thread(target=self.worker, daemon=True) for _ in range(self.a.workers)]
        for t in threads:
            t.start()
        t0 = time.time()
        end = t0 + self.a.minutes * 60
        rss = []
        last = Client(self.socket).stats()
        last_t = t0
        print(f"{'t_s':>6} {'ended':>6} {'killed':>6} {'disc':>5} {'preds/s':>8} {'calls/fwd':>9} "
              f"{'rss_MiB':>8} {'pages':>6} {'lost':>5}", flush=True)
        while time.time() < end:
            time.sleep(min(self.a.interval, max(0.0, end - time.time())))
            st, now = Client(self.socket).stats(), time.time()
            dp = st["pred_calls"] - last["pred_calls"]
            db = st["batches"] - last["batches"]
            rss.append(self.rss_mb())
            with self.lock:
                c, lost = dict(self.count), self.lost
            print(f"{now - t0:6.0f} {c.get('ended', 0):6d} {c.get('killed', 0):6d} {c.get('disconnected', 0):5d} "
                  f"{dp / (now - last_t):8.1f} {(st['batch_calls'] - last['batch_calls']) / max(db, 1):9.2f} "
                  f"{rss[-1]:8.0f} {st['kv_pages_used']:6d} {lost:5d}", flush=True)
            last, last_t = st, now
        self.stop.set()
        for t in threads:
            t.join(330)
        named = self.remove_named("/")                # rag's cached modules are files, not leaks
        deadline = time.time() + 60
        while time.time() < deadline:
            st = Client(self.socket).stats()
            if st["lips"] == 0 and st["kv_pages_used"] == self.base_pages:
                break
            time.sleep(0.5)
        leaked = st["kv_pages_used"] - self.base_pages
        shm_left = sorted(set(self.shm()) - self.base_shm)
        print(f"\nafter {(time.time() - t0) / 60:.1f} min: {dict(self.count)}; {named} named KV files removed")
        print(f"leaked pages: {leaked}; LIPs left: {st['lips']}; shm left: {len(shm_left)}; "
              f"lost events: {self.lost}")
        if rss:
            print(f"kernel RSS: first interval {rss[0]:.0f} MiB, last {rss[-1]:.0f} MiB, max {max(rss):.0f} MiB")
        print("exit reasons:", dict(self.reasons.most_common(12)))
        Client(self.socket).shutdown()
        rc = self.kernel.wait(60)
        print(f"kernel exit status {rc}; shm left after shutdown: {len(self.shm())}")
        # a refused spawn means the workload was not the mix it claims to be
        bad = leaked or shm_left or self.lost or st["lips"] or rc or self.shm() or self.count["spawn_refused"]
        return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--kill-p", type=float, default=0.3)
    p.add_argument("--interval", type=float, default=30)
    p.add_argument("--tiny", action="store_true", help="the tests' tiny random model (no rag)")
    p.add_argument("--model", default=None)
    p.add_argument("--kv-memory-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.minutes <= 0 or a.workers < 1 or not 0 <= a.kill_p <= 1 or a.interval <= 0:
        p.error("--minutes > 0, --workers >= 1, --kill-p in [0, 1], --interval > 0")
    return Soak(a).run()


if __name__ == "__main__":
    sys.exit(main())
