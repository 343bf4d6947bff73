"""The application table: text completion, graph-of-thought, ReAct and SWARM, each as a LIP and
as a client program of the OpenAI API, against Symphony's gateway, vLLM and llama-server.

    python perf/paper/apps.py [--apps completion,got,got-exact,react,swarm] [--concurrency 1,4,16,64]
                              [--programs 20] [--rounds 2] [--contenders lip,gateway,vllm,llama-server]
                              [--vllm-dtype bfloat16] [--json OUT] [--plot PNG]
    python perf/paper/apps.py --agents 1,8,32 [--apps react,swarm] [--rounds 2] ...
    python perf/paper/apps.py --report OUT.json [--plot PNG]   # the tables (and plot) from a run's raw data

Each application is written twice over the same model and prompts:
  lip       the stock program through the kernel's socket (userland/generate.py, got.py,
            react.py, swarm.py): its KV files, forks and merges, token masks and tools in the
            kernel's process; nothing recomputed;
  client    a Python client of /v1/completions, written as users write one: each request
            re-sends the text so far (the server's prefix cache may spare its recomputation);
            a forced choice among fixed openings is one request with ``logit_bias`` (+100 on the
            tokens allowed at the first token where the openings differ; every server here
            takes it); tools run in the client.
The clients run against Symphony's gateway (prefix cache on), vLLM (automatic prefix caching,
``--max-num-seqs`` = the highest concurrency) and llama.cpp's ``llama-server`` (``-np`` = the
highest concurrency, ``--cache-reuse 256``), both started by perf/peers.py on the same model
(vLLM on the GGUF dequantized to --vllm-dtype, llama-server on the Q4_1 file itself; a peer that
is not installed is skipped with the reason printed).  llama-cpp-python's one-request server is
a labelled extra (``llamacpp``), never a default.  Only the contender being measured runs: the
others are paused (SIGSTOP: vLLM spins a core while idle).

  completion  one chat turn, greedy, --max-tokens (generate.py; the client: one request);
  got         4 sampled thoughts on forks of the problem, each scored by the model (log P("Yes")
              after a verification question), the best 2 merged, a greedy conclusion (got.py: the
              kept thoughts' KV merged side by side, each at its own positions: an approximation
              of the prompt that lists them; the client: the thoughts in parallel requests, the
              score from ``logprobs``, the conclusion over the problem and both thoughts; the
              thoughts' requests carry seeds, except to vLLM, whose CPU engine dies on them);
  got-exact   the same with ``got.py --exact``: the LIP feeds the kept thoughts as text on a
              fork of the problem, as the client's prompt has them (exact; the client is got's);
  react       a calc question (react.py: a greedy thought, the line opening forced to Action: or
              Answer:, the tool name forced, its input, the observation; the client: one request
              per step -- the thought and the Action/Answer line, stopped at "Observation:" --
              and, only when the model leaves the format, a forced opening with logit_bias);
  swarm       a calc question through Triage and Math (swarm.py, which forks the team preamble
              from its cache file, or computes it with --swarm-no-cache; the client as OpenAI's
              Swarm sends it: each agent turn is [the agent's instructions, then the
              conversation], its moves forced choices).
Per point (app, contender, concurrency C): max(--programs, C) programs, C at a time, over the
same questions; programs/s, latency p50 and p99, the tokens the model generated per program
(the LIP's own count of what it decoded; the client's ``usage.completion_tokens``), the share
of correct answers (the final answer's last number is the number asked for: react, swarm, got;
the completion has no right answer), failures; each a median over rounds with the per-round
spread, and the LIP's gain over each client (lip programs/s / client programs/s per round).
The contenders alternate within each round.  --json keeps every program's latency, tokens
and answer (the tables judge the answers).  The plot shows programs/s per app and contender at the highest
concurrency, with the per-round range.

--agents N,N,... is the many-agents workload (Autellix-style): for each N, N agent programs
(ReAct and SWARM) start at once per contender and run to their ends: end-to-end programs/s (N /
the wall time of the batch), latency p50 and p99.  The plot then shows programs/s against N.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

import peers  # noqa: E402
from bench_gateway import Symphony, pct  # noqa: E402
from common import cpu_name, pyplot, save, spread  # noqa: E402
from bench_overload import load_tokenizer  # noqa: E402
from symphony.client import Client  # noqa: E402

APPS = ("completion", "got", "got-exact", "react", "swarm")
AGENT_APPS = ("react", "swarm")
CONTENDERS = ("lip", "gateway", "vllm", "llama-server", "llamacpp")
PEER_OF = {"vllm": "vllm", "llama-server": "llama-server", "llamacpp": "llama-cpp-python"}
QUESTIONS = [("What is 37 * 91?", 3367), ("What is 125 + 349?", 474), ("What is 64 / 8 + 3?", 11),
             ("What is 17 * 23 - 5?", 386)]
PROBLEMS = [("A farmer has 3 fields with 12 cows in each field. How many cows does the farmer have?", 36),
            ("A box holds 6 eggs. How many boxes do 48 eggs fill?", 8)]
PROMPTS = ["Write two sentences about the sea.", "Explain what a library is in two sentences."]


def stock(name: str):
    """A stock program's module, loaded in this process for its constants and helpers."""
    spec = importlib.util.spec_from_file_location(f"{name}_lip", REPO / "userland" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def expected(app: str, i: int):
    """The number program ``i`` of ``app`` must answer (None: no right answer)."""
    if app == "completion":
        return None
    return (PROBLEMS[i % len(PROBLEMS)] if app.startswith("got") else QUESTIONS[i % len(QUESTIONS)])[1]


def correct(answer: str, want) -> bool | None:
    """Whether the last number in ``answer`` is ``want`` (3,367 and 11.0 count; "36 + 36 = 72"
    answers 72)."""
    if want is None:
        return None
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", answer or "")
    try:
        return bool(numbers) and abs(float(numbers[-1].replace(",", "").rstrip(",")) - want) < 1e-6
    except ValueError:
        return False


# ---------------------------------------------------------------- the client side
class Remote:
    """A text that grows, and /v1/completions requests that continue it (the client's Writer)."""

    def __init__(self, http: httpx.Client, url: str, model: str, tok, text: str):
        self.http, self.url, self.model, self.tok, self.text = http, url, model, tok, text
        self.generated = 0

    def complete(self, max_tokens: int, **kw) -> dict:
        body = {"model": self.model, "prompt": self.text, "max_tokens": max_tokens, "temperature": 0, **kw}
        r = self.http.post(self.url + "/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}: HTTP {r.status_code}: {r.text[:300]}")
        out = r.json()
        self.generated += (out.get("usage") or {}).get("completion_tokens", 0)
        return out["choices"][0]

    def write(self, text: str) -> None:
        self.text += text

    def until(self, stop: str, limit: int, close: str = "") -> str:
        """Greedy text up to the first character of ``stop``; the text gets it and ``close``."""
        text = self.complete(limit, stop=list(stop))["text"]
        cut = min((text.index(c) for c in stop if c in text), default=len(text))
        self.text += text[:cut] + close
        return text[:cut]

    def choose(self, options: list[str]) -> str:
        """One of ``options``: where they differ, one request of one token with ``logit_bias``
        +100 on the allowed tokens (greedy: the likeliest of them); the tokens all options share
        are written without a request."""
        seqs = [self.tok.encode(o) for o in options]
        done: list[int] = []
        while True:
            live = [s for s in seqs if s[:len(done)] == done]
            allowed = sorted({s[len(done)] for s in live})
            if len(allowed) == 1:
                done.append(allowed[0])                          # forced: no request
            else:
                text = self.complete(1, logit_bias={str(t): 100 for t in allowed})["text"]
                pieces = {t: self.tok.decode([t]) for t in allowed}
                done.append(next((t for t, p in pieces.items() if p == text), None)
                            or next((t for t, p in pieces.items() if p and text.startswith(p)), allowed[0]))
            if done in seqs:
                pick = options[seqs.index(done)]
                self.text += pick
                return pick


def client_completion(http, url, model, tok, i, o, mod=None):
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
    r = Remote(http, url, model, tok, prompt)
    text = r.complete(o.max_tokens)["text"]
    return r.generated, text


ACTION = re.compile(r"\s*Action:\s*(\w+)\[([^\]\n]*)\]")
ANSWER = re.compile(r"\s*Answer:([^\n]*)")


def client_react(http, url, model, tok, i, o, react=None):
    """ReAct as a client writes it: one request a step (the thought and the next line, stopped
    where the observation would begin), parsed; a forced opening only when the model left the
    format."""
    q = QUESTIONS[i % len(QUESTIONS)][0]
    r = Remote(http, url, model, tok, react.FEW_SHOT + f"Question: {q}\nThought:")
    actions = 0
    while True:
        if actions >= react.MAX_ACTIONS:                       # as the LIP: answer now
            r.until("\n", 48, close="\nAnswer:")
            return r.generated, r.until("\n", 96).strip()
        text = r.complete(48 + 64, stop=["\nObservation:", "\nQuestion:"])["text"]
        thought, _, rest = text.partition("\n")
        act, ans = ACTION.match(rest), ANSWER.match(rest)
        if ans:
            return r.generated, ans.group(1).strip()
        if act and act.group(1) in react.TOOLS:
            name, arg = act.group(1), act.group(2).strip()
            r.write(thought + "\n" + f"Action: {name}[{act.group(2)}]")
        else:                                                  # off the format: force the opening
            r.write(thought + "\n")
            if r.choose(["Action:", "Answer:"]) == "Answer:":
                return r.generated, r.until("\n", 96).strip()
            name = r.choose([f" {n}[" for n in react.TOOLS]).strip(" [")
            arg = r.until("]\n", 64, close="]").strip()
        try:
            obs = react.TOOLS[name](arg) if name == "calc" else f"no {name} here"
        except (SyntaxError, ValueError, ArithmeticError) as e:
            obs = f"error: {type(e).__name__}: {e}"
        r.write(f"\nObservation: {' '.join(str(obs).split())[:400]}\nThought:")
        actions += 1


def client_swarm(http, url, model, tok, i, o, swarm=None):
    q = QUESTIONS[i % len(QUESTIONS)][0]
    history = [{"role": "system", "content": swarm.TEAM}, {"role": "user", "content": q}]
    agent, generated, handed = swarm.AGENTS["Triage"], 0, 0
    while True:
        # OpenAI Swarm's request: the agent's instructions first, then the conversation
        msgs = [{"role": "system", "content": agent.instructions + "\n\n" + swarm.TEAM}] + history[1:]
        r = Remote(http, url, model, tok, tok.apply_chat_template(msgs) + f"{agent.name}: ")
        moves, target, answer = [], None, ""
        for step in range(o.max_steps + 1):
            options = [f"{t}[" for t in agent.tools] if step < o.max_steps else []
            if handed < 3 or not agent.answers:
                options += [f"transfer to {x}" for x in agent.transfers]
            options += ["answer:"] if agent.answers else []
            move = r.choose(options)
            if move.startswith("transfer to "):
                moves.append(move)
                target = move[len("transfer to "):]
                break
            if move == "answer:":
                answer = r.until("\n", o.max_tokens).strip()
                moves.append("answer: " + answer)
                break
            arg = r.until("]\n", 64, close="]").strip()
            try:
                result = swarm.TOOLS[move[:-1]](arg) if move == "calc[" else "no files here"
            except (SyntaxError, ValueError, ArithmeticError) as e:
                result = f"error: {type(e).__name__}: {e}"
            moves.append(f"{move[:-1]}[{arg}] -> {result}")
            r.write(f" -> {result}\n")
        generated += r.generated
        history.append({"role": "assistant", "content": f"{agent.name}: " + "\n".join(moves)})
        if target is None:
            return generated, answer
        agent, handed = swarm.AGENTS[target], handed + 1


def client_got(http, url, model, tok, i, o, got=None, seeded=True):
    """``seeded``: each thought's request carries its seed (not to vLLM 0.32's CPU build, whose
    engine dies on a seeded request whose sampled token it discards: "CPU Generator does not
    use offset")."""
    problem = PROBLEMS[i % len(PROBLEMS)][0]
    base = tok.apply_chat_template([{"role": "user", "content": problem}])
    yes = tok.encode("Yes")[0]

    def think(j):
        r = Remote(http, url, model, tok, base + f"Thought {j + 1}:")
        text = r.complete(o.max_tokens, temperature=0.8, top_p=0.95, stop=["\n"],
                          **({"seed": j * 100} if seeded else {}))["text"]
        judge = Remote(http, url, model, tok, r.text + text + got.reply_then_ask(tok, got.VERIFY))
        lp = judge.complete(1, logprobs=20).get("logprobs") or {}
        tops = (lp.get("top_logprobs") or [{}])[0] or {}
        score = max((v for k, v in tops.items() if tok.encode(k)[:1] == [yes]), default=-30.0)
        return j, text.strip(), score, r.generated + judge.generated
    with ThreadPoolExecutor(4) as pool:
        thoughts = list(pool.map(think, range(4)))
    best = sorted(sorted(thoughts, key=lambda t: -t[2])[:2])
    r = Remote(http, url, model, tok, base + "".join(f"Thought {j + 1}: {t}\n" for j, t, _, _ in best)
               + "\nFinal answer:")
    text = r.complete(o.max_tokens)["text"]
    return r.generated + sum(t[3] for t in thoughts), text


CLIENTS = {"completion": client_completion, "react": client_react, "swarm": client_swarm,
           "got": client_got, "got-exact": client_got}


# ---------------------------------------------------------------- the LIP side
def lip_args(app: str, i: int, o) -> tuple[str, list]:
    if app == "completion":
        return "generate.py", [PROMPTS[i % len(PROMPTS)], str(o.max_tokens)]
    if app == "react":
        return "react.py", [QUESTIONS[i % len(QUESTIONS)][0]]
    if app == "swarm":
        return "swarm.py", [QUESTIONS[i % len(QUESTIONS)][0], "--max-steps", str(o.max_steps),
                            "--max-tokens", str(o.max_tokens)] + (["--no-cache"] if o.swarm_no_cache else [])
    return "got.py", [PROBLEMS[i % len(PROBLEMS)][0], "--thoughts", "4", "--keep", "2",
                      "--max-tokens", str(o.max_tokens)] + (["--exact"] if app == "got-exact" else [])


def run_lip(sock: str, app: str, i: int, o, tok) -> tuple[int, str]:
    """One stock program to its end: (tokens it generated, its final answer)."""
    name, args = lip_args(app, i, o)
    texts, last = [], None
    with Client(sock, timeout=900) as c:
        c.spawn((REPO / "userland" / name).read_text(), args, filename=name)
        for ev in c.events(timeout=900):
            if ev.get("event") == "out":
                if isinstance(ev.get("data"), dict):
                    last = ev["data"]
                else:
                    texts.append(ev.get("data") or "")
            elif ev.get("event") == "exit":
                if ev.get("status") != 0:
                    raise RuntimeError(f"{name} failed: {ev}")
    if app == "completion":                 # one 'out' a token, then the closing newline
        text = "".join(texts)
        return max(0, len(texts) - 1), text
    if last is None:
        raise RuntimeError(f"{name} ended without its JSON line")
    answer = last["answers"][-1] if app == "swarm" else last["answer"]
    return int(last["generated"]), answer or ""


# ---------------------------------------------------------------- the run
class Servers:
    """Symphony's kernel (its gateway) and the peers asked for, each paused while another runs."""

    def __init__(self, o, contenders: list[str], slots: int, tmp: Path):
        self.stack = contextlib.ExitStack()
        self.sym = Symphony(tmp, kv_memory_mb=o.kv_memory_mb, nocache=False)
        self.stack.callback(self.sym.stop)
        self.peers: dict[str, peers.Peer] = {}
        for c in contenders:
            if c not in PEER_OF:
                continue
            kw = {"dtype": o.vllm_dtype} if c == "vllm" else {}
            self.peers[c] = self.stack.enter_context(peers.peer(
                PEER_OF[c], slots=1 if c == "llamacpp" else slots, log_dir=tmp,
                ctx_per_slot=8192 if c == "llamacpp" else 2048, **kw))
            self.peers[c].pause()

    def describe(self) -> list[str]:
        return [p.describe() for p in self.peers.values()]

    def target(self, c: str) -> tuple[str, str]:
        if c == "gateway":
            return self.sym.url, self.sym.model
        return self.peers[c].url, self.peers[c].model

    @contextlib.contextmanager
    def only(self, c: str):
        """Contender ``c`` alone running (the peers not measured stay paused)."""
        p = self.peers.get(c)
        if p is not None:
            p.resume()
        try:
            yield
        finally:
            if p is not None:
                p.pause()

    def close(self):
        for p in self.peers.values():
            p.resume()
        self.stack.close()


def measure(servers: Servers, app: str, c: str, conc: int, programs: int, o, tok, mods) -> dict:
    """``programs`` programs of ``app`` through contender ``c``, ``conc`` at a time."""
    runs: list[dict] = []
    http = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=4 * conc + 8))

    def one(i):
        t0 = time.perf_counter()
        try:
            if c == "lip":
                generated, answer = run_lip(servers.sym.sock, app, i, o, tok)
            else:
                url, model = servers.target(c)
                kw = {"seeded": False} if app.startswith("got") and c == "vllm" else {}
                generated, answer = CLIENTS[app](http, url, model, tok, i, o, mods.get(app.split("-")[0]), **kw)
        except Exception as e:                                   # counted, not fatal
            runs.append({"i": i, "error": f"{type(e).__name__}: {e}"[:300],
                         "latency": time.perf_counter() - t0})
            return
        runs.append({"i": i, "latency": time.perf_counter() - t0, "generated": generated,
                     "answer": answer[:200]})                 # judged by `print_table`
    with servers.only(c):
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(conc) as pool:
                list(pool.map(one, range(programs)))
        finally:
            http.close()
        wall = time.perf_counter() - t0
    ok = [r for r in runs if "error" not in r]
    lat = [r["latency"] for r in ok]
    return {"pps": len(ok) / wall, "wall": wall, "p50": pct(lat, 50), "p99": pct(lat, 99),
            "generated": statistics.mean(r["generated"] for r in ok) if ok else float("nan"),
            "failed": len(runs) - len(ok), "programs": sorted(runs, key=lambda r: r["i"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--apps", default=None, help=f"from {','.join(APPS)} (default: all; with --agents: "
                                                 f"{','.join(AGENT_APPS)})")
    ap.add_argument("--contenders", default=None,
                    help=f"from {','.join(CONTENDERS)}, lip included (default: lip, gateway and the peers "
                         "installed; llamacpp, a labelled extra, only when named)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="programs at a time, per point")
    ap.add_argument("--programs", type=int, default=20, help="programs per point, at least the concurrency")
    ap.add_argument("--agents", default=None, metavar="N,N,...",
                    help="the many-agents workload instead of the application table: for each N, N "
                         "ReAct / SWARM programs at once (e.g. 1,8,32); programs/s and latency p50/p99")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-steps", type=int, default=2)
    ap.add_argument("--swarm-no-cache", action="store_true",
                    help="run swarm.py with --no-cache: its team preamble computed in every program")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--kv-memory-mb", type=int, default=2048, help="the kernel's KV pool")
    ap.add_argument("--plot", default=None, help="the plot's file (default apps.png, with --agents "
                                                 "apps_agents.png, beside this script)")
    ap.add_argument("--json", default=None, help="every program of every point, with the run's setup")
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="print the tables of a run's --json (and draw its plot with --plot)")
    o = ap.parse_args()
    if o.report:
        data = json.loads(Path(o.report).read_text())
        print("\n".join(data.get("setup", [])))
        res = {a: {c: {int(n): v for n, v in row.items()} for c, row in r.items()} for a, r in data["res"].items()}
        print_table(res, data["apps"], data["concs"], data["contenders"], data["many"])
        if o.plot:
            (plot_agents if data["many"] else plot_apps)(res, data["apps"], data["concs"], data["contenders"], o.plot)
        return 0
    many = o.agents is not None
    apps = [x for x in (o.apps or ",".join(AGENT_APPS if many else APPS)).split(",") if x]
    if o.contenders is None:
        contenders = ["lip", "gateway"]
        for c in ("vllm", "llama-server"):
            why = peers.available(PEER_OF[c])
            if why:
                print(f"# {c} skipped: {why}", flush=True)
            else:
                contenders.append(c)
    else:
        contenders = [x for x in o.contenders.split(",") if x]
    try:
        concs = [int(x) for x in (o.agents if many else o.concurrency).split(",")]
    except ValueError:
        ap.error("--concurrency and --agents are comma-separated integers")
    if set(apps) - set(AGENT_APPS if many else APPS) or set(contenders) - set(CONTENDERS) \
            or "lip" not in contenders or min(concs) < 1 or o.rounds < 1 or o.programs < 1:
        ap.error(f"--apps from {AGENT_APPS if many else APPS}; --contenders from {CONTENDERS} with lip; "
                 f"--concurrency / --agents, --rounds and --programs >= 1")
    mods = {"react": stock("react"), "swarm": stock("swarm"), "got": stock("got")}
    from symphony.engine.loader import default_model_path
    tok = load_tokenizer(default_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="paper-apps-"))
    os.chmod(tmp, 0o755)                   # the gateway (another uid) reaches the socket there
    slots = max(concs)
    try:
        servers = Servers(o, contenders, slots, tmp)
    except peers.Unavailable as e:
        raise SystemExit(f"a peer did not start: {e}") from e
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    what = (f"many agents, N programs at once, N in {o.agents}" if many
            else f"application table: max({o.programs}, C) programs per point")
    setup = [f"# {what}; SmolLM2-135M-Instruct Q4_1, {cpu_name()}, {os.cpu_count()} vCPUs, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}; --max-tokens "
             f"{o.max_tokens}, --max-steps {o.max_steps}" + (", swarm.py --no-cache" if o.swarm_no_cache else ""),
             f"# load average before: {os.getloadavg()[0]:.2f}"] + [f"# {d}" for d in servers.describe()]
    print("\n".join(setup), flush=True)
    res = {app: {c: {n: [] for n in concs} for c in contenders} for app in apps}
    try:
        for app in apps:                                       # warm-up: each path once
            for c in contenders:
                w = measure(servers, app, c, 1, 1, o, tok, mods)
                if w["failed"]:
                    print(f"  warm-up {app} {c}: {w['programs'][0]['error']}", flush=True)
        for r in range(o.rounds):
            for app in apps:
                for n in concs:
                    order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                    for c in order:
                        res[app][c][n].append(measure(servers, app, c, n, n if many else max(n, o.programs),
                                                      o, tok, mods))
                    print(f"  round {r + 1}/{o.rounds} {app} x{n}: " + ", ".join(
                        f"{c} {res[app][c][n][-1]['pps']:.3f}/s"
                        + (f" ({res[app][c][n][-1]['failed']} failed)" if res[app][c][n][-1]["failed"] else "")
                        for c in contenders), flush=True)
    finally:
        servers.close()
        setup.append(f"# load average after: {os.getloadavg()[0]:.2f}")
        if o.json:
            Path(o.json).write_text(json.dumps({"setup": setup, "apps": apps, "concs": concs,
                                                "contenders": contenders, "many": many, "res": res}))
            print(f"# raw data: {o.json}", flush=True)
    print(setup[-1])
    print_table(res, apps, concs, contenders, many)
    plot = o.plot or str(Path(__file__).with_name("apps_agents.png" if many else "apps.png"))
    (plot_agents if many else plot_apps)(res, apps, concs, contenders, plot)
    return 0


def print_table(res: dict, apps, concs, contenders, many: bool) -> None:
    """The markdown tables: programs/s and the LIP's gains (median and per-round spread), latency
    p50 and p99; then the tokens generated a program, the share of correct answers and failures."""
    others = [c for c in contenders if c != "lip"]
    print("\nprograms/s, median (per-round spread); gain = lip / client per round; latency p50 / p99 s (medians)")
    print(f"| app | {'agents' if many else 'concurrency'} | " + " | ".join(contenders) + " | "
          + " | ".join(f"gain vs {c}" for c in others) + " | "
          + " | ".join(f"p50 / p99 {c}" for c in contenders) + " |")
    print("|---" * (2 + len(contenders) + len(others) + len(contenders)) + "|")
    for app in apps:
        for n in concs:
            row = res[app]
            cells = [spread([x["pps"] for x in row[c][n]], 3) for c in contenders]
            gains = [spread([a["pps"] / b["pps"] if b["pps"] else float("inf")
                             for a, b in zip(row["lip"][n], row[c][n])], 2) for c in others]
            times = [f"{statistics.median(x['p50'] for x in row[c][n]):.2f} / "
                     f"{statistics.median(x['p99'] for x in row[c][n]):.2f}" for c in contenders]
            print(f"| {app} | {n} | " + " | ".join(cells + gains + times) + " |")
    print("\ntokens generated a program (mean, median over rounds); correct answers (all rounds); failed programs")
    print(f"| app | {'agents' if many else 'concurrency'} | " + " | ".join(f"tokens {c}" for c in contenders)
          + " | " + " | ".join(f"correct {c}" for c in contenders) + " | failed |")
    print("|---" * (3 + 2 * len(contenders)) + "|")
    for app in apps:
        for n in concs:
            row = res[app]
            toks = [f"{statistics.median(x['generated'] for x in row[c][n]):.1f}" for c in contenders]
            right = []
            for c in contenders:
                v = [correct(p["answer"], expected(app, p["i"])) for x in row[c][n] for p in x.get("programs", [])
                     if "answer" in p and expected(app, p["i"]) is not None]
                right.append(f"{sum(v)}/{len(v)}" if v else "-")
            failed = ", ".join(f"{c} {sum(x['failed'] for x in row[c][n])}" for c in contenders
                               if sum(x["failed"] for x in row[c][n]))
            print(f"| {app} | {n} | " + " | ".join(toks + right) + f" | {failed or 0} |")


def plot_apps(res: dict, apps, concs, contenders, path: str) -> None:
    """Programs/s per app and contender at the highest concurrency (bars, per-round range)."""
    plt = pyplot()
    if plt is None:
        return
    top = max(concs)
    fig, ax = plt.subplots(figsize=(7.2, 4))
    w = 0.8 / len(contenders)
    for k, c in enumerate(contenders):
        xs = [res[a][c][top] for a in apps]
        med = [statistics.median(x["pps"] for x in r) for r in xs]
        err = [[m - min(x["pps"] for x in r) for m, r in zip(med, xs)],
               [max(x["pps"] for x in r) - m for m, r in zip(med, xs)]]
        ax.bar([j + w * k for j in range(len(apps))], med, w, yerr=err, capsize=2, label=c)
    ax.set_xticks([j + w * (len(contenders) - 1) / 2 for j in range(len(apps))], apps)
    ax.set_ylabel(f"programs/s at {top} concurrent (median, range)")
    ax.set_title(f"Applications as LIPs vs OpenAI-API clients\nSmolLM2-135M Q4_1, {cpu_name()[:40]}", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


def plot_agents(res: dict, apps, concs, contenders, path: str) -> None:
    """Programs/s against the number of concurrent agent programs, per app and contender."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for app, style in zip(apps, ("-", "--", ":")):
        for c in contenders:
            ax.plot(concs, [statistics.median(x["pps"] for x in res[app][c][n]) for n in concs], style,
                    marker="o", label=f"{app} {c}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(concs, [str(n) for n in concs])
    ax.set_xlabel("agent programs at once")
    ax.set_ylabel("programs/s (median)")
    ax.set_title(f"Many concurrent agents: LIPs vs OpenAI-API clients\nSmolLM2-135M Q4_1, {cpu_name()[:40]}",
                 fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())
