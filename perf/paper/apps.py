"""The application table: text completion, graph-of-thought, ReAct and SWARM, each as a LIP and
as a client program driving an OpenAI-compatible server (Symphony's gateway; llama.cpp's server).

    python perf/paper/apps.py [--apps completion,got,react,swarm] [--concurrency 1,4,16]
                              [--programs 8] [--rounds 2] [--contenders lip,gateway,llamacpp] [--plot PNG]
    python perf/paper/apps.py --agents 1,4,16,32 [--apps react,swarm] [--rounds 2] ...

Each application is written twice over the same model, prompts and decoding choices:
  lip       the stock program through the kernel's socket (userland/generate.py, got.py,
            react.py, swarm.py): its KV files, forks and merges, token masks and tools in the
            kernel's process; nothing recomputed;
  client    a Python client of /v1/completions that does what the LIP does with the API it has:
            each generated segment is one request that re-sends the whole text so far (the
            server's prefix cache may spare its recomputation), a forced choice among fixed
            openings is made token by token from ``logprobs`` (one token, the top 20: the
            allowed token ranked highest; the first allowed one if none is there: the
            gateway refuses ``logit_bias``), tools run in the client.  It runs against Symphony's gateway
            (prefix cache on) and against llama.cpp's server (llama-cpp-python[server], prompt
            cache on; one sequence at a time).
  completion  one chat turn, greedy, --max-tokens (generate.py);
  got         4 sampled thoughts on forks of the problem, each scored by the model (log P("Yes")
              after a verification question), the best 2 merged, a greedy conclusion (got.py;
              the client: the thoughts in parallel requests, the score from ``logprobs``, the
              conclusion over the problem and both thoughts, recomputed);
  react       calc questions (react.py: thought, forced Action/Answer, forced tool name, input,
              observation; the client: the same steps as requests);
  swarm       a calc question through Triage and Math (swarm.py, which forks the team preamble
              from its cache file, or computes it with --swarm-no-cache; the client as OpenAI's
              Swarm sends it: each agent turn is [the agent's instructions, then the conversation]).
Per point (app, contender, concurrency C): --programs programs, C at a time; programs/s and
latency p50 (median over rounds, per-round spread), and the gain of the LIP over each client
(lip programs/s / client programs/s per round), in the paper's form.  The contenders
alternate within each round.  The plot shows programs/s per app and contender at the
highest concurrency.  Client and LIP make the same kinds of steps but free text can differ
in length between them (re-tokenised prompts).

--agents N,N,... is the many-agents workload (Autellix-style): for each N, N agent
programs (ReAct and SWARM, over the same questions as above) start at once per contender
and run to their ends; per N, end-to-end programs/s (N / the wall time of the batch) and
the programs' latency p50 and p99, each a median over rounds with its per-round spread,
and the LIP's gain over each client.  The SWARM LIP forks its team preamble from the
cache file the warm-up left (userland/swarm.py), the clients' requests meet the
gateway's prefix cache.  The plot then shows programs/s against N.
llama.cpp is optional: without llama-cpp-python installed, the default contenders leave
it out (naming it in --contenders then fails).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "perf"))

from bench_gateway import LlamaCpp, Symphony, pct  # noqa: E402
from common import cpu_name, pyplot, save, spread  # noqa: E402
from bench_overload import load_tokenizer  # noqa: E402
from symphony.client import Client  # noqa: E402

APPS = ("completion", "got", "react", "swarm")
AGENT_APPS = ("react", "swarm")
CONTENDERS = ("lip", "gateway", "llamacpp")
QUESTIONS = ["What is 37 * 91?", "What is 125 + 349?", "What is 64 / 8 + 3?", "What is 17 * 23 - 5?"]
PROBLEMS = ["A farmer has 3 fields with 12 cows in each field. How many cows does the farmer have?",
            "A box holds 6 eggs. How many boxes do 48 eggs fill?"]
PROMPTS = ["Write two sentences about the sea.", "Explain what a library is in two sentences."]


def stock(name: str):
    """A stock program's module, loaded in this process for its constants and helpers."""
    spec = importlib.util.spec_from_file_location(f"{name}_lip", REPO / "userland" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
        self.generated += out.get("usage", {}).get("completion_tokens", 0)
        return out["choices"][0]

    def write(self, text: str) -> None:
        self.text += text

    def until(self, stop: str, limit: int, close: str = "") -> str:
        text = self.complete(limit, stop=list(stop))["text"]
        cut = min((text.index(c) for c in stop if c in text), default=len(text))
        self.text += text[:cut] + close
        return text[:cut]

    def choose(self, options: list[str]) -> str:
        seqs = [self.tok.encode(o) for o in options]
        done: list[int] = []
        while True:
            live = [s for s in seqs if s[:len(done)] == done]
            allowed = sorted({s[len(done)] for s in live})
            if len(allowed) == 1:
                done.append(allowed[0])                          # forced: no request
            else:                                                # the best allowed of the top 20
                lp = self.complete(1, logprobs=20).get("logprobs") or {}
                tops = (lp.get("top_logprobs") or [{}])[0] or {}
                ranked = sorted(((v, self.tok.encode(k)[:1]) for k, v in tops.items()), reverse=True)
                done.append(next((ids[0] for _, ids in ranked if ids and ids[0] in allowed), allowed[0]))
            if done in seqs:
                pick = options[seqs.index(done)]
                self.text += pick
                return pick


def client_completion(http, url, model, tok, i, o):
    prompt = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
    r = Remote(http, url, model, tok, prompt)
    r.complete(o.max_tokens)
    return r.generated


def client_react(http, url, model, tok, i, o, react=None):
    q = QUESTIONS[i % len(QUESTIONS)]
    r = Remote(http, url, model, tok, react.FEW_SHOT + f"Question: {q}\nThought:")
    actions = 0
    while True:
        r.until("\n", 48, close="\n")
        line = "Answer:" if actions >= react.MAX_ACTIONS else r.choose(["Action:", "Answer:"])
        if line == "Answer:":
            if actions >= react.MAX_ACTIONS:
                r.write("Answer:")
            r.until("\n", 96)
            return r.generated
        name = r.choose([f" {n}[" for n in react.TOOLS]).strip(" [")
        arg = r.until("]\n", 64, close="]").strip()
        try:
            obs = react.TOOLS[name](arg) if name == "calc" else f"no {name} here"
        except (SyntaxError, ValueError, ArithmeticError) as e:
            obs = f"error: {type(e).__name__}: {e}"
        r.write(f"\nObservation: {' '.join(obs.split())[:400]}\nThought:")
        actions += 1


def client_swarm(http, url, model, tok, i, o, swarm=None):
    q = QUESTIONS[i % len(QUESTIONS)]
    history = [{"role": "system", "content": swarm.TEAM}, {"role": "user", "content": q}]
    agent, generated, handed = swarm.AGENTS["Triage"], 0, 0
    while True:
        # OpenAI Swarm's request: the agent's instructions first, then the conversation
        msgs = [{"role": "system", "content": agent.instructions + "\n\n" + swarm.TEAM}] + history[1:]
        r = Remote(http, url, model, tok, tok.apply_chat_template(msgs) + f"{agent.name}: ")
        moves, target = [], None
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
                moves.append("answer: " + r.until("\n", o.max_tokens).strip())
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
            return generated
        agent, handed = swarm.AGENTS[target], handed + 1


def client_got(http, url, model, tok, i, o, got=None):
    problem = PROBLEMS[i % len(PROBLEMS)]
    base = tok.apply_chat_template([{"role": "user", "content": problem}])
    yes = tok.encode("Yes")[0]

    def think(j):
        r = Remote(http, url, model, tok, base + f"Thought {j + 1}:")
        text = r.complete(o.max_tokens, temperature=0.8, top_p=0.95, seed=j * 100, stop=["\n"])["text"]
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
    r.complete(o.max_tokens)
    return r.generated + sum(t[3] for t in thoughts)


# ---------------------------------------------------------------- the LIP side
def lip_args(app: str, i: int, o) -> tuple[str, list]:
    if app == "completion":
        return "generate.py", [PROMPTS[i % len(PROMPTS)], str(o.max_tokens)]
    if app == "react":
        return "react.py", [QUESTIONS[i % len(QUESTIONS)]]
    if app == "swarm":
        return "swarm.py", [QUESTIONS[i % len(QUESTIONS)], "--max-steps", str(o.max_steps),
                            "--max-tokens", str(o.max_tokens)] + (["--no-cache"] if o.swarm_no_cache else [])
    return "got.py", [PROBLEMS[i % len(PROBLEMS)], "--thoughts", "4", "--keep", "2",
                      "--max-tokens", str(o.max_tokens)]


def run_lip(sock: str, app: str, i: int, o) -> int:
    name, args = lip_args(app, i, o)
    with Client(sock, timeout=900) as c:
        c.spawn((REPO / "userland" / name).read_text(), args, filename=name)
        for ev in c.events(timeout=900):
            if ev.get("event") == "exit":
                if ev.get("status") != 0:
                    raise RuntimeError(f"{name} failed: {ev}")
                return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--apps", default=None, help=f"from {','.join(APPS)} (default: all; with --agents: "
                                                 f"{','.join(AGENT_APPS)})")
    ap.add_argument("--contenders", default=None,
                    help=f"from {','.join(CONTENDERS)}, lip included (default: all; llamacpp only where "
                         "llama-cpp-python is installed)")
    ap.add_argument("--concurrency", default="1,4,16", help="programs at a time, per point (default 1,4,16)")
    ap.add_argument("--programs", type=int, default=8, help="programs per point (default 8)")
    ap.add_argument("--agents", default=None, metavar="N,N,...",
                    help="the many-agents workload instead of the application table: for each N, N "
                         "ReAct / SWARM programs at once (e.g. 1,4,16,32); programs/s and latency "
                         "p50/p99 per N")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-steps", type=int, default=2)
    ap.add_argument("--swarm-no-cache", action="store_true",
                    help="run swarm.py with --no-cache: its team preamble computed in every program")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    ap.add_argument("--plot", default=None, help="the plot's file (default apps.png, with --agents "
                                                 "apps_agents.png, beside this script)")
    ap.add_argument("--json", default=None)
    o = ap.parse_args()
    many = o.agents is not None
    apps = [x for x in (o.apps or ",".join(AGENT_APPS if many else APPS)).split(",") if x]
    contenders = [x for x in (o.contenders or ",".join(CONTENDERS)).split(",") if x]
    if o.contenders is None and importlib.util.find_spec("llama_cpp") is None:
        print("# llama-cpp-python is not installed: no llamacpp contender", flush=True)
        contenders.remove("llamacpp")
    try:
        concs = [int(x) for x in (o.agents if many else o.concurrency).split(",")]
    except ValueError:
        ap.error("--concurrency and --agents are comma-separated integers")
    if set(apps) - set(AGENT_APPS if many else APPS) or set(contenders) - set(CONTENDERS) \
            or "lip" not in contenders or min(concs) < 1 or o.rounds < 1:
        ap.error(f"--apps from {AGENT_APPS if many else APPS}; --contenders from {CONTENDERS} with lip; "
                 f"--concurrency / --agents >= 1; --rounds >= 1")
    mods = {"react": stock("react"), "swarm": stock("swarm"), "got": stock("got")}
    from symphony.engine.loader import default_model_path
    tok = load_tokenizer(default_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="paper-apps-"))
    os.chmod(tmp, 0o755)                   # the gateway (another uid) reaches the socket there
    sym = Symphony(tmp, kv_memory_mb=512)
    llama = LlamaCpp(tmp, str(default_model_path()), o.threads) if "llamacpp" in contenders else None
    what = (f"many agents, N programs at once, N in {o.agents}" if many
            else f"application table: {o.programs} programs per point")
    print(f"# {what}; SmolLM2-135M-Instruct Q4_1, {cpu_name()}, {os.cpu_count()} vCPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; --max-tokens {o.max_tokens}, "
          f"--max-steps {o.max_steps}" + (", swarm.py --no-cache" if o.swarm_no_cache else ""), flush=True)
    clients = {"completion": client_completion, "react": client_react, "swarm": client_swarm, "got": client_got}

    def point(app, c, conc, programs) -> dict:
        lat = []
        http = httpx.Client(timeout=900, limits=httpx.Limits(max_connections=conc + 8))

        def one(i):
            t0 = time.perf_counter()
            if c == "lip":
                run_lip(sym.sock, app, i, o)
            else:
                url, model = ((f"http://127.0.0.1:{sym.port}", sym.model) if c == "gateway"
                              else (f"http://127.0.0.1:{llama.port}", "llamacpp"))
                kw = {app: mods[app]} if app in mods else {}
                clients[app](http, url, model, tok, i, o, **kw)
            lat.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(conc) as pool:
                list(pool.map(one, range(programs)))
        finally:
            http.close()
        return {"pps": programs / (time.perf_counter() - t0), "p50": pct(lat, 50), "p99": pct(lat, 99)}

    res = {app: {c: {n: [] for n in concs} for c in contenders} for app in apps}
    try:
        for app in apps:                                       # warm-up: each path once
            for c in contenders:
                point(app, c, 1, 1)
        for r in range(o.rounds):
            for app in apps:
                for n in concs:
                    order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
                    for c in order:
                        res[app][c][n].append(point(app, c, n, n if many else o.programs))
                    print(f"  round {r + 1}/{o.rounds} {app} x{n}: " + ", ".join(
                        f"{c} {res[app][c][n][-1]['pps']:.3f} programs/s" for c in contenders), flush=True)
    finally:
        sym.stop()
        if llama is not None:
            llama.stop()

    print_table(res, apps, concs, contenders, many)
    if o.json:
        Path(o.json).write_text(json.dumps(res))
    plot = o.plot or str(Path(__file__).with_name("apps_agents.png" if many else "apps.png"))
    (plot_agents if many else plot_apps)(res, apps, concs, contenders, plot)
    return 0


def print_table(res: dict, apps, concs, contenders, many: bool) -> None:
    """The markdown table: programs/s and the LIP's gains (median and per-round spread), latency
    p50 (the application table: medians) or p50 and p99 (--agents: with their spread)."""
    others = [c for c in contenders if c != "lip"]
    lats = ("p50", "p99") if many else ("p50",)
    print("\nprograms/s, median (per-round spread); gain = lip / client per round; latency "
          + ("p50 and p99 s, median (per-round spread)" if many else "p50 s"))
    print(f"| app | {'agents' if many else 'concurrency'} | " + " | ".join(contenders) + " | "
          + " | ".join(f"gain vs {c}" for c in others) + " | "
          + " | ".join(f"{q} {c}" for q in lats for c in contenders) + " |")
    print("|---" * (2 + len(contenders) + len(others) + len(lats) * len(contenders)) + "|")
    for app in apps:
        for n in concs:
            row = res[app]
            cells = [spread([x["pps"] for x in row[c][n]], 3) for c in contenders]
            gains = [spread([a["pps"] / b["pps"] for a, b in zip(row["lip"][n], row[c][n])], 3) for c in others]
            times = [spread([x[q] for x in row[c][n]], 2) if many
                     else f"{statistics.median(x[q] for x in row[c][n]):.2f}" for q in lats for c in contenders]
            print(f"| {app} | {n} | " + " | ".join(cells + gains + times) + " |")


def plot_apps(res: dict, apps, concs, contenders, path: str) -> None:
    """Programs/s per app and contender at the highest concurrency (bars)."""
    plt = pyplot()
    if plt is None:
        return
    top = max(concs)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    w = 0.8 / len(contenders)
    for k, c in enumerate(contenders):
        ax.bar([j + w * k for j in range(len(apps))],
               [statistics.median(x["pps"] for x in res[a][c][top]) for a in apps], w, label=c)
    ax.set_xticks([j + w * (len(contenders) - 1) / 2 for j in range(len(apps))], apps)
    ax.set_ylabel(f"programs/s at {top} concurrent (median)")
    ax.set_title(f"Applications as LIPs vs OpenAI-API clients\nSmolLM2-135M Q4_1, {cpu_name()[:40]}", fontsize=9)
    ax.legend()
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
