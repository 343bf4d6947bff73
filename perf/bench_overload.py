"""Overload: N concurrent generate LIPs with ~1,000-token prompts, against llama.cpp's server.

    python perf/bench_overload.py [--ns 4,16,64] [--prompt-tokens 1000] [--max-tokens 64]
                                  [--repeat R] [--configs default,swap,llamacpp] [--quick]
                                  [--model PATH.gguf] [--llama-threads T] [--timeout S] [--json FILE]

The overload benchmark: does every honest request finish when more work arrives than fits,
and does throughput hold up?  For each N in --ns, N clients start at once (a barrier), each
with its own deterministic ~--prompt-tokens-token prompt (numbered paragraphs of invented
but real-looking notes, measured with the model's tokenizer after the chat template), and
ask for --max-tokens greedy tokens.  Contenders (--configs):

  default   ``symphony-kernel`` with its DEFAULT flags (only --socket, and --model when
            given): each client is one connection (``symphony.client.Client``) running the
            stock ``userland/generate.py "<prompt>" <max-tokens>``;
  swap      the same with ``--swap-dir <a temporary directory>`` (a disk KV tier);
  llamacpp  llama.cpp's OpenAI-compatible server (``python -m llama_cpp.server``, from
            llama-cpp-python[server]: a perf-only dependency) on the same GGUF, N clients
            posting /v1/completions (the same chat-templated prompt text, max_tokens,
            temperature 0) at once.  llama-cpp-python's server has one context behind a
            lock and no parallel slots, so it serves one request at a time; the script
            says so when it finds that lock.  When it cannot run, the script says why
            and reports the others.

Per request: finished or not (exit status, reason, the last line of its stderr or the
refusal), latency (spawn request -> exit event; HTTP request -> reply) and output tokens
(one ``out`` event per generated token, plus the final flush, in generate.py; llama.cpp's
``usage.completion_tokens``).  Per wave: completed/N, output tokens/s = output tokens of the
completed requests / wall time from the first start to the last end, latency p50 / p99 over
the completed requests (nearest rank), and for the kernel the KV pages still used after the
wave against before it, its counters' increases and gauges (forward passes, pred calls, and
any overload entry its ``stats`` reports: preemptions, drops, swap bytes, queue...), and how
many LIPs waited in the admission queue and for how long (their ``started`` event).  Every
completed symphony run of a prompt (all N, rounds, both kernels) must give the same greedy
text; the script counts the prompts that did.

Rounds are interleaved (round 1: every contender, every N; round 2: ...); each contender
gets a fresh kernel or server each round, warmed up by one short untimed request (for the
kernel a small LIP of its own, so that admission does not learn generate.py's KV need from it).  With
--repeat R > 1 the table gives the median over rounds and the per-round spread (min..max).
The last lines check the overload goals for each contender: 100% completion at every N, and
output tok/s at the largest N >= 0.9x that of the best N (no collapse under overload).

--quick: N = 2, 4 and 200-token prompts (a smoke run).  Ctrl-C or SIGTERM stops the run and
reports the waves that ended; --json is rewritten after every wave.  Run it on a quiet machine:
llama.cpp's threads spin at barriers when the cores are oversubscribed.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.metadata
import importlib.util
import json
import math
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from symphony.client import Client, KernelError   # noqa: E402

CONTENDERS = {"default": "symphony, default kernel", "swap": "symphony, default + --swap-dir",
              "llamacpp": "llama.cpp server (llama-cpp-python)"}
SERVER_MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")

# ------------------------------------------------------------------------------ the prompts
WHO = ["The harbour master", "A retired surveyor", "The village baker", "Our field botanist", "The night clerk",
       "A visiting engineer", "The archive keeper", "The ferry captain", "An apprentice weaver", "The old miller"]
DID = ["counted", "repaired", "catalogued", "sold", "measured", "painted", "carried", "found", "weighed", "sorted"]
WHAT = ["copper lanterns", "river stones", "glass bells", "wool maps", "silver keys", "clay owls", "old clocks",
        "blue kites", "salt jars", "cedar boxes", "iron gears", "paper boats", "brass compasses", "linen sails"]
WHERE = ["near the northern bridge", "behind the grain market", "on the high plateau", "along the salt marsh",
         "in the canal district", "at the eastern gate", "under the clock tower", "beside the quarry road"]
WHEN = ["before the spring floods", "during the long winter", "on market days", "after the harvest fair",
        "every second morning", "while the river was low", "in the week of the storm", "at first light"]
WHY = ["because the council had asked for a full record", "so that the guild could settle an old dispute",
       "although nobody had requested it", "to prepare for the visit of the inspectors",
       "since the previous ledger had been lost", "as part of a wager with the ferry crew"]
# the kernel's warm-up LIP: not generate.py's source, so admission does not learn its tiny peak
# as generate.py's expected KV (admission keys the peaks it saw by program source)
WARMUP = """
from symphony.lip import kv, pred, send, tokenize

def main(*args):
    with kv.create() as f:
        send(pred(f, tokenize("Hello, warm-up"), output="argmax"))
"""
ASK = "Summarize these notes in two sentences, naming the people involved."


def load_tokenizer(path):
    """The model's tokenizer from the GGUF metadata (no weights are read)."""
    import gguf
    from symphony.tokenizer import Tokenizer
    fields = gguf.GGUFReader(str(path)).fields

    def meta(key, default=None):
        f = fields.get(key)
        return default if f is None else f.contents()
    return Tokenizer.from_gguf_fields(meta, Path(path))


def make_prompt(tok, i: int, target: int) -> tuple[str, int]:
    """(question, its token count after the chat template): prompt ``i``'s numbered notes,
    sentence by sentence until the chat-templated prompt has at least ``target`` tokens."""
    import random
    rnd = random.Random(1000 + i)
    paras, sent = [], []
    while True:
        if not sent or len(sent) >= rnd.randint(4, 7):
            sent = []
            paras.append(sent)
        sent.append(f"{rnd.choice(WHO)} {rnd.choice(DID)} {rnd.randint(2, 990)} {rnd.choice(WHAT)} "
                    f"{rnd.choice(WHERE)} {rnd.choice(WHEN)}, {rnd.choice(WHY)}.")
        body = "\n\n".join(f"{k + 1}. " + " ".join(p) for k, p in enumerate(paras))
        q = f"Notes from ledger {i + 1}.\n\n{body}\n\n{ASK}"
        n = len(tok.encode_chat([{"role": "user", "content": q}]))
        if n >= target:
            return q, n


# ------------------------------------------------------------------------------ servers
@contextlib.contextmanager
def serving(cmd: list, log_path: Path, ready, what: str, env=None):
    """Run ``cmd`` (output to ``log_path``) until the block ends; enters once ``ready()`` is
    true (RuntimeError with the log's tail if the process dies first or 10 minutes pass)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        t_end = time.time() + 600
        while not ready():
            if proc.poll() is not None or time.time() > t_end:
                raise RuntimeError(f"{what} did not start ({log_path}):\n{log_path.read_text()[-2000:]}")
            time.sleep(0.25)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------ symphony
@contextlib.contextmanager
def kernel(workdir: Path, extra: list[str], model):
    """A ``symphony-kernel`` with default flags (plus ``extra``) on a socket in ``workdir``;
    yields the socket path once the kernel says it is ready."""
    sock, log_path = str(workdir / "kernel.sock"), workdir / "kernel.log"
    cmd = [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())",
           "--socket", sock, *(["--model", str(model)] if model else []), *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), SYMPHONY_SOCKET=sock)
    with serving(cmd, log_path, lambda: "ready on" in log_path.read_text(), "the kernel", env):
        yield sock


def run_generate(sock: str, source: str, prompt: str, max_tokens: int, barrier, timeout: float) -> dict:
    """One client running generate.py: {ok, latency, tokens, why, start, end}."""
    why, status, outs, err, text, waited = "", None, 0, [], [], None
    barrier.wait()
    t0 = time.perf_counter()
    try:
        with Client(sock, timeout=timeout) as c:
            c.spawn(source, [prompt, str(max_tokens)], filename="generate.py")
            for ev in c.events(timeout=timeout):
                kind = ev.get("event")
                if kind == "out":
                    outs += 1
                    text.append(ev["data"] if isinstance(ev.get("data"), str) else "")
                elif kind == "stderr":
                    err.append(str(ev.get("data", "")))
                elif kind == "started" and isinstance(ev.get("waited_s"), (int, float)):
                    waited = float(ev["waited_s"])    # it waited in the admission queue
                elif kind == "exit":
                    status, why = ev.get("status"), str(ev.get("reason", ""))
    except KernelError as e:
        why = f"refused: {e.code}: {e}"
    except (OSError, ConnectionError) as e:             # socket.timeout is an OSError
        why = f"client: {type(e).__name__}: {e}"
    t1 = time.perf_counter()
    last = [ln for ln in "".join(err).splitlines() if ln.strip()]
    if last:
        why = f"{why}: {last[-1].strip()}" if why else last[-1].strip()
    ok = status == 0
    # generate.py sends once per generated token, then once more (the decoder's flush)
    return {"ok": ok, "latency": t1 - t0, "tokens": max(0, outs - 1) if ok else outs, "why": "" if ok else why,
            "start": t0, "end": t1, "text": "".join(text), "waited": waited}


def kernel_counters(sock: str) -> dict:
    """The kernel's numeric stats (nested dicts flattened: ``overload.preemptions``)."""
    with Client(sock) as c:
        st = c.stats()
    flat = {}
    for k, v in st.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{kk}": vv for kk, vv in v.items() if isinstance(vv, (int, float))})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            flat[k] = v
    return flat


def settled_pages(sock: str, before: int, wait_s: float = 10.0) -> int:
    """KV pages used once the wave's files are reclaimed (polls up to ``wait_s`` for ``before``)."""
    t_end = time.time() + wait_s
    while True:
        used = kernel_counters(sock).get("kv_pages_used", -1)
        if used <= before or time.time() > t_end:
            return used
        time.sleep(0.5)


WATCHED = ("forward_passes", "pred_calls", "preempt", "resume", "suspend", "drop", "swap", "queue", "admi", "recompute")
GAUGES = ("max", "p50", "p90", "p99", "free", "peak", "files", "queued", "len")   # values, not counts


def symphony_wave(sock: str, source: str, prompts: list[str], max_tokens: int, timeout: float) -> dict:
    """N generate LIPs at once through ``sock``; the wave's records and counters."""
    before = kernel_counters(sock)
    barrier = threading.Barrier(len(prompts))
    recs: list = [None] * len(prompts)

    def one(i):
        recs[i] = run_generate(sock, source, prompts[i], max_tokens, barrier, timeout)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = kernel_counters(sock)
    pages = settled_pages(sock, before.get("kv_pages_used", 0))
    delta = {(f"{k}=" if any(g in k for g in GAUGES) else f"{k}+"):
             (v if any(g in k for g in GAUGES) else v - before.get(k, 0))
             for k, v in after.items() if any(w in k for w in WATCHED) and v != before.get(k, 0)}
    return {"recs": recs, "counters": delta, "pages_before": before.get("kv_pages_used"), "pages_after": pages}


# ------------------------------------------------------------------------------ llama.cpp
def llama_server_problem() -> str:
    """Why llama.cpp's server cannot run here ('' when it can)."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return f"missing {', '.join(missing)} (pip install 'llama-cpp-python[server]')"
    return ""


def llama_serialises():
    """True when llama-cpp-python's server serves one request at a time (its model lock);
    None when its app module cannot be imported here (the server's start then tells why)."""
    try:
        from llama_cpp.server import app
    except Exception:                                  # noqa: BLE001 - any import failure: unknown
        return None
    return hasattr(app, "llama_inner_lock") or hasattr(app, "llama_outer_lock")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def llama_server(workdir: Path, model, n_ctx: int, threads: int):
    """``python -m llama_cpp.server`` on a free local port; yields its base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads),
           "--n_threads_batch", str(threads)]
    url = f"http://127.0.0.1:{port}"
    with serving(cmd, workdir / "llama-server.log", lambda: _answers(url + "/v1/models"), "llama.cpp's server"):
        yield url


def post_completion(url: str, text: str, max_tokens: int, barrier, timeout: float) -> dict:
    """One /v1/completions request: the same record as `run_generate`'s."""
    body = json.dumps({"prompt": text, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    ok, tokens, why, prompt_tokens = False, 0, "", None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply = json.loads(r.read())
        usage = reply.get("usage") or {}
        tokens, prompt_tokens = int(usage.get("completion_tokens", 0)), usage.get("prompt_tokens")
        ok = bool(reply.get("choices"))
        why = "" if ok else f"no choices in the reply: {str(reply)[:200]}"
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code}: {e.read()[:200]!r}"
    except (OSError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    t1 = time.perf_counter()
    return {"ok": ok, "latency": t1 - t0, "tokens": tokens, "why": why, "start": t0, "end": t1,
            "prompt_tokens": prompt_tokens}


def llama_wave(url: str, texts: list[str], max_tokens: int, timeout: float) -> dict:
    barrier = threading.Barrier(len(texts))
    recs: list = [None] * len(texts)

    def one(i):
        recs[i] = post_completion(url, texts[i], max_tokens, barrier, timeout)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"recs": recs, "counters": {}}


# ------------------------------------------------------------------------------ figures
def pct(xs, q):
    """Nearest-rank percentile (q in (0, 1]); NaN for no values."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def summarize(wave: dict) -> dict:
    recs = wave["recs"]
    done = [r for r in recs if r["ok"]]
    wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
    lat = [r["latency"] for r in done]
    return {"n": len(recs), "completed": len(done), "tok_s": sum(r["tokens"] for r in done) / wall,
            "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "wall": wall,
            "tokens": sum(r["tokens"] for r in done),
            "why": collections.Counter(r["why"] for r in recs if not r["ok"]).most_common(3),
            "counters": wave.get("counters", {}),
            "requests": [{k: r[k] for k in ("ok", "latency", "tokens", "why", "prompt_tokens", "text", "waited") if k in r}
                         for r in recs],
            "pages": (wave.get("pages_before"), wave.get("pages_after"))}


def spread(vals, fmt="{:.1f}"):
    vals = [v for v in vals if v == v]                 # no NaN (a wave that completed nothing)
    if not vals:
        return "-"
    med = fmt.format(statistics.median(vals))
    return med if len(vals) == 1 else f"{med} ({fmt.format(min(vals))}..{fmt.format(max(vals))})"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="4,16,64", help="concurrency levels, comma-separated (default 4,16,64)")
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length after the chat template")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens asked for (default 64)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every contender and N (default 1)")
    ap.add_argument("--configs", default="default,swap,llamacpp",
                    help=f"contenders, comma-separated, from {', '.join(CONTENDERS)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = 2, 4; 200-token prompts")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--llama-threads", type=int, default=0,
                    help="llama.cpp's threads (default: torch's, as the kernel uses)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one request may take (default 3600)")
    ap.add_argument("--json", default=None, help="write every wave's records and figures here")
    a = ap.parse_args()
    if a.quick:
        a.ns, a.prompt_tokens = "2,4", 200
    try:
        ns = [int(x) for x in a.ns.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--ns: expected comma-separated ints, got {a.ns!r}")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONTENDERS]
    if bad or not configs:
        ap.error(f"--configs: unknown {bad} (choose from {', '.join(CONTENDERS)})")
    if not ns or min(ns) < 1 or a.prompt_tokens < 1 or a.max_tokens < 1 or a.repeat < 1 or a.llama_threads < 0:
        ap.error("--ns, --prompt-tokens, --max-tokens and --repeat must be >= 1, --llama-threads >= 0")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    import torch
    from symphony.engine.loader import default_model_path
    model = Path(a.model) if a.model else default_model_path()
    tok = load_tokenizer(model)
    threads = torch.get_num_threads()
    prompts, counts = zip(*(make_prompt(tok, i, a.prompt_tokens) for i in range(max(ns))))
    texts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
    print(f"# CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__} ({threads} threads); "
          f"model {model.name} ({model.stat().st_size / 1e6:.1f} MB)", flush=True)
    print(f"# {max(ns)} distinct prompts of {min(counts)}..{max(counts)} tokens (chat template included), "
          f"{a.max_tokens} greedy output tokens at most; N = {', '.join(map(str, ns))}; {a.repeat} round(s); "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    skipped = {}
    if "llamacpp" in configs:
        why = llama_server_problem()
        if why:
            skipped["llamacpp"] = why
            configs.remove("llamacpp")
        else:
            serial = ("; it serves one request at a time (one context behind a lock, no parallel slots): "
                      "its N clients queue for it") if llama_serialises() else ""
            print(f"# llama.cpp server: llama-cpp-python {importlib.metadata.version('llama_cpp_python')}, "
                  f"{a.llama_threads or threads} threads{serial}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    results = {c: {n: [] for n in ns} for c in configs}

    def save():
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "prompt_tokens": counts, "skipped": skipped,
                                                "results": {c: {str(n): v for n, v in per.items()}
                                                            for c, per in results.items()}}, indent=1))
    signal.signal(signal.SIGTERM, signal.default_int_handler)     # a stopped run still reports
    try:
        run_rounds(a, ns, configs, results, skipped, tmp, save, model, threads, prompts, counts, texts)
    except KeyboardInterrupt:
        print("  interrupted: the figures below are of the waves that ended", flush=True)
    for d in tmp.glob("*/swap"):                       # the logs stay; the disk tier goes
        shutil.rmtree(d, ignore_errors=True)
    print(f"\n(kernel and server logs: {tmp})")
    report(results, ns, skipped)
    save()
    return 0


def run_rounds(a, ns, configs, results, skipped, tmp, save, model, threads, prompts, counts, texts):
    """Every round: each contender in turn (a fresh kernel or server), every N; results[c][n]
    gets each wave's summary, and ``save()`` runs after each wave."""
    source = (REPO / "userland/generate.py").read_text()
    for r in range(a.repeat):
        for c in list(configs):
            work = tmp / f"{c}-{r}"
            work.mkdir()
            try:
                if c == "llamacpp":
                    ctx = max(counts) + a.max_tokens + 64
                    with llama_server(work, model, ctx, a.llama_threads or threads) as url:
                        post_completion(url, texts[0][:200], 4, None, a.timeout)      # warm-up
                        for n in ns:
                            results[c][n].append(summarize(llama_wave(url, texts[:n], a.max_tokens, a.timeout)))
                            print(f"  round {r + 1} {c} N={n}: {line(results[c][n][-1])}", flush=True)
                            save()
                    continue
                extra = ["--swap-dir", str(work / "swap")] if c == "swap" else []
                with kernel(work, extra, a.model) as sock:
                    warm = run_generate(sock, WARMUP, "", 0, threading.Barrier(1), a.timeout)
                    if not warm["ok"]:
                        raise RuntimeError(f"the warm-up LIP failed: {warm['why']}")
                    for n in ns:
                        results[c][n].append(summarize(symphony_wave(sock, source, list(prompts[:n]),
                                                                     a.max_tokens, a.timeout)))
                        print(f"  round {r + 1} {c} N={n}: {line(results[c][n][-1])}", flush=True)
                        save()
            except RuntimeError as e:
                print(f"  round {r + 1} {c}: could not run: {e}", flush=True)
                skipped[c] = str(e).splitlines()[0]
                configs.remove(c)
                if not all(results[c].values()):          # keep a contender only with every N measured
                    results.pop(c)


def line(s: dict) -> str:
    pages = "" if s["pages"][0] is None else f", KV pages used {s['pages'][0]} -> {s['pages'][1]}"
    why = "".join(f"; {k} x {w[:160]}" for w, k in s["why"])
    cnt = f", counters {s['counters']}" if s["counters"] else ""
    waits = [r["waited"] for r in s["requests"] if r.get("waited") is not None]
    cnt += f", {len(waits)} queued at spawn: wait p50 {pct(waits, 0.5):.1f} s, max {max(waits):.1f} s" if waits else ""
    pt = [r["prompt_tokens"] for r in s["requests"] if r.get("prompt_tokens")]
    cnt += f", prompt tokens as the server counts them {min(pt)}..{max(pt)}" if pt else ""
    return (f"{s['completed']}/{s['n']} completed, {s['tok_s']:.1f} tok/s, p50 {s['p50']:.1f} s, "
            f"p99 {s['p99']:.1f} s, wave {s['wall']:.1f} s{pages}{cnt}{why}")


def consistency(results: dict) -> tuple[int, int]:
    """(prompts whose completed symphony runs all gave one text, prompts completed more than once)."""
    texts = collections.defaultdict(list)
    for c, per in results.items():
        for waves in (per.values() if c != "llamacpp" else ()):
            for s in waves:
                for i, r in enumerate(s["requests"]):
                    if r["ok"]:
                        texts[i].append(r["text"])
    multi = [set(t) for t in texts.values() if len(t) > 1]
    return sum(len(t) == 1 for t in multi), len(multi)


def report(results: dict, ns: list, skipped: dict) -> None:
    """The table, the failures, the greedy-output check and the goal lines (of the waves that ended)."""
    print("\n| contender | N | completed | output tok/s | latency p50 s | latency p99 s | wave s |")
    print("|---|---|---|---|---|---|---|")
    for c, per in results.items():
        for n in ns:
            rs = per[n]
            if not rs:
                print(f"| {CONTENDERS[c]} | {n} | not measured | - | - | - | - |")
                continue
            done = [s["completed"] for s in rs]
            comp = f"{min(done)}/{n}" if min(done) == max(done) else f"{min(done)}..{max(done)}/{n}"
            print(f"| {CONTENDERS[c]} | {n} | {comp} | {spread([s['tok_s'] for s in rs])} | "
                  f"{spread([s['p50'] for s in rs])} | {spread([s['p99'] for s in rs])} | "
                  f"{spread([s['wall'] for s in rs])} |")
    fails = [(c, n, collections.Counter(w for s in per[n] for w, k in s["why"] for _ in range(k)))
             for c, per in results.items() for n in ns]
    if any(cnt for _, _, cnt in fails):
        print("\nFailures (all rounds; the three commonest reasons of each wave):")
    for c, n, cnt in fails:
        for w, k in cnt.most_common(3):
            print(f"  {CONTENDERS[c]}, N={n}: {k} x {w[:200]}")
    same, runs = consistency(results)
    if runs:
        print(f"\nGreedy outputs of symphony (every completed run of a prompt, all N, rounds and kernels): "
              f"{same} of {runs} prompts run more than once gave the same text every time")
    for c, why in skipped.items():
        print(f"\n{CONTENDERS[c]}: not run: {why}")
    print(f"\nGoals: 100% completion at every N; output tok/s at N={max(ns)} >= 0.9x the best N.")
    for c, per in results.items():
        got = [n for n in ns if per[n]]
        if not got:
            continue
        short = [f"N={n}: {min(s['completed'] for s in per[n])}/{n}" for n in got
                 if min(s["completed"] for s in per[n]) < n]
        rate = {n: statistics.median(s["tok_s"] for s in per[n]) for n in got}
        best = max(rate.values())
        ratio = rate[max(got)] / best if best > 0 else 0.0
        partial = f" (measured only N = {', '.join(map(str, got))})" if got != ns else ""
        print(f"  {CONTENDERS[c]}: completion {'MET' if not short else 'NOT MET (' + ', '.join(short) + ')'}; "
              f"tok/s N={max(got)} / best = {ratio:.2f}x {'MET' if ratio >= 0.9 else 'NOT MET'}{partial}")


if __name__ == "__main__":
    sys.exit(main())
