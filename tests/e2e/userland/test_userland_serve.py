"""userland/serve.py, the program behind the HTTP gateway, end to end on the real
kernel and SmolLM2; its library pieces (symphony.lip.streaming, .tools,
.prefixcache) without a kernel."""
import json
import uuid
from collections import Counter

import jsonschema
import numpy as np
import pytest

from conftest import SMOLLM_ATOL, requires_root
from symphony.lip.helpers import StopChecker
from symphony.lip.prefixcache import PrefixCache
from symphony.lip.sampling import log_softmax
from symphony.lip.streaming import TextStream
from symphony.lip.tools import CallParser, call_text, render
from symphony.programs import resolve

SERVE = resolve("serve")
BLOCK = 16                                  # the prefix cache's block: the kernel's page size
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}}}
WEATHER = [{"name": "get_weather", "description": "Get the current weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"], "additionalProperties": False}},
           {"name": "get_time", "description": "Get the local time of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
# ~1,000 tokens of system prompt
SYSTEM = " ".join(f"Rule {i}: greet visitor number {i} politely and answer in one short sentence."
                  for i in range(55))


def serve(kernel, user=None, **req):
    """Run serve with one request; (exit status, its events, the kernel's record of the LIP)."""
    req.setdefault("temperature", 0)
    with kernel.client(user=user) as c:
        lip = c.spawn(SERVE.read_text(), [json.dumps(req)], filename="serve.py")
        evs = list(c.events(timeout=300))
        done = [p for p in c.ps()["finished"] if p["lip"] == lip]
    assert evs[-1]["event"] == "exit", evs[-3:]
    assert not [e for e in evs if e["event"] == "stderr"], evs
    return evs[-1]["status"], [e["data"] for e in evs if e["event"] == "out"], done[0]


def chat(q, system=None, **kw):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
    return dict(mode="chat", messages=msgs, **kw)


def texts(outs, i=0):
    return "".join(e["text"] for e in outs if e["event"] == "text" and e["index"] == i)


def calls(outs, i=0):
    """{call k: [name, arguments]} of choice i, from the tool_call events."""
    got = {}
    for e in outs:
        if e["event"] == "tool_call" and e["index"] == i:
            if "name" in e:
                assert e["id"].startswith("call_") and e["call"] not in got
                got[e["call"]] = [e["name"], ""]
            got[e["call"]][1] += e["arguments"]
    return got


def done(outs, i=0):
    return next(e for e in outs if e["event"] == "done" and e["index"] == i)


def well_formed(outs, n=1):
    """The contract's order: one prompt event first; each choice's done last of its events."""
    assert outs[0]["event"] == "prompt" and [e["event"] for e in outs].count("prompt") == 1
    for i in range(n):
        mine = [e for e in outs[1:] if e.get("index") == i]
        assert [e["event"] for e in mine].count("done") == 1 and mine[-1]["event"] == "done"
    assert all(e["event"] in ("text", "tool_call", "done") for e in outs[1:])


# ---------------------------------------------------------------- the library, no kernel
def test_text_stream_holds_back_stops_and_partial_characters(smollm):
    tok = smollm.tokenizer
    ids = tok.encode("Fish 🐟 swim. STOP here")
    for stops in (["STOP"], ["swim. ST"], ["zzz"]):
        ts, shown, recs = TextStream(tok, stops), [], []
        for t in ids:
            text, r = ts.push(t, t)
            assert "\ufffd" not in text
            shown.append(text)
            recs += r
            if ts.hit:
                break
        text, r = ts.finish()
        shown.append(text)
        recs += r
        whole = tok.decode(ids)
        want = whole[:whole.index(stops[0])] if stops[0] in whole else whole
        assert "".join(shown) == want
        assert recs == ids[:len(recs)]                                  # records in order, each once
        assert tok.decode(recs).startswith(want) and len(tok.decode(recs[:-1])) < len(want)
        if ts.hit:
            assert ts.rest.startswith(stops[0]) and ts.cut <= len(recs)
    sc = StopChecker(["ab", "abc"])
    assert sc.push("xabc") == ("x", True) and (sc.hit, sc.rest) == ("abc", "abc")      # the earliest, the longest there


def test_call_parser_and_rendering():
    text = call_text("get_weather", '{"city":"}\\n</tool_call>"}') + "\n" + call_text("get_time", "{}")
    for step in (1, 5, len(text)):
        p, evs = CallParser(), []
        for i in range(0, len(text), step):
            evs += p.feed(text[i:i + step])
        evs += p.finish()
        got = {}
        for e in evs:
            got.setdefault(e["call"], [e.get("name"), ""])[1] += e["arguments"]
        assert got == {0: ["get_weather", '{"city":"}\\n</tool_call>"}'], 1: ["get_time", "{}"]}
    p = CallParser()                                                      # cut short after the arguments
    assert [e["arguments"] for e in p.feed(call_text("f", "{}")[:-14]) + p.finish()] == ["{", "}"]
    msgs = render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "f", "arguments": "{}"}]},
                   {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}], WEATHER)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_time"' in msgs[0]["content"]
    assert msgs[2]["content"] == call_text("f", "{}")
    assert msgs[3]["content"] == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"


def test_prefix_cache_keys_name_whole_prefixes():
    pc = PrefixCache("/d", block=4, user="u")
    toks = [5, 6, 1, 7, 8, 9, 10, 2, 11, 12, 13, 14, 15]
    keys = pc.keys(toks, 3)
    assert len(keys) == 3 and all(len(k) == 16 for k in keys)
    assert pc.keys(toks[:8] + [0] * 4, 2) == keys[:2]                  # equal prefixes, equal keys
    assert pc.keys([0] + toks[1:], 3)[0] != keys[0]                    # a changed token changes its key
    other = pc.keys(toks[:4] + [0] + toks[5:], 3)                      # ... and every key after it
    assert other[0] == keys[0] and not set(other[1:]) & set(keys)
    assert PrefixCache("/d", block=4, user="u", salt=b"x").keys(toks, 1) != keys[:1]
    assert pc.keys(toks, 3) == keys                                     # the prompt's chain is reused


def test_chat_text_stop_and_n(kernel):
    q = "What is the capital of France?"
    with kernel.client() as c:                                            # what userland/chat.py answers
        c.send_input(c.spawn(resolve("chat").read_text(), [q, "--max-tokens", "24"], filename="chat.py"), None)
        want = "".join(e["data"] for e in c.events(timeout=120) if e["event"] == "out").rstrip("\n")
    status, outs, _ = serve(kernel, **chat(q, max_tokens=24))
    assert status == 0 and texts(outs) == want and "Paris" in want
    well_formed(outs)
    assert outs[0]["cached_tokens"] == 0 and done(outs)["finish_reason"] == "stop"

    stop = want[want.index("ance") - 2:want.index("Paris") + 2]          # spans several tokens
    status, outs, _ = serve(kernel, **chat(q, max_tokens=24, stop=["@@", stop]))
    assert status == 0 and texts(outs) == want[:want.index(stop)]
    assert done(outs)["finish_reason"] == "stop"

    status, outs, _ = serve(kernel, mode="text", prompt="The three primary colors are", max_tokens=8, echo=True)
    assert status == 0 and texts(outs).startswith("The three primary colors are")
    assert done(outs) == {"event": "done", "index": 0, "finish_reason": "length", "completion_tokens": 8}
    assert outs[0]["prompt_tokens"] == 5

    req = chat("Write one sentence about the sea.", max_tokens=12, temperature=1.0, top_p=0.95, seed=7, n=3)
    status, a, _ = serve(kernel, **req)
    status2, b, _ = serve(kernel, **req)
    assert status == status2 == 0
    well_formed(a, 3)
    samples = [texts(a, i) for i in range(3)]
    assert samples == [texts(b, i) for i in range(3)]                   # the seed reproduces every choice
    assert len(set(samples)) == 3 and all(samples)                      # seed + i: distinct samples


def test_logprobs_penalties_and_unicode(kernel, smollm):
    """Logprobs are the engine's log-softmax within 2 x SMOLLM_ATOL (a log-softmax moves by at
    most twice the largest logit error); entries' bytes make up the text exactly."""
    tok, prompt = smollm.tokenizer, "The three primary colors are"
    status, outs, _ = serve(kernel, mode="text", prompt=prompt, max_tokens=6, logprobs=True, top_logprobs=3)
    assert status == 0
    entries = [x for e in outs if e["event"] == "text" for x in e["logprobs"]]
    assert len(entries) == 6 and b"".join(bytes(x["bytes"]) for x in entries) == texts(outs).encode()
    seq = smollm.new_sequence()
    logits = smollm.pred(seq, tok.encode(prompt))
    for x in entries:
        ref = log_softmax(np.asarray(logits, dtype=np.float64))
        t = int(np.argmax(ref))
        assert bytes(x["bytes"]) == tok.decode([t]).encode()
        assert abs(x["logprob"] - ref[t]) <= 2 * SMOLLM_ATOL
        top = np.argsort(-ref)[:3]
        assert [y["logprob"] for y in x["top_logprobs"]] == sorted((y["logprob"] for y in x["top_logprobs"]),
                                                                  reverse=True)
        assert np.allclose([y["logprob"] for y in x["top_logprobs"]], ref[top], atol=2 * SMOLLM_ATOL)
        logits = smollm.pred(seq, [t])
    smollm.release(seq)

    # penalties choose in the LIP, deterministically, and repeat less
    rep = dict(mode="text", prompt="one one one one one one", max_tokens=10)
    plain, pen = serve(kernel, **rep)[1], serve(kernel, **rep, presence_penalty=2.0, frequency_penalty=2.0)[1]
    most = lambda outs: max(Counter(e["text"] for e in outs if e["event"] == "text").values())   # ~ per token
    assert most(plain) > most(pen) and texts(plain) != texts(pen)
    assert texts(pen) == texts(serve(kernel, **rep, presence_penalty=2.0, frequency_penalty=2.0)[1])

    # 4-byte characters split across tokens: no event carries half of one
    status, outs, _ = serve(kernel, **chat("Reply with three emoji that describe happiness.", max_tokens=12,
                                           logprobs=True))
    text = texts(outs)
    assert status == 0 and any(ord(ch) > 0xFFFF for ch in text) and "\ufffd" not in text
    for e in outs:
        if e["event"] == "text":
            assert "\ufffd" not in e["text"]
            assert b"".join(bytes(x["bytes"]) for x in e["logprobs"]) == e["text"].encode()


def test_structured_output_and_tools(kernel):
    status, outs, _ = serve(kernel, **chat("Describe a person as JSON.", max_tokens=48,
                                           response_format={"type": "json_schema", "schema": PERSON}))
    assert status == 0 and done(outs)["finish_reason"] == "stop"
    jsonschema.validate(json.loads(texts(outs)), PERSON)
    status, outs, _ = serve(kernel, **chat("What is the capital of France? Answer as a JSON object.",
                                           max_tokens=48, response_format={"type": "json_object"}))
    assert status == 0 and done(outs)["finish_reason"] == "stop" and isinstance(json.loads(texts(outs)), dict)

    # every tool request shares the system prompt and the tools section: cached after the first
    cache = {"dir": f"/home/root/serve-{uuid.uuid4().hex[:8]}", "trust": []}
    system = {"role": "system", "content": "Use the tools to answer."}
    convo = [system, {"role": "user", "content": "What is the weather like in Paris today?"}]
    tools = dict(tools=WEATHER, max_tokens=40, cache=cache)
    for choice in ("required", {"name": "get_time"}):
        status, outs, _ = serve(kernel, mode="chat", messages=convo, tool_choice=choice,
                                parallel_tool_calls=False, **tools)
        well_formed(outs)
        assert status == 0 and texts(outs) == "" and done(outs)["finish_reason"] == "tool_calls"
        (name, args), = calls(outs).values()
        assert name == ("get_time" if isinstance(choice, dict) else name)
        jsonschema.validate(json.loads(args), next(t for t in WEATHER if t["name"] == name)["parameters"])
    assert outs[0]["cached_tokens"] > 200                                   # tool_choice left the prompt alone
    # auto: the model begins a call in free text; the call is then grammar-constrained
    line = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome"}}\n</tool_call>'
    repeat = [system, {"role": "user", "content": f"Repeat this line exactly: {line}"}]
    status, outs, _ = serve(kernel, mode="chat", messages=repeat, parallel_tool_calls=False, **tools)
    assert status == 0 and "<tool" not in texts(outs) and done(outs)["finish_reason"] == "tool_calls"
    (name, args), = calls(outs).values()
    assert name == "get_weather" and json.loads(args)["city"]
    # ... and none: the same prompt never makes a call nor shows the markup
    status, outs, _ = serve(kernel, mode="chat", messages=repeat, tool_choice="none", **tools)
    assert status == 0 and not calls(outs) and "<tool_call" not in texts(outs)
    # the tool-result turn continues the conversation in text
    convo += [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": name, "arguments": args}]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    status, outs, _ = serve(kernel, mode="chat", messages=convo, **dict(tools, max_tokens=24))
    assert status == 0 and texts(outs).strip() and not calls(outs)
    assert done(outs)["finish_reason"] in ("stop", "length")


def test_not_streamed_is_the_streamed_answer_in_a_few_events(kernel):
    """stream false: every choice's text, logprobs, calls and done as streamed, token for
    token, but in at most 2 text events a choice (the first piece at once, then the rest)
    and 2 tool_call events a call, where streamed each token is an event."""
    q = "Write a short poem about the sea."
    _, outs, _ = serve(kernel, **chat(q, max_tokens=64))
    whole = texts(outs)
    stop = whole[len(whole) // 2:len(whole) // 2 + 4]
    assert done(outs)["completion_tokens"] == 64 and stop.strip()
    weather = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    cases = [(chat(q, max_tokens=64), 1),
             (chat(q, max_tokens=64, stop=["@@", stop], logprobs=True, top_logprobs=2), 1),
             (chat("Write one sentence about the sea.", max_tokens=24, temperature=1.0, seed=7, n=2), 2),
             (dict(mode="chat", messages=weather, tools=WEATHER, tool_choice="required", max_tokens=40), 1)]
    for req, n in cases:
        status, streamed, _ = serve(kernel, **req)
        status2, merged, _ = serve(kernel, **req, stream=False)
        assert status == status2 == 0
        well_formed(merged, n)
        for i in range(n):
            assert texts(merged, i) == texts(streamed, i) and calls(merged, i) == calls(streamed, i)
            assert done(merged, i) == done(streamed, i)
            lps = [[(x["token"], round(x["logprob"], 5)) for e in o if e["event"] == "text" and e["index"] == i
                    for x in e.get("logprobs", [])] for o in (streamed, merged)]
            assert lps[0] == lps[1]
            count = lambda o, kind: sum(e["event"] == kind and e["index"] == i for e in o)   # noqa: E731
            assert count(merged, "text") <= 2 and count(merged, "tool_call") <= 2 * len(calls(merged, i))
            assert count(streamed, "text") + count(streamed, "tool_call") >= 5
    assert texts(streamed) == "" and calls(merged)                        # the last case: a call, no text
    status, merged, _ = serve(kernel, **cases[1][0], stream=False)
    assert texts(merged) == whole[:whole.index(stop)] and done(merged)["finish_reason"] == "stop"


def test_bad_requests_are_error_events(kernel):
    bad = [({"mode": "text", "prompt": "x " * 9000, "max_tokens": 5}, "context_length_exceeded", "prompt"),
           ({"mode": "text", "prompt": "hi", "max_tokens": 8192}, "context_length_exceeded", "prompt"),
           (chat("hi", response_format={"type": "json_schema", "schema": {"type": "strin"}}), "invalid_schema",
            "response_format"),
           (chat("hi", tools=[{"name": "f", "parameters": {"properties": {"a": {"type": 3}}}}], tool_choice="required"),
            "invalid_schema", "tools[0].parameters"),
           ({"mode": "text", "prompt": "hi", "echo": True, "logprobs": True}, "invalid_request", "echo"),
           ({"mode": "text", "prompt": "hi", "temperature": 2.5}, "invalid_request", "temperature"),
           ({"mode": "text", "prompt": "hi", "max_token": 5}, "invalid_request", "max_token"),
           ({"mode": "text", "prompt": [1, 2, 10 ** 6]}, "invalid_request", "prompt"),
           ({"mode": "text", "prompt": ""}, "invalid_request", "prompt"),
           (chat("hi", tool_choice={"name": "nope"}, tools=WEATHER), "invalid_request", "tool_choice"),
           (chat("hi", cache={"dir": "/home/x/.cache"}), "invalid_request", "cache.dir"),
           ({"mode": "poem"}, "invalid_request", "mode")]
    for req, code, param in bad:
        status, outs, _ = serve(kernel, **req)
        assert status == 2 and len(outs) == 1, (req, outs)
        assert outs[0]["event"] == "error" and outs[0]["status"] == 400, outs
        assert (outs[0]["code"], outs[0]["param"]) == (code, param), outs
    assert "Invalid type" in serve(kernel, **bad[2][0])[1][0]["message"]      # llguidance's own message
    with kernel.client() as c:                                               # not JSON, or two arguments
        for args in (["{nope"], ["{}", "{}"]):
            c.spawn(SERVE.read_text(), args, filename="serve.py")
            evs = list(c.events(timeout=60))
            assert evs[-1]["status"] == 2 and [e["data"]["event"] for e in evs if e["event"] == "out"] == ["error"]


def test_prefix_cache_reuses_system_prompt_and_conversation(kernel, smollm):
    cache = {"dir": f"/home/root/serve-{uuid.uuid4().hex[:8]}", "trust": []}
    stats = lambda: kernel.client().stats()["forward_passes"]
    tok = smollm.tokenizer

    status, a, lip_a = serve(kernel, **chat("What is 2+2?", SYSTEM, max_tokens=8, cache=cache))  # cold
    L = a[0]["prompt_tokens"]
    assert status == 0 and 900 < L < 1200 and a[0]["cached_tokens"] == 0 and lip_a["tokens"] >= L
    passes = stats()
    status, b, lip_b = serve(kernel, **chat("Name a colour.", SYSTEM, max_tokens=8, cache=cache))
    passes = stats() - passes
    L, M = b[0]["prompt_tokens"], b[0]["cached_tokens"]
    pa = tok.encode_chat(render(chat("What is 2+2?", SYSTEM)["messages"]))
    pb = tok.encode_chat(render(chat("Name a colour.", SYSTEM)["messages"]))
    common = next(i for i, (x, y) in enumerate(zip(pa, pb)) if x != y)
    assert status == 0 and M == common // BLOCK * BLOCK                   # every full block they share
    assert lip_b["tokens"] == L - M + done(b)["completion_tokens"] - 1     # the kernel computed only the rest
    assert passes <= done(b)["completion_tokens"] + 1                     # one prefill pass, then decode steps
    status, b_plain, lip_plain = serve(kernel, **chat("Name a colour.", SYSTEM, max_tokens=8))
    assert texts(b_plain) == texts(b) and b_plain[0]["cached_tokens"] == 0 and lip_plain["tokens"] > L

    # the next turn: the previous prompt + answer + a new message costs only the new turn
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": texts(b)}, {"role": "user", "content": "And another one?"}]
    status, c, lip_c = serve(kernel, mode="chat", messages=msgs, max_tokens=8, cache=cache)
    L2, M2 = c[0]["prompt_tokens"], c[0]["cached_tokens"]
    fed_b = L + done(b)["completion_tokens"] - 1                           # b's file: prompt + answer, last unfed
    assert status == 0 and M2 % BLOCK == 0 and L // BLOCK * BLOCK <= M2 <= fed_b // BLOCK * BLOCK
    assert lip_c["tokens"] == L2 - M2 + done(c)["completion_tokens"] - 1
    files = kernel.client().kv_ls(cache["dir"])
    # one file per distinct prompt: b's is pruned when c's, which holds all its blocks, is done
    lengths = [len(pa) + done(a)["completion_tokens"] - 1, L2 + done(c)["completion_tokens"] - 1]
    if M2 < fed_b // BLOCK * BLOCK:                                        # the answer re-tokenized otherwise
        lengths.append(fed_b)
    assert all(f["owner"] == "root" and f["mode"] == 0o600 for f in files)
    assert sorted(f["length"] for f in files) == sorted(lengths)


@requires_root
def test_prefix_cache_ignores_untrusted_files(kernel, smollm):
    """Mallory plants a chain file of other tokens under the keys of Alice's prompt in a shared
    cache directory: Alice's request does not fork it (unless she trusts Mallory)."""
    d = f"/shared/serve-{uuid.uuid4().hex[:8]}"
    req = chat("Name a fruit.", "You are a helpful assistant. " * 12, max_tokens=8)
    tok = smollm.tokenizer
    prompt = tok.encode_chat(render(req["messages"]))
    n = (len(prompt) - 1) // BLOCK
    keys = PrefixCache(d, block=BLOCK, user="alice").keys(prompt, n)
    plant = ("from symphony.lip import kv, pred\n"
             "def main(path, n, keys):\n"
             "    kv.mkdir(path.rsplit('/', 1)[0], mode=0o755)\n"
             "    with kv.create(path, mode=0o644) as f:\n"
             "        pred(f, [42] * int(n), output='argmax')\n"
             "        f.publish(bytes.fromhex(keys), 16)\n")
    with kernel.client(user="mallory") as c:
        c.spawn(plant, [f"{d}/planted", str(n * BLOCK), b"".join(keys).hex()])
        assert list(c.events(timeout=60))[-1]["status"] == 0
    status, plain, _ = serve(kernel, user="alice", **req)
    status2, cached, _ = serve(kernel, user="alice", **req, cache={"dir": d, "trust": []})
    assert status == status2 == 0 and cached[0]["cached_tokens"] == 0 and texts(cached) == texts(plain)
    status, poisoned, _ = serve(kernel, user="alice", **req, cache={"dir": d, "trust": ["mallory"]})
    assert status == 0 and poisoned[0]["cached_tokens"] == n * BLOCK      # trusted: used as it is


@requires_root
def test_a_users_private_prompts_stay_private(kernel, smollm):
    """Alice's private cache: Bob's requests naming her directory get no cache (and no error),
    and its names say nothing of her prompts; a shared directory is used across users only
    for files of users one trusts."""
    mine = f"/home/alice/serve-{uuid.uuid4().hex[:8]}"
    req = chat("Where is my parcel 4711?", "You are the support desk. " * 12, max_tokens=4)
    status, a, _ = serve(kernel, user="alice", **req, cache={"dir": mine, "trust": []})
    status2, a2, _ = serve(kernel, user="alice", **req, cache={"dir": mine, "trust": []})
    assert status == status2 == 0 and a2[0]["cached_tokens"] >= BLOCK
    status, b, _ = serve(kernel, user="bob", **req, cache={"dir": mine, "trust": ["alice"]})
    assert status == 0 and b[0]["cached_tokens"] == 0
    with kernel.client(user="bob") as c:
        with pytest.raises(Exception, match="may not list"):
            c.kv_ls(mine)
    prompt = smollm.tokenizer.encode_chat(render(req["messages"]))
    keys = PrefixCache(mine, block=BLOCK, user="alice").keys(prompt, len(prompt) // BLOCK)
    names = {f["name"] for f in kernel.client(user="alice").kv_ls(mine)}
    assert names and not names & {k.hex()[:16] for k in keys} and all(len(x) == 16 for x in names)
    shared = f"/shared/serve-{uuid.uuid4().hex[:8]}"
    status, a, _ = serve(kernel, user="alice", **req, cache={"dir": shared, "trust": ["bob"]})
    files = kernel.client().kv_ls(shared)
    assert status == 0 and files and all(f["mode"] == 0o644 for f in files)   # shared: readable by all
    status, b, _ = serve(kernel, user="bob", **req, cache={"dir": shared, "trust": []})
    status2, b2, _ = serve(kernel, user="carol", **req, cache={"dir": shared, "trust": ["alice"]})
    assert status == status2 == 0 and b[0]["cached_tokens"] == 0 and b2[0]["cached_tokens"] >= BLOCK
