"""The HTTP gateway under load, against the servers users deploy, on the embedded SmolLM2 (Q4_1 GGUF).

    python perf/bench_gateway.py [--rounds 3] [--clients 1,4,16,64] [--turns 3] [--max-tokens 32]
                                 [--peers llama-server,vllm] [--extras llama-cpp-python]
                                 [--ours quantized,float,int8] [--workloads warm,cold,plain,short]
                                 [--only a,b,c] [--json OUT] [--kv-memory-mb 2048]
                                 [--kernel-flags "--token-budget 512"]

Starts a kernel with --http (and a second gateway with --prefix-cache off in front of the same
kernel, for (c)). Reports medians and the per-round spread (min..max) of:

  (a) one chat request at a time, not streamed, greedy, --max-tokens-a tokens: the gateway vs
      the same serving program run through the kernel's socket (`symphony run` without HTTP)
      with the very request the gateway makes of it (stream false included): generated
      tokens/s and their ratio (target >= 0.95);
  (b) Symphony against its peers (perf/peers.py: llama.cpp's `llama-server` on the same GGUF,
      vLLM's CPU build on the GGUF dequantized to float32; a peer that is not installed is
      skipped with the reason printed), at each --clients level and for each workload:
        warm   N concurrent multi-turn conversations (--turns), streamed, that open with the same
               ~850-token system prompt, computed once before the round by one untimed request:
               a service's steady state;
        cold   the same with a system prompt no contender has seen: all N first turns arrive
               before it is cached (a restart, a new system prompt, a burst of agents); its own
               row, with the first turns' TTFT apart;
        plain  N concurrent clients, each sending --turns single-turn requests of a distinct
               ~--plain-tokens prompt (nothing in common from the first token): no cache helps;
        short  (not by default) the same with a few tokens in and one out: requests/s, what a
               request costs beside its tokens (HTTP, JSON, the template, starting its program).
      Per contender and round: generated tokens/s (usage.completion_tokens of every request over
      the run's wall time), TTFT p50/p99 (first content chunk), output tokens a request, prompt
      tokens and the cached ones the server reported, failed requests, and the CPU the box spent
      elsewhere (other processes' cores, the load the figures were taken under); and what the
      server computed, from its own counters (Symphony's stats, a peer's /metrics): forward
      passes a second, sequences and tokens a pass, prompt tokens computed, and the CPU each
      part spent a generated token (Symphony: the kernel, its gateway, the serving programs;
      vLLM: its API server, its engine). Ratios per
      round: Symphony / the better peer. Targets: at 16 and 64 clients (warm) >= 1.5x the better
      peer's tokens/s with lower TTFT p50 and p99; at 1 client >= 1.0x and TTFT no higher; plain
      at 16 clients >= 1.0x.
      --ours float adds a second kernel on the same weights dequantized to float32 (--weights
      float): the comparison at equal weights with vLLM; --ours int8 a kernel with --activations
      int8 (x rounded to int8 as llama.cpp's kernels round it; products of 64 rows and more,
      prefills, in bfloat16 on AMX CPUs; a bfloat16 KV pool): the comparison at the peers' precision (llama-server's
      int8 activations, vLLM's --vllm-dtype bfloat16). --extras llama-cpp-python adds
      llama-cpp-python's OpenAI server, which serves one request at a time (a labelled extra,
      not a peer for concurrency).
  (c) the warm workload through the gateway with prefix caching on (per user) vs off: tokens/s,
      TTFT, and the prompt tokens computed (the kernel's counters).

Fairness: every contender gets the same requests (greedy, streamed, usage requested, a new
connection per request: llama-server drops reused keep-alive connections under load), and
each round a fresh system prompt (a salt at its start) so all start from the same cache state.
Within a round the contenders run one after the other, in an order rotated every round; every
peer not being measured is paused (SIGSTOP: vLLM keeps a core busy even idle). llama-server is
restarted at each level with -np N (N = clients; it starts in seconds); a Symphony kernel is timed
once its KV pool is committed (as vLLM reserves its KV memory before it serves); vLLM starts once (minutes)
with --max-num-seqs = the largest level (a cap, not an allocation). Each contender's KV budget
is printed. The CPU model, core count and load are printed with the figures, and --json writes
every round's figures (rewritten after each level, so an interrupted run keeps what it measured).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
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
sys.path.insert(0, str(REPO / "perf"))

import peers  # noqa: E402
import sse  # noqa: E402
from symphony.engine.hostmem import COMMIT_ENDED  # noqa: E402

SYSTEM = ("You are a meticulous assistant for a regional library network. " * 2 +
          "Rules: " + " ".join(f"({i}) Answer politely, cite the branch catalogue when relevant, keep "
                                 f"answers short and never invent opening hours for branch number {i}."
                                 for i in range(1, 26)))
QUESTIONS = ["Which branch is open on Sunday?", "Can I renew a book online?", "How many books may I borrow?",
             "Do you have audiobooks?", "Where can I print a document?", "Is there a reading room?"]
WORKLOADS = ("warm", "cold", "plain", "short")


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
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"


def pct(xs, p) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


# ---------------------------------------------------------------- the servers
class Symphony:
    """A kernel with --http on a temporary socket; with ``nocache`` a second gateway in front of
    it with --prefix-cache off (``port_nocache``)."""

    def __init__(self, tmp: Path, kv_memory_mb: int = 512, weights: str | None = None, nocache: bool = True,
                 extra: tuple = ()):
        tmp.mkdir(parents=True, exist_ok=True)
        self.sock = str(tmp / "k.sock")
        self.port, self.port_nocache = free_port(), (free_port() if nocache else None)
        self.weights, self.kv_memory_mb = weights or "auto", kv_memory_mb
        self.log = open(tmp / "kernel.log", "w+")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.env = env
        self.nocache = None
        self.argv = [sys.executable, "-m", "symphony.kernel", "--socket", self.sock, "--http",
                     f"127.0.0.1:{self.port}", "--kv-memory-mb", str(kv_memory_mb)] + \
            (["--weights", weights] if weights else []) + [str(x) for x in extra]
        t0 = time.time()
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self._wait("symphony-gateway: serving", 300)
        if "lazy" not in self.argv:                  # the KV pool committed before anything is timed
            self._wait(COMMIT_ENDED, 300)
        self.startup_s = time.time() - t0
        if nocache:
            uid = int(self.text().split("serving as uid ")[1].split(")")[0])
            self.nocache = subprocess.Popen([sys.executable, "-m", "symphony.gateway", "--http",
                                             f"127.0.0.1:{self.port_nocache}", "--socket", self.sock,
                                             "--prefix-cache", "off"] + (["--run-as", str(uid)]
                                                                         if os.geteuid() == 0 else []),
                                            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            self._wait(f"serving http://127.0.0.1:{self.port_nocache}", 120)
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def _wait(self, what: str | tuple, timeout: float) -> None:
        """Until the log says ``what`` (or any of a tuple of alternatives)."""
        marks = (what,) if isinstance(what, str) else what
        deadline = time.time() + timeout
        while not any(m in self.text() for m in marks):
            if self.proc.poll() is not None or time.time() > deadline:
                for p in (self.proc, self.nocache):       # none left running behind us
                    if p is not None and p.poll() is None:
                        p.kill()
                        p.wait()
                raise SystemExit("symphony did not start:\n" + self.text()[-3000:])
            time.sleep(0.2)

    def pids(self) -> list[int]:
        return [p.pid for p in (self.proc, self.nocache) if p is not None and p.poll() is None]

    def stats(self) -> dict:
        from symphony.client import Client
        with Client(self.sock) as c:
            return c.stats()

    def parts(self) -> dict[str, list[int]]:
        """The kernel's processes by part: the gateway (HTTP, JSON, the chat template), the
        programs (the zygote and the serving programs it forks, one a request); the rest of
        the kernel's time is its own (the model's steps and the system calls)."""
        return {"gateway": peers.descendants_running(self.proc.pid, "symphony.gateway"),
                "programs": peers.descendants_running(self.proc.pid, "workers.zygote")}

    def counters(self) -> dict:
        """The kernel's step counters and its syscall thread's time, flat."""
        st = self.stats()
        out = {k: st[k] for k in ("forward_passes", "pred_calls", "tokens_computed", "batches", "batch_calls")
               if k in st}
        out.update({f"host_{k}": v for k, v in (st.get("host") or {}).items()})
        return out

    def stop(self):
        if self.nocache is not None:
            self.nocache.terminate()
        self.proc.terminate()
        self.proc.wait(30)
        if self.nocache is not None:
            self.nocache.wait(30)


class LlamaCpp:
    """llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) on ``model_path``,
    served as model ``llamacpp``: one request at a time, a labelled extra (perf/peers.py)."""

    def __init__(self, tmp: Path, model_path: str, threads: int):
        self._stack = contextlib.ExitStack()
        try:
            self.peer = self._stack.enter_context(peers.peer("llama-cpp-python", slots=1, gguf=model_path,
                                                             threads=threads, log_dir=tmp, ctx_per_slot=8192,
                                                             served_name="llamacpp"))
        except peers.Unavailable as e:
            raise SystemExit(f"llama-cpp-python's server did not start: {e}") from e
        self.port, self.model = self.peer.port, self.peer.model

    def stop(self):
        self._stack.close()


class Contender:
    """One server of (b): a name, its base URL and model, its processes, and what it is."""

    def __init__(self, name: str, url: str, model: str, info: dict, pids, peer=None, counters=None, parts=None):
        self.name, self.url, self.model, self.info, self._pids, self.peer = name, url, model, info, pids, peer
        self._counters = counters or (peer.metrics if peer is not None else dict)
        self._parts = parts or (peer.parts if peer is not None else dict)

    def parts(self) -> dict[str, list[int]]:
        """Its processes by part (tree roots); what is in no part is the main process's own."""
        return self._parts()

    def pids(self) -> list[int]:
        return self._pids()

    def counters(self) -> dict:
        """The server's own cumulative counters (Symphony's stats, a peer's /metrics)."""
        try:
            return self._counters()
        except Exception as e:                  # a counter read must never lose the round's figures
            return {"error": str(e)[:200]}

    def pause(self):
        if self.peer is not None:
            self.peer.pause()

    def resume(self):
        if self.peer is not None:
            self.peer.resume()


def symphony_contender(name: str, sym: Symphony) -> Contender:
    weights = ("the GGUF's quantized bits (Q4_1), computed on as they are" if sym.weights != "float" else
               "the GGUF dequantized to float32 at load (--weights float): equal weights with vLLM")
    if "--activations" in sym.argv:
        weights += ", activations rounded to int8 (--activations int8; bfloat16 from 64 rows on AMX CPUs)"
    info = {"name": name, "version": f"symphony {_git_commit()}", "weights": weights, "argv": sym.argv,
            "kv": f"--kv-memory-mb {sym.kv_memory_mb} ({'bfloat16' if '--activations' in sym.argv else 'float32'} "
                  "pages, shared prefixes forked)",
            "startup_s": round(sym.startup_s, 1)}
    return Contender(name, sym.url, sym.model, info, sym.pids, counters=sym.counters, parts=sym.parts)


def peer_contender(p: peers.Peer) -> Contender:
    return Contender(p.name, p.url, p.model, p.info(), p.pids, p)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


# ---------------------------------------------------------------- the workloads
async def chat_stream(client: httpx.AsyncClient, url: str, model: str, messages, max_tokens: int):
    """One streamed chat request: (time to first token, generated tokens, text, usage). Tokens
    are the final usage chunk's count; a server that sends none is counted one token per
    content chunk.  An error event in the stream raises RuntimeError, as an HTTP error does."""
    t0 = time.perf_counter()
    ttft, text, tokens, chunks, usage = None, [], None, 0, {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async for ev in sse.chat_events(client, url, body):
        if ev.get("usage"):
            usage = ev["usage"]
            tokens = usage.get("completion_tokens")
        piece = sse.content(ev)
        if piece:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
            chunks += 1
    return (ttft if ttft is not None else time.perf_counter() - t0), \
        (tokens if tokens is not None else chunks), "".join(text), usage


def _client(clients: int) -> httpx.AsyncClient:
    # a new connection per request, for every contender alike
    return httpx.AsyncClient(timeout=httpx.Timeout(1800.0),
                             limits=httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0))


class Tally:
    """What one run of a workload measured."""

    def __init__(self):
        self.ttfts, self.first_ttfts, self.tokens, self.prompt, self.cached = [], [], 0, 0, 0
        self.requests, self.failures, self.error = 0, 0, ""

    def add(self, ttft, n, usage, first):
        self.ttfts.append(ttft)
        if first:
            self.first_ttfts.append(ttft)
        self.tokens += n
        self.requests += 1
        self.prompt += usage.get("prompt_tokens") or 0
        self.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def fail(self, e: Exception):
        self.failures += 1
        self.error = self.error or str(e)[:300]


async def conversations(url: str, model: str, clients: int, turns: int, max_tokens: int, tag: str,
                        system: str = SYSTEM, tally: Tally | None = None):
    """``clients`` concurrent multi-turn conversations sharing the system prompt:
    (aggregate generated tokens/s, [TTFT of every turn])."""
    tally = tally if tally is not None else Tally()
    async with _client(clients) as client:
        async def one(i):
            msgs = [{"role": "system", "content": system}]
            for t in range(turns):
                msgs.append({"role": "user", "content": f"[{tag} {i}] " + QUESTIONS[(i + t) % len(QUESTIONS)]})
                try:
                    ttft, n, text, usage = await chat_stream(client, url, model, msgs, max_tokens)
                except (RuntimeError, httpx.HTTPError) as e:
                    tally.fail(e)
                    return
                tally.add(ttft, n, usage, t == 0)
                msgs.append({"role": "assistant", "content": text})
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        return tally.tokens / (time.perf_counter() - t0), tally.ttfts


WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kestrel lantern meadow nickel "
         "orchid pepper quartz raven saffron tundra umber violet willow xenon yarrow zephyr anchor bramble "
         "copper dune falcon glacier heron island jasper kelp lagoon marble nectar onyx pebble quill reef "
         "sable thistle urchin valley walnut").split()


def plain_prompt(seed: str, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens whose words, from the first, depend on ``seed``."""
    rnd = random.Random(seed)
    notes = [f"{rnd.choice(WORDS).capitalize()} {rnd.choice(WORDS)} note {rnd.randrange(10**6)}:"]
    while len(" ".join(notes)) < tokens * 4.2:
        notes.append(f"the {rnd.choice(WORDS)} {rnd.choice(WORDS)} near {rnd.choice(WORDS)} {rnd.choice(WORDS)} "
                     f"costs {rnd.randrange(1, 999)} coins and opens at {rnd.randrange(6, 11)} o'clock.")
    return " ".join(notes)


async def plain(url: str, model: str, clients: int, turns: int, max_tokens: int, tag: str,
                prompt_tokens: int, tally: Tally) -> float:
    """``clients`` concurrent clients, each sending ``turns`` single-turn requests of a distinct
    prompt: aggregate generated tokens/s."""
    async with _client(clients) as client:
        async def one(i):
            for t in range(turns):
                msgs = [{"role": "system", "content": plain_prompt(f"{tag}/{i}/{t}", prompt_tokens)},
                        {"role": "user", "content": "Which note costs the most? Answer in one sentence."}]
                try:
                    ttft, n, _, usage = await chat_stream(client, url, model, msgs, max_tokens)
                except (RuntimeError, httpx.HTTPError) as e:
                    tally.fail(e)
                    return
                tally.add(ttft, n, usage, t == 0)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(clients)))
        return tally.tokens / (time.perf_counter() - t0)


async def prime(url: str, model: str, system: str) -> None:
    """One untimed request that leaves ``system`` in the server's prompt cache."""
    async with _client(1) as client:
        await chat_stream(client, url, model, [{"role": "system", "content": system},
                                               {"role": "user", "content": "Hello"}], 1)


def run_workload(c: Contender, workload: str, n: int, a, rnd: int) -> dict:
    """One round of ``workload`` at ``n`` clients on contender ``c``: its figures."""
    salt = f"{workload}-{n}-{rnd}"
    system = f"[{salt}] " + SYSTEM
    tally = Tally()
    if workload == "warm":
        asyncio.run(prime(c.url, c.model, system))
    parts = c.parts()
    load = peers.BoxLoad({c.name: c.pids(), **{f"part:{k}": v for k, v in parts.items()}})
    before = c.counters()
    t0 = time.perf_counter()
    if workload == "plain":
        asyncio.run(plain(c.url, c.model, n, a.turns, a.max_tokens, salt, a.plain_tokens, tally))
    elif workload == "short":                 # the cost of a request itself: a few tokens in, one out
        asyncio.run(plain(c.url, c.model, n, a.turns, 1, salt, 8, tally))
    else:
        asyncio.run(conversations(c.url, c.model, n, a.turns, a.max_tokens, salt, system, tally))
    wall = time.perf_counter() - t0
    used = load.stop()
    steps = work(before, c.counters(), wall)
    cores = {k[5:-6]: used.pop(k) for k in list(used) if k.startswith("part:")}
    if cores:                          # CPU seconds a generated token, each part and the main process
        cores["main"] = max(0.0, used[f"{c.name}_cores"] - sum(cores.values()))
        steps["cpu_ms_per_token"] = {k: round(v * wall / max(1, tally.tokens) * 1000, 2) for k, v in cores.items()}
    return {"steps": steps, "tok_s": tally.tokens / wall, "req_s": tally.requests / wall, "wall_s": round(wall, 2), "ttft_p50": pct(tally.ttfts, 50),
            "ttft_p99": pct(tally.ttfts, 99), "first_ttft_p50": pct(tally.first_ttfts, 50),
            "first_ttft_p99": pct(tally.first_ttfts, 99), "requests": tally.requests,
            "out_tokens_per_request": tally.tokens / max(1, tally.requests), "prompt_tokens": tally.prompt,
            "cached_tokens": tally.cached, "failures": tally.failures, "error": tally.error,
            "server_cores": used.get(f"{c.name}_cores"), "others_cores": used["others_cores"]}


def work(before: dict, after: dict, wall: float) -> dict:
    """What the server computed in a round, from its own counters: forward passes (``steps``),
    steps a second, sequences and tokens a step, prompt tokens computed (not taken from a cache),
    and where it says so, the seconds it spent on prompts and on generation. Symphony's kernel
    counts passes, pred calls and tokens fed; llama-server its decode calls, busy slots a call,
    prompt and generated tokens and their seconds; vLLM its engine steps' token histogram and
    prompt tokens with their prefix-cache hits."""
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float)) and k in before}
    out: dict = {}
    if "forward_passes" in d:                                    # Symphony
        out = {"steps": d["forward_passes"], "seqs_per_step": d["pred_calls"] / max(1, d["forward_passes"]),
               "tokens": d["tokens_computed"]}
        out["syscall_thread_s"] = round(sum(d.get(f"host_{k}_s", 0.0) for k in ("handle", "launch", "finish")), 3)
    elif "llamacpp:n_decode_total" in d:                         # llama-server
        n = d["llamacpp:n_decode_total"]
        busy = (after.get("llamacpp:n_busy_slots_per_decode", 0) * after["llamacpp:n_decode_total"] -
                before.get("llamacpp:n_busy_slots_per_decode", 0) * before["llamacpp:n_decode_total"])
        out = {"steps": n, "seqs_per_step": busy / max(1, n), "prompt_computed": d.get("llamacpp:prompt_tokens_total"),
               "tokens": d.get("llamacpp:prompt_tokens_total", 0) + d.get("llamacpp:tokens_predicted_total", 0),
               "prompt_s": d.get("llamacpp:prompt_seconds_total"),
               "generation_s": d.get("llamacpp:tokens_predicted_seconds_total")}
    elif "vllm:iteration_tokens_total_count" in d:               # vLLM
        out = {"steps": d["vllm:iteration_tokens_total_count"], "tokens": d.get("vllm:iteration_tokens_total_sum")}
        if "vllm:prompt_tokens_total" in d:
            out["prompt_computed"] = d["vllm:prompt_tokens_total"] - d.get("vllm:prefix_cache_hits_total", 0)
    if out.get("steps"):
        out["steps_per_s"] = out["steps"] / wall
        if out.get("tokens") is not None:
            out["tokens_per_step"] = out["tokens"] / out["steps"]
    out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}
    out["counters"] = {k: round(v, 4) for k, v in d.items() if v}    # every counter that moved
    return out


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


# ---------------------------------------------------------------- (b): against the peers
class Field:
    """The contenders of (b) and the peers' lifetimes: llama-server restarted per level with -np N,
    vLLM and the extra started once; every peer paused while another contender runs."""

    def __init__(self, a, tmp: Path, ours: list[Contender]):
        self.a, self.tmp, self.ours = a, tmp, ours
        self.fixed: list[Contender] = []               # started once
        self.level: list[Contender] = []               # llama-server, per level
        self.skipped: dict[str, str] = {}
        self.stack = contextlib.ExitStack()
        self.level_stack = contextlib.ExitStack()
        top = max(a.levels)
        for name in a.peer_names:
            if name == "llama-server":
                why = peers.available(name)
                if why:
                    self._skip(name, why)
                continue
            self._start(name, top, self.stack, self.fixed)

    def _skip(self, name: str, why: str) -> None:
        self.skipped[name] = why
        print(f"# {name}: skipped: {why}", flush=True)

    def _start(self, name: str, slots: int, stack, into: list) -> None:
        print(f"# starting {name} (slots {slots}) ...", flush=True)
        try:
            p = stack.enter_context(peers.peer(name, slots=slots, ctx_per_slot=self.a.ctx_per_slot,
                                               threads=self.a.threads, log_dir=self.tmp / "logs",
                                               dtype=self.a.vllm_dtype))
        except peers.Unavailable as e:
            self._skip(name, str(e))
            return
        print(f"# {p.describe()}", flush=True)
        p.pause()
        into.append(peer_contender(p))

    def enter_level(self, n: int) -> None:
        self.level_stack.close()
        self.level = []
        if "llama-server" in self.a.peer_names and "llama-server" not in self.skipped:
            self._start("llama-server", n, self.level_stack, self.level)

    def contenders(self) -> list[Contender]:
        return self.ours + self.level + self.fixed

    def close(self) -> None:
        self.level_stack.close()
        self.stack.close()


def bench_b(field: Field, a, results: dict) -> None:
    for n in a.levels:
        field.enter_level(n)
        cs = field.contenders()
        if not cs:
            print(f"(b) {n} clients: no contender to measure (every peer skipped)", flush=True)
            continue
        for workload in a.workloads:
            key = f"{workload}/{n}"
            per = {c.name: [] for c in cs}
            for r in range(a.rounds):
                order = cs[r % len(cs):] + cs[:r % len(cs)]
                for c in order:
                    c.resume()
                    try:
                        per[c.name].append(run_workload(c, workload, n, a, r))
                    finally:
                        c.pause()
            results["rows"][key] = {"workload": workload, "clients": n, "turns": a.turns,
                                    "max_tokens": a.max_tokens, "rounds": per}
            print_rows(workload, n, a, cs, per)
            if a.json:
                results["contenders"] = {c.name: c.info for c in cs} | results.get("contenders", {})
                write_json(a.json, results)


def print_rows(workload: str, n: int, a, cs: list[Contender], per: dict) -> None:
    what = {"warm": f"{a.turns} turns, system prompt cached before the round",
            "cold": f"{a.turns} turns, a system prompt nobody has seen (cold burst)",
            "plain": f"{a.turns} distinct ~{a.plain_tokens}-token prompts a client, no shared prefix",
            "short": f"{a.turns} requests a client of a few distinct tokens and 1 token out (a request's own cost)"
            }[workload]
    print(f"(b) {workload}, {n} clients x {what}:")
    for c in cs:
        rs = per[c.name]
        col = lambda k: [x[k] for x in rs]   # noqa: E731
        line = (f"    {c.name:16} {spread(col('req_s'))} requests/s" if workload == "short" else
                f"    {c.name:16} {spread(col('tok_s'))} tok/s") + \
            f", TTFT p50 {spread(col('ttft_p50'))} s, p99 {spread(col('ttft_p99'))} s"
        if workload == "cold":
            line += f", first turns p50 {spread(col('first_ttft_p50'))} s p99 {spread(col('first_ttft_p99'))} s"
        line += (f"; {statistics.median(col('out_tokens_per_request')):.1f} tokens a request, "
                 f"cached {sum(col('cached_tokens'))}/{sum(col('prompt_tokens'))} prompt tokens, "
                 f"others' CPU {spread(col('others_cores'))} cores")
        st = [x.get("steps") or {} for x in rs]
        for key, unit in (("steps_per_s", "steps/s"), ("seqs_per_step", "sequences a step"),
                          ("tokens_per_step", "tokens a step")):
            vals = [x[key] for x in st if x.get(key) is not None]
            if vals:
                line += f", {statistics.median(vals):.1f} {unit}"
        fails = sum(col("failures"))
        if fails:
            line += f"; {fails} FAILED ({next(x['error'] for x in rs if x['error'])})"
        print(line, flush=True)
    peer_names = [c.name for c in cs if c.peer is not None and c.name != "llama-cpp-python"]
    for ours in (c.name for c in cs if c.peer is None):
        if not peer_names:
            break
        rounds = range(len(per[ours]))
        rate = "req_s" if workload == "short" else "tok_s"
        best = [max(per[p][r][rate] for p in peer_names) for r in rounds]
        ratio = [per[ours][r][rate] / b if b else float("nan") for r, b in zip(rounds, best)]
        p50 = [per[ours][r]["ttft_p50"] / min(per[p][r]["ttft_p50"] for p in peer_names) for r in rounds]
        p99 = [per[ours][r]["ttft_p99"] / min(per[p][r]["ttft_p99"] for p in peer_names) for r in rounds]
        print(f"    {ours} / the better peer: {'requests' if rate == 'req_s' else 'tok'}/s {spread(ratio)}x, "
              f"TTFT p50 {spread(p50)}x, p99 {spread(p99)}x (below 1: ours earlier)", flush=True)


def write_json(path: str, results: dict) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


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


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: unknown peers, workloads or contenders and levels below 1 are
    errors (argparse's exit status 2); adds ``levels``, ``peer_names`` and ``only`` (sets)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-tokens-a", type=int, default=128)
    p.add_argument("--peers", default="llama-server,vllm", help="from llama-server, vllm; none: Symphony alone")
    p.add_argument("--extras", default="", help="llama-cpp-python: its one-request server, labelled as such")
    p.add_argument("--no-llamacpp", action="store_true", help="the same as --peers none")
    p.add_argument("--ours", default="quantized",
                   help="quantized (the default kernel), float (--weights float), int8 (--activations int8)")
    p.add_argument("--workloads", default="warm,cold,plain")
    p.add_argument("--plain-tokens", type=int, default=400, help="prompt tokens of the plain workload")
    p.add_argument("--kv-memory-mb", type=int, default=2048, help="the kernels' KV pool in (b)")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="tokens a peer's request may hold")
    p.add_argument("--threads", type=int, default=None, help="the peers' threads (default: the CPU count)")
    p.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--only", default="a,b,c", help="which of (a), (b), (c) to run")
    p.add_argument("--kernel-flags", default="", metavar="FLAGS",
                   help="more symphony-kernel flags for each of our kernels, e.g. \"--token-budget 512\"")
    p.add_argument("--json", default=None, help="write every round's figures to this file")
    a = p.parse_args(argv)
    a.kernel_flags = shlex.split(a.kernel_flags)
    a.only = set(x for x in a.only.split(",") if x)
    try:
        a.levels = [int(x) for x in a.clients.split(",")]
    except ValueError:
        p.error(f"--clients {a.clients!r}: comma-separated numbers of concurrent clients")
    names = [] if a.no_llamacpp or a.peers in ("", "none") else [x for x in a.peers.split(",") if x]
    a.workloads = [x for x in a.workloads.split(",") if x]
    a.ours = [x for x in a.ours.split(",") if x]
    extras = [x for x in a.extras.split(",") if x]
    for flag, given, known in (("--peers", names, peers.NAMES), ("--extras", extras, peers.EXTRAS),
                               ("--ours", a.ours, ("quantized", "float", "int8")), ("--workloads", a.workloads, WORKLOADS),
                               ("--only", a.only, ("a", "b", "c"))):
        for bad in (x for x in given if x not in known):
            p.error(f"{flag}: unknown {bad!r} (known: {', '.join(known)})")
    if not a.levels or min(a.levels) < 1 or a.rounds < 1 or a.turns < 1 or a.max_tokens < 1:
        p.error("--clients, --rounds, --turns and --max-tokens must be >= 1")
    if "b" in a.only and not (a.ours or names or extras):
        p.error("(b) needs a contender: --ours or --peers")
    a.peer_names = names + extras
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    only, ours = a.only, a.ours
    machine = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_before": os.getloadavg(),
               "date": time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), "commit": _git_commit()}
    print(f"CPU: {machine['cpu']}, {machine['cores']} cores; load {machine['load_before'][0]:.2f}; {machine['date']}; "
          f"symphony {machine['commit']}")
    if a.peer_names:
        print(f"# peers: {', '.join(a.peer_names)}, from the {peers._where()}", flush=True)
    results = {"machine": machine, "rows": {},
               "args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(a).items()}}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-", dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)                    # a root kernel's gateway runs as another uid
        tmp = Path(tmp)
        sym = Symphony(tmp / "quantized", kv_memory_mb=a.kv_memory_mb if "b" in only else 512, extra=a.kernel_flags)
        syms, field = [sym], None
        try:
            print(f"model {sym.model}; system prompt {len(SYSTEM)} characters; symphony on ports {sym.port} "
                  f"(prefix cache) and {sym.port_nocache} (none)", flush=True)
            if "a" in only:
                bench_a(sym, a.rounds, a.max_tokens_a)
            if "b" in only:
                mine = [symphony_contender("symphony", sym)] if "quantized" in ours else []
                if "float" in ours:
                    syms.append(Symphony(tmp / "float", kv_memory_mb=a.kv_memory_mb, weights="float",
                                         nocache=False, extra=a.kernel_flags))
                    mine.append(symphony_contender("symphony-float", syms[-1]))
                if "int8" in ours:
                    syms.append(Symphony(tmp / "int8", kv_memory_mb=a.kv_memory_mb, nocache=False,
                                         extra=("--activations", "int8", *a.kernel_flags)))
                    mine.append(symphony_contender("symphony-int8", syms[-1]))
                for c in mine:
                    print(f"# {c.name}: {c.info['version']}; weights: {c.info['weights']}; KV {c.info['kv']}; "
                          f"command: {' '.join(c.info['argv'])}", flush=True)
                field = Field(a, tmp, mine)
                results["skipped"] = field.skipped
                bench_b(field, a, results)
            if "c" in only:
                bench_c(sym, a.rounds, 16 if 16 in a.levels else a.levels[-1], a.turns, a.max_tokens)
        except BaseException:
            keep = Path("/tmp/bench-gateway-logs")          # the servers' logs outlive a failed run
            keep.mkdir(exist_ok=True)
            for f in list(tmp.glob("*/*.log")) + list(tmp.glob("logs/*.log")):
                f.replace(keep / f"{f.parent.name}-{f.name}")
            print(f"the servers' logs are in {keep}", file=sys.stderr)
            raise
        finally:
            if field is not None:
                field.close()
            for s in syms:
                s.stop()
    machine["load_after"] = os.getloadavg()
    if a.json:
        write_json(a.json, results)
    print(f"load after: {machine['load_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
