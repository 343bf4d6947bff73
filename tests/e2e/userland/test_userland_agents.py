"""Stock LIPs on the real kernel: speculative decoding, a ReAct agent, graph of thoughts, SWARM agents."""
import http.server
import importlib.util
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO

SPEC, REACT, GOT, SWARM = (REPO / "userland" / n for n in ("speculative.py", "react.py", "got.py", "swarm.py"))


def finished(kernel, args):
    """The kernel's own record of a finished LIP (its pred calls and tokens), by its args."""
    return [l for l in kernel.client().ps()["finished"] if l["args"] == list(args)][-1]


def run_ok(kernel, *args, **kw):
    r = kernel.run(*args, **kw)
    assert r.returncode == 0, r.stderr
    return r


# ---------------------------------------------------------------- speculative decoding
CODE = ('Write the same Python functions for mul and div:\n```python\n'
        'def add(a, b):\n    """Add a and b."""\n    return a + b\n\n'
        'def sub(a, b):\n    """Subtract b from a."""\n    return a - b\n```')


@pytest.mark.parametrize("prompt, n, repetitive", [(CODE, 48, True),
                                                   ("Write one sentence about the ocean.", 16, False)],
                         ids=["repetitive", "prose"])
def test_speculative_equals_greedy(kernel, prompt, n, repetitive):
    with ThreadPoolExecutor(2) as pool:                   # the two LIPs run side by side
        spec = pool.submit(run_ok, kernel, SPEC, prompt, "--max-tokens", str(n))
        plain = pool.submit(run_ok, kernel, REPO / "userland/generate.py", prompt, str(n))
        spec, plain = spec.result(), plain.result()
    text, stats_line = spec.stdout.rstrip("\n").rsplit("\n", 1)
    stats = json.loads(stats_line)
    # identical to plain greedy decoding (the top-2 logit gaps of these greedy paths are >= 0.05,
    # far above the float noise of batching or of verifying 8 tokens in one pass)
    assert text + "\n" == plain.stdout
    assert stats["tokens"] == len(stats["ids"]) <= n
    assert stats["pred_calls"] == finished(kernel, [prompt, "--max-tokens", str(n)])["preds"]
    if repetitive:
        assert stats["tokens"] >= 32 and stats["accepted"] > 0
        assert stats["pred_calls"] <= stats["tokens"] / 2, stats      # >= 2 tokens per pred call


# ---------------------------------------------------------------- ReAct agent
def test_react_tools_results_in_answers_one_kv(kernel, tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "todo.txt").write_text("Buy milk.\nCall the plumber.\n")
    (d / "zephyr.txt").write_text("Meeting notes.\nProject Zephyr's codename is BLUE-HERON-4417.\n")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"The launch window opens at 0900 UTC.")

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    cases = [("What is 37 * 91?", "calc", "3367"),
             ("What is the codename of project Zephyr?", "search", "BLUE-HERON-4417"),
             (f"What does the page http://127.0.0.1:{port}/motd say?", "http", "0900 UTC")]
    grants = ["--grant", f"read:{d}", "--grant", f"http:127.0.0.1:{port}"]
    try:
        with ThreadPoolExecutor(3) as pool:
            runs = list(pool.map(lambda c: run_ok(kernel, REACT, c[0], extra=grants), cases))
    finally:
        srv.shutdown()
    for (question, tool, result), r in zip(cases, runs):
        out = json.loads(r.stdout.splitlines()[-1])
        assert [a["tool"] for a in out["actions"]][:1] == [tool], out
        assert result in out["actions"][0]["observation"], out
        assert result in out["answer"], out                 # the tool's result reached the answer
        assert f"Observation: {out['actions'][0]['observation']}" in r.stdout
        # one KV file all along: it only grows, and every token was fed exactly once
        lengths = out["kv_lengths"]
        assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
        assert out["tokens_fed"] + out["reused"] == lengths[-1]
        assert out["tokens_fed"] == finished(kernel, [question])["tokens"]


def test_react_forks_its_few_shot_prompt_from_the_prefix_cache(kernel, smollm):
    """A run finds the few-shot prompt's blocks that an earlier run computed, forks them and
    computes only the rest; the answer is the one computed without the cache."""
    q = "What is 125 + 349?"
    first = json.loads(run_ok(kernel, REACT, q).stdout.splitlines()[-1])
    again = json.loads(run_ok(kernel, REACT, q).stdout.splitlines()[-1])
    alone = json.loads(run_ok(kernel, REACT, q, "--no-cache").stdout.splitlines()[-1])
    spec = importlib.util.spec_from_file_location("react_lip", REACT)
    react = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(react)
    few_shot = len(smollm.tokenizer.encode(react.FEW_SHOT))
    assert alone["reused"] == 0 and alone["tokens_fed"] == alone["kv_lengths"][-1]
    assert again["reused"] >= few_shot - 16 and again["reused"] % 16 == 0
    assert again["tokens_fed"] + again["reused"] == again["kv_lengths"][-1]
    assert again["tokens_fed"] == finished(kernel, [q])["tokens"]      # what the kernel counted
    assert again["answer"] == first["answer"] == alone["answer"] and "474" in alone["answer"]


def test_react_calculator_is_safe():
    spec = importlib.util.spec_from_file_location("react_lip", REACT)     # the LIP's own code, in-process
    react = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(react)
    assert react.calc("2 * (3 + 4) ** 2") == "98"
    assert react.calc("7 / 2") == "3.5" and react.calc("1,000 + 1 =") == "1001" and react.calc("-2^3") == "-8"
    for bad in ("__import__('os')", "open('x')", "2 ** 10 ** 10", "a + 1", "(1).real", "[1] * 9"):
        with pytest.raises((ValueError, SyntaxError)):
            react.calc(bad)


# ---------------------------------------------------------------- SWARM agents
def test_swarm_hands_off_and_computes_the_conversation_once(kernel):
    args = ["What is 37 * 91?", "And what is 12 * 12?", "--max-steps", "2"]
    r = run_ok(kernel, SWARM, *args)
    out = json.loads(r.stdout.splitlines()[-1])
    agents = [t["agent"] for t in out["turns"]]
    # each user message starts with Triage, which can only hand off; each ends with an answer
    assert len(out["answers"]) == 2 and agents.count("Triage") == 2 and agents[0] == "Triage"
    assert out["handoffs"] == [[a, b] for a, b, t in zip(agents, agents[1:], out["turns"])
                               if t["moves"][-1].startswith("transfer to ")]
    assert len(out["handoffs"]) >= 2
    for t in out["turns"]:
        assert t["moves"] and t["moves"][-1].startswith(("transfer to ", "answer: ")), t
        assert f"[{t['agent']}] " + "\n".join(t["moves"]) in r.stdout
    # the shared conversation: every token computed once (the preamble here or in the run that
    # made its cache file), and each turn forked it as it stood (a fork fed only the agent's
    # instructions and its own moves, never the conversation)
    assert out["conversation_fed"] + out["preamble_reused"] == out["conversation_tokens"]
    lengths = [t["conversation_len"] for t in out["turns"]]
    assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    assert all(t["fed"] < t["conversation_len"] for t in out["turns"]), out["turns"]
    assert out["conversation_recomputed_without_forks"] == sum(lengths) > out["conversation_tokens"]
    # the kernel's own count of this LIP's pred input agrees with the program's
    assert out["tokens_fed"] == out["conversation_fed"] + out["fork_fed"] == finished(kernel, args)["tokens"]


def swarm(kernel, *args):
    """One swarm.py run through the CLI: its closing JSON line, checked against the kernel's count."""
    args = [*args, "--max-steps", "1", "--max-tokens", "16"]
    out = json.loads(run_ok(kernel, SWARM, *args).stdout.splitlines()[-1])
    assert out["tokens_fed"] == out["conversation_fed"] + out["fork_fed"] == finished(kernel, args)["tokens"]
    assert out["preamble_reused"] + out["preamble_computed"] == out["preamble_tokens"] > 100
    assert out["conversation_fed"] + out["preamble_reused"] == out["conversation_tokens"]
    return out


def test_swarm_keeps_the_preamble_in_a_cache_file(kernel):
    c = kernel.client()
    q = "What is 37 * 91?"
    first = swarm(kernel, q)                                  # keeps the preamble (or found it kept)
    path = first["preamble_file"]
    assert path.startswith("/home/") and "/swarm/preamble-" in path
    assert first["preamble_cache"] in ("created", "hit")
    st = c.kv_stat(path)
    assert st["advice"] == "cache" and st["length"] == first["preamble_tokens"] and st["mode"] & 0o077 == 0

    second = swarm(kernel, q)                                 # feeds no preamble token
    assert second["preamble_cache"] == "hit" and second["preamble_computed"] == 0
    assert second["preamble_reused"] == second["preamble_tokens"]
    assert second["answers"] == first["answers"] and second["turns"] == first["turns"]
    assert second["tokens_fed"] == first["tokens_fed"] - first["preamble_computed"]

    plain = swarm(kernel, q, "--no-cache")                    # the old way: fed with the first message
    assert plain["preamble_cache"] == "off" and plain["preamble_file"] is None
    assert plain["preamble_computed"] == plain["preamble_tokens"] and plain["preamble_reused"] == 0
    assert plain["conversation_fed"] == plain["conversation_tokens"]
    assert c.kv_stat(path)["length"] == first["preamble_tokens"]      # left as it was

    c.kv_rm(path)                                             # dropped (as under memory pressure)
    again = swarm(kernel, q)                                  # a miss: computed and kept again
    assert again["preamble_cache"] == "created" and again["preamble_computed"] == again["preamble_tokens"]
    assert again["answers"] == first["answers"]
    assert c.kv_stat(path)["advice"] == "cache"

    c.kv_rm(path)                                             # two cold runs at once: one keeps it
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda m: swarm(kernel, m), ["What is 12 * 12?", "What is 125 + 349?"]))
    kinds = sorted(o["preamble_cache"] for o in both)
    assert kinds in (["created", "hit"], ["created", "raced"]), kinds
    assert c.kv_stat(path)["length"] == first["preamble_tokens"]
    c.close()


def test_swarm_refuses_bad_options(kernel):
    r = kernel.run(SWARM, "What is 2 + 2?", "--max-steps", "99")
    assert r.returncode != 0 and "--max-steps in [0, 8]" in r.stderr
    r = kernel.run(SWARM)
    assert r.returncode != 0 and "messages" in r.stderr


# ---------------------------------------------------------------- graph of thoughts
def test_got_scores_merges_and_concludes(kernel):
    problem = "A farmer has 3 fields with 12 cows in each field. How many cows does the farmer have?"
    r = run_ok(kernel, GOT, problem, "--thoughts", "3", "--keep", "2", "--max-tokens", "24")
    out = json.loads(r.stdout)
    assert [t["thought"] for t in out["thoughts"]] == [1, 2, 3]
    assert all(t["text"] and t["score"] <= 0 for t in out["thoughts"])          # log-probabilities
    assert len({t["text"] for t in out["thoughts"]}) > 1                         # different seeds
    best = sorted(out["thoughts"], key=lambda t: -t["score"])[:2]
    assert sorted(out["kept"]) == sorted(t["thought"] for t in best)
    assert len(out["merged_parts"]) == 3
    assert out["merged_length"] == sum(out["merged_parts"])
    assert out["answer"].strip() and not out["exact"]
    assert out["generated"] >= len(out["thoughts"]) + 1


def test_got_exact_feeds_the_kept_thoughts_as_text(kernel, smollm):
    """--exact: the conclusion is decoded after the kept thoughts written out in order on a fork of
    the problem (what a prompt listing them computes), not after their merged KV."""
    problem = "A box holds 6 eggs. How many boxes do 48 eggs fill?"
    out = json.loads(run_ok(kernel, GOT, problem, "--thoughts", "2", "--keep", "2", "--max-tokens", "16",
                            "--exact").stdout)
    assert out["exact"] and sorted(out["kept"]) == [1, 2]
    text = "".join(f"Thought {t['thought']}: {t['text']}\n" for t in out["thoughts"]) + "\nFinal answer:"
    P, rest = out["merged_parts"]
    assert rest == len(smollm.tokenizer.encode(text))       # the kept thoughts' tokens, fed after the problem
    assert out["merged_length"] == P + rest
    assert out["answer"].strip()
