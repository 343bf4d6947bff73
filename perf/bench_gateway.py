"""The HTTP gateway under load, against its baselines, on the embedded SmolLM2 (Q4_1 GGUF).

    python perf/bench_gateway.py [--rounds 3] [--clients 1,4,16,64] [--turns 3] [--max-tokens 32]
                                 [--no-llamacpp] [--only a,b,c]

Starts a kernel with --http (and a second gateway with --prefix-cache off in front of the same
kernel), and, unless --no-llamacpp, llama.cpp's OpenAI server (llama-cpp-python[server], a
perf-only dependency) on the same GGUF with its prompt cache on. All stay up for the whole run;
rounds interleave the contenders (A B A B ...) so machine noise hits each alike. Reports medians
and the per-round spread (min..max) of:

  (a) one chat request at a time, not streamed, greedy, --max-tokens-a tokens: the gateway vs
      the same serving program run through the kernel's socket (`symphony run` without HTTP)
      with the very request the gateway makes of it (stream false included): generated
      tokens/s and their ratio (target >= 0.95);
  (b) N concurrent clients (--clients), each a multi-turn conversation (--turns) that starts with
      the same ~1,000-token system prompt, streamed: aggregate generated tokens/s, time to first
      token p50 and p99, Symphony vs llama.cpp's server (targets: >= 2x at 16 clients; lower
      TTFT at every concurrency);
  (c) the same workload through the gateway with prefix caching on (per user) vs off: tokens/s,
      TTFT, and the prompt tokens computed (the kernel's counters).
The CPU model, core count and load average are printed with the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SYSTEM = ("You are a meticulous assistant for a regional library network. " * 2 +
          "Rules: " + " ".join(f"({i}) Answer politely, cite the branch catalogue when relevant, keep "
                                 f"answers short and never invent opening hours for branch number {i}."
                                 for i in range(1, 26)))
QUESTIONS = ["Which branch is open on Sunday?", "Can I renew a book online?", "How many books may I borrow?",
             "Do you have audiobooks?", "Where can I print a document?", "Is there a reading room?"]


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spread(xs) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


def pct(xs, p) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


# ---------------------------------------------------------------- the servers
class Symphony:
    def __init__(self, tmp: Path, kv_memory_mb: int = 512):
        self.sock = str(tmp / "k.sock")
        self.port, self.port_nocache = free_port(), free_port()
        self.log = open(tmp / "kernel.log", "w+")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-m", "symphony.kernel", "--socket", self.sock,
                                      "--http", f"127.0.0.1:{self.port}", "--kv-memory-mb", str(kv_memory_mb)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self._wait("symphony-gateway: serving", 300)
        uid = int(self.text().split("serving as uid ")[1].split(")")[0])
        self.nocache = subprocess.Popen([sys.executable, "-m", "symphony.gateway", "--http",
                                         f"127.0.0.1:{self.port_nocache}", "--socket", self.sock,
                                         "--prefix-cache", "off"] + (["--run-as", str(uid)] if os.geteuid() == 0
                                                                     else []),
                                        stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self._wait(f"serving http://127.0.0.1:{self.port_nocache}", 120)
        self.model = httpx.get(f"http://127.0.0.1:{self.port}/v1/models").json()["data"][0]["id"]

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def _wait(self, what: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while what not in self.text():
            if self.proc.poll() is not None or time.time() > deadline:
                for p in (self.proc, getattr(self, "nocache", None)):   # none left running behind us
                    if p is not None and p.poll() is None:
                        p.kill()
                        p.wait()
                raise SystemExit("symphony did not start:\n" + self.text()[-3000:])
            time.sleep(0.2)

    def stats(self) -> dict:
        from symphony.client import Client
        with Client(self.sock) as c:
            return c.stats()

    def stop(self):
        self.nocache.terminate()
        self.proc.terminate()
        self.proc.wait(30)


class LlamaCpp:
    def __init__(self, tmp: Path, model_path: str, threads: int):
        self.port = free_port()
        self.log = open(tmp / "llamacpp.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", model_path,
                                      "--port", str(self.port), "--n_ctx", "8192", "--cache", "true",
                                      "--n_threads", str(threads), "--model_alias", "llamacpp",
                                      # its default cuts the stream in flight whenever another
                                      # request arrives; concurrent clients queue instead
                                      "--interrupt_requests", "false"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.log.flush()
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
                raise SystemExit("llama.cpp's server did not start:\n" + Path(self.log.name).read_text()[-2000:])
            time.sleep(0.5)
        self.model = "llamacpp"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


# ---------------------------------------------------------------- the workloads
async def chat_stream(client: httpx.AsyncClient, url: str, model: str, messages, max_tokens: int):
    """One streamed chat request: (time to first token, generated tokens, text). Tokens are the
    final usage chunk's count; a server that sends none (llama-cpp-python's ignores
    stream_options) is counted one token per content chunk, which is how it streams."""
    t0 = time.perf_counter()
    ttft, text, tokens, chunks = None, [], None, 0
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in _lines(r, url):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                tokens = d["usage"]["completion_tokens"]
            for ch in d.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
                    chunks += 1
    return (ttft if ttft is not None else time.perf_counter() - t0), \
        (tokens if tokens is not None else chunks), "".join(text)


async def _lines(r, url: str):
    """The response's lines; a stream the server cuts names the server."""
    try:
        async for line in r.aiter_lines():
            yield line
    except httpx.HTTPError as e:
        raise RuntimeError(f"{url}: the stream broke: {e}") from e


async def conversations(url: str, model: str, clients: int, turns: int, max_tokens: int, tag: str):
    """``clients`` concurrent multi-turn conversations sharing the system prompt:
    (aggregate generated tokens/s, [TTFT of every turn])."""
    ttfts, total = [], 0
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def one(i):
            nonlocal total
            msgs = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                msgs.append({"role": "user", "content": f"[{tag} {i}] " + QUESTIONS[(i + t) % len(QUESTIONS)]})
                ttft, n, text = await chat_stream(client, url, model, msgs, max_tokens)
                ttfts.append(ttft)
                total += n
                msgs.append({"role": "assistant", "content": text})
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        return total / (time.perf_counter() - t0), ttfts


def single_direct(sym: Symphony, request: dict) -> tuple[float, int]:
    """The serving program run through the kernel's socket: (seconds, tokens)."""
    from symphony.client import Client
    from symphony.programs import resolve
    source = resolve("serve").read_text()
    t0 = time.perf_counter()
    n = 0
    with Client(sym.sock) as c:
        c.spawn(source, [json.dumps(request)], filename="serve.py")
        for ev in c.events():
            d = ev.get("data") if ev.get("event") == "out" else None
            if isinstance(d, dict) and d.get("event") == "done":
                n += d.get("completion_tokens", 0)
    return time.perf_counter() - t0, n


def gateway_request(body: dict) -> dict:
    """The serving program's request that the gateway without prefix caching makes of the
    chat completion ``body``: built by the gateway's own code, so the two paths of (a) run
    the same program on the same request."""
    from symphony.gateway.completions import chat_request
    from symphony.gateway.schema import ChatRequest, decode
    req = chat_request(decode(json.dumps(body).encode(), ChatRequest), "placeholder")
    req["cache"] = None                                       # --prefix-cache off
    return req


def bench_a(sym: Symphony, rounds: int, max_tokens: int) -> None:
    msgs = [{"role": "user", "content": "Write a short story about a robot who learns to play the violin."}]
    body = {"model": sym.model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
    req = gateway_request(body)
    url = f"http://127.0.0.1:{sym.port_nocache}"
    gw, direct, ratio = [], [], []
    single_direct(sym, req)                                   # warm-up
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", timeout=600, json=body)
        g = r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t0)
        dt, n = single_direct(sym, req)
        d = n / dt
        gw.append(g)
        direct.append(d)
        ratio.append(g / d)
    print(f"(a) one chat request, {max_tokens} tokens, greedy, stream {str(req['stream']).lower()}: gateway "
          f"{spread(gw)} tok/s, through the kernel's socket {spread(direct)} tok/s: ratio {spread(ratio)}")


def bench_b(sym: Symphony, llama, rounds: int, levels, turns: int, max_tokens: int) -> None:
    for n in levels:
        res = {"symphony": ([], [], []), "llama.cpp": ([], [], [])}
        for r in range(rounds):
            for name, url, model in (("symphony", f"http://127.0.0.1:{sym.port}", sym.model),
                                     ("llama.cpp", llama and f"http://127.0.0.1:{llama.port}",
                                      llama and llama.model)):
                if url is None:
                    continue
                tps, ttfts = asyncio.run(conversations(url, model, n, turns, max_tokens, f"b{n}r{r}"))
                res[name][0].append(tps)
                res[name][1].append(pct(ttfts, 50))
                res[name][2].append(pct(ttfts, 99))
        s, l = res["symphony"], res["llama.cpp"]
        line = (f"(b) {n:>3} clients x {turns} turns: symphony {spread(s[0])} tok/s, TTFT p50 {spread(s[1])} s, "
                f"p99 {spread(s[2])} s")
        if l[0]:
            line += (f" | llama.cpp {spread(l[0])} tok/s, TTFT p50 {spread(l[1])} s, p99 {spread(l[2])} s | "
                     f"ratio {spread([a / b for a, b in zip(s[0], l[0])])}")
        print(line, flush=True)


def bench_c(sym: Symphony, rounds: int, clients: int, turns: int, max_tokens: int) -> None:
    on, off, ratio, computed = [], [], [], {"on": [], "off": []}
    for r in range(rounds):
        for name, port in (("on", sym.port), ("off", sym.port_nocache)):
            before = sym.stats().get("tokens_computed", None)
            tps, ttfts = asyncio.run(conversations(f"http://127.0.0.1:{port}", sym.model, clients, turns,
                                                   max_tokens, f"c{name}{r}"))
            after = sym.stats().get("tokens_computed", None)
            (on if name == "on" else off).append((tps, pct(ttfts, 50)))
            if before is not None:
                computed[name].append(after - before)
        ratio.append(on[-1][0] / off[-1][0])
    print(f"(c) prefix caching, {clients} clients x {turns} turns: on {spread([x[0] for x in on])} tok/s "
          f"(TTFT p50 {spread([x[1] for x in on])} s), off {spread([x[0] for x in off])} tok/s (TTFT p50 "
          f"{spread([x[1] for x in off])} s): ratio {spread(ratio)}")
    if computed["on"] and computed["off"]:
        print(f"    tokens the kernel computed (prompts and outputs): on {spread(computed['on'])}, "
              f"off {spread(computed['off'])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-tokens-a", type=int, default=128)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--only", default="a,b,c")
    a = p.parse_args()
    only = set(a.only.split(","))
    levels = [int(x) for x in a.clients.split(",")]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    with tempfile.TemporaryDirectory(prefix="bench-gateway-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)                    # a root kernel's gateway runs as another uid
        sym = Symphony(Path(tmp))
        llama = None
        try:
            if "b" in only and not a.no_llamacpp:
                try:
                    import llama_cpp  # noqa: F401
                    from symphony.engine.loader import default_model_path
                    llama = LlamaCpp(Path(tmp), str(default_model_path()), os.cpu_count() or 1)
                except ImportError:
                    print("llama-cpp-python[server] is not installed: (b) runs Symphony alone")
            print(f"model {sym.model}; system prompt {len(SYSTEM)} characters; symphony on ports {sym.port} "
                  f"(prefix cache) and {sym.port_nocache} (none)" + (f", llama.cpp on {llama.port}" if llama else ""))
            if "a" in only:
                bench_a(sym, a.rounds, a.max_tokens_a)
            if "b" in only:
                bench_b(sym, llama, a.rounds, levels, a.turns, a.max_tokens)
            if "c" in only:
                bench_c(sym, a.rounds, 16 if 16 in levels else levels[-1], a.turns, a.max_tokens)
        except BaseException:
            keep = Path("/tmp/bench-gateway-logs")          # the servers' logs outlive a failed run
            keep.mkdir(exist_ok=True)
            for f in Path(tmp).glob("*.log"):
                f.replace(keep / f.name)
            print(f"the servers' logs are in {keep}", file=sys.stderr)
            raise
        finally:
            if llama:
                llama.stop()
            sym.stop()
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
