"""The gateway with its real serving program (userland/serve.py) on the embedded SmolLM2.

One kernel with --http for the module; clients are the `openai` package and raw httpx.
What the answers must be: sensible greedy text, the same streamed or not and alone or among
100 concurrent streams; JSON that validates; tool calls whose arguments validate, then the
tool-result turn; logprobs; n; stop strings never leaking; unicode never split; context
overflow and bad schemas as 400s; a repeated 1,000-token system prompt and a response chain
computing only their new tokens (the kernel's own counters say so); the README's curl examples.
And the front door's newer parts on the model: logit_bias forcing and banning tokens (bad
biases 400), choices, regexes and grammars (vLLM's names), required tool calls that end as
tool_calls with one id each, the WebSocket mode's store:false chain reusing its KV, a
compaction seeding a new chain, and Anthropic's Messages API with the `anthropic` client.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time

import httpx
import jsonschema
import openai
import pytest

from conftest import REPO, KernelProc
from .test_gateway import free_port, wait_for_gateway

SYSTEM = ("You are a helpful assistant for a public library. " +
          " ".join(f"Rule {i}: be polite, be brief, and recommend a book about topic number {i} when asked."
                   for i in range(1, 46)))


@pytest.fixture(scope="module")
def gm(tmp_path_factory):
    from symphony.gateway.keys import add_key
    d = tmp_path_factory.mktemp("gateway-model")
    keys = d / "keys.json"
    key, _ = add_key(str(keys), "tests", "alice", rpm=100000, max_concurrent=200)
    port = free_port()
    k = KernelProc(d, "--http", f"127.0.0.1:{port}", "--keys", str(keys), "--kv-memory-mb", "256")
    wait_for_gateway(k)
    k.url, k.key = f"http://127.0.0.1:{port}", key
    k.model = httpx.get(k.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
    yield k
    k.stop()


def oai(gm):
    import openai
    return openai.OpenAI(base_url=gm.url + "/v1", api_key=gm.key, max_retries=0, timeout=300)


def computed(gm) -> int:
    """Tokens the kernel has fed to the model so far (all LIPs)."""
    return gm.client().stats()["tokens_computed"]


def ask(q):
    return [{"role": "user", "content": q}]


def test_chat_greedy_streamed_equals_plain_and_is_sensible(gm):
    c = oai(gm)
    r = c.chat.completions.create(model=gm.model, messages=ask("What is the capital of France?"), temperature=0,
                                  max_tokens=32)
    text = r.choices[0].message.content
    assert "Paris" in text and r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length")
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=gm.model, messages=ask("What is the capital of France?"), temperature=0, max_tokens=32, stream=True)
        if ch.choices]
    assert "".join(parts) == text
    # completions and responses on the same model
    t = c.completions.create(model=gm.model, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert "Paris" in t.choices[0].text
    resp = c.responses.create(model=gm.model, input="What is the capital of France?", temperature=0,
                              max_output_tokens=32)
    assert resp.status in ("completed", "incomplete") and "Paris" in resp.output_text


def test_min_p_one_samples_the_greedy_answer_and_out_of_range_is_400(gm):
    """min_p 1 keeps only each step's most likely token: at any temperature and seed, the greedy text."""
    c = oai(gm)
    q = ask("Name three colours.")
    greedy = c.chat.completions.create(model=gm.model, messages=q, temperature=0, max_tokens=16)
    for seed in (1, 2):
        r = c.chat.completions.create(model=gm.model, messages=q, temperature=1.5, seed=seed, max_tokens=16,
                                      extra_body={"min_p": 1.0})
        assert r.choices[0].message.content == greedy.choices[0].message.content
    for bad in (1.5, -0.1, "x"):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=gm.model, messages=q, max_tokens=4, extra_body={"min_p": bad})
        assert "min_p" in str(e.value)


def test_stop_strings_never_leak_and_unicode_is_whole(gm):
    c = oai(gm)
    base = c.chat.completions.create(model=gm.model, messages=ask("Count from 1 to 10, separated by commas."),
                                     temperature=0, max_tokens=40).choices[0].message.content
    assert "5" in base
    stop = base[base.index("5") - 1:base.index("5") + 2]      # a stop string around "5", likely split by tokens
    r = c.chat.completions.create(model=gm.model, messages=ask("Count from 1 to 10, separated by commas."),
                                  temperature=0, max_tokens=40, stop=[stop])
    assert r.choices[0].message.content == base[:base.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=gm.model, messages=ask("Count from 1 to 10, separated by commas."), temperature=0, max_tokens=40,
        stop=[stop], stream=True) if ch.choices]
    assert "".join(chunks) == r.choices[0].message.content and not any(stop in "".join(chunks[:i + 1])
                                                                       for i in range(len(chunks)))
    prompt = "Write the Japanese word for cat, then a cat emoji."
    u = c.chat.completions.create(model=gm.model, messages=ask(prompt), temperature=0, max_tokens=24, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in u if ch.choices]
    assert not any("\ufffd" in p for p in pieces)               # no half a character in any chunk
    assert "".join(pieces) == c.chat.completions.create(model=gm.model, messages=ask(prompt), temperature=0,
                                                        max_tokens=24).choices[0].message.content


def test_json_schema_tools_and_the_tool_result_turn(gm):
    c = oai(gm)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = c.chat.completions.create(model=gm.model, messages=ask("Describe a person called Ada, aged 36."),
                                  temperature=0, max_tokens=64,
                                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    j = c.chat.completions.create(model=gm.model, messages=ask("Reply with a JSON object with the keys name and "
                                                                "age of a cat."), temperature=0, max_tokens=100,
                                  response_format={"type": "json_object"})
    assert j.choices[0].finish_reason == "stop" and isinstance(json.loads(j.choices[0].message.content), dict)
    params = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                "parameters": params}}]
    q = ask("What's the weather like in Paris?")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model=gm.model, messages=q, tools=tools, tool_choice=choice, temperature=0,
                                      max_tokens=64)
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), params)
    turn = q + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}]
    r = c.chat.completions.create(model=gm.model, messages=turn, tools=tools, temperature=0, max_tokens=40)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    bad = httpx.post(gm.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {gm.key}"}, json={
        "model": gm.model, "messages": q, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}})
    assert bad.status_code in (400, 422) and bad.json()["error"]["message"]


def test_logprobs_n_and_seeds(gm):
    c = oai(gm)
    r = c.chat.completions.create(model=gm.model, messages=ask("Say hello."), temperature=0, max_tokens=8,
                                  logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) >= 1 and "".join(e.token for e in lp) == r.choices[0].message.content
    for e in lp:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and e.logprob <= 0
        assert abs(e.logprob - tops[0]) < 1e-4                  # greedy: the chosen token is the top one
    kw = dict(model=gm.model, messages=ask("Name an animal."), temperature=0.9, max_tokens=8, n=3, seed=7)
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    ta = [x.message.content for x in a.choices]
    assert ta == [x.message.content for x in b.choices] and len(ta) == 3 and len(set(ta)) > 1


def test_errors_from_the_program(gm):
    h = {"Authorization": f"Bearer {gm.key}"}
    long = httpx.post(gm.url + "/v1/chat/completions", headers=h, json={
        "model": gm.model, "messages": ask("word " * 9000)})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    s = httpx.post(gm.url + "/v1/chat/completions", headers=h, json={
        "model": gm.model, "messages": ask("word " * 9000), "stream": True})
    assert s.status_code == 400 and s.json()["error"]["code"] == "context_length_exceeded"


def test_a_repeated_system_prompt_and_a_response_chain_compute_only_new_tokens(gm):
    c = oai(gm)
    msgs = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]  # noqa: E731
    first = c.chat.completions.create(model=gm.model, messages=msgs("Recommend a book."), temperature=0,
                                      max_tokens=8)
    assert first.usage.prompt_tokens > 1000
    before = computed(gm)
    second = c.chat.completions.create(model=gm.model, messages=msgs("What time do you open?"), temperature=0,
                                       max_tokens=8)
    fed = computed(gm) - before
    new = second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 1000
    assert new <= 40 and fed <= new + second.usage.completion_tokens + 1
    r1 = c.responses.create(model=gm.model, instructions=SYSTEM, input="Recommend a book.", temperature=0,
                            max_output_tokens=8)
    before = computed(gm)
    r2 = c.responses.create(model=gm.model, instructions=SYSTEM, input="And another one?", temperature=0,
                            max_output_tokens=8, previous_response_id=r1.id)
    fed = computed(gm) - before
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens // 16 * 16    # its full blocks
    assert fed <= (r2.usage.input_tokens - r2.usage.input_tokens_details.cached_tokens) + r2.usage.output_tokens + 1


def test_100_concurrent_streams_each_get_what_they_get_alone(gm):
    """100 streams at once (20 of each question) get the greedy text each gets alone.  Alone,
    the kernel computes a short prompt with the 15-bit kernels; in a batch of 32 rows or more it
    takes the dense float32 GEMM, which rounds differently (~1e-3 of the logits), so an answer
    with a near-tie between its two best tokens could flip: the questions are ones whose answers
    have none (checked here, from the answer's own logprobs)."""
    questions = ["What is 2+2?", "What is the capital of Italy?", "What is the capital of France?",
                 "Name a fruit.", "What colour is the sky?"]
    c = oai(gm)
    alone = {}
    for q in questions:
        r = c.chat.completions.create(model=gm.model, messages=ask(q), temperature=0, max_tokens=8, logprobs=True,
                                      top_logprobs=2)
        alone[q] = r.choices[0].message.content
        margins = [e.top_logprobs[0].logprob - e.top_logprobs[1].logprob for e in r.choices[0].logprobs.content]
        assert min(margins) > 0.02, (q, margins)

    async def run():
        limits = httpx.Limits(max_connections=120)
        async with httpx.AsyncClient(timeout=600, limits=limits, headers={"Authorization": f"Bearer {gm.key}"}) as h:
            async def one(i):
                q = questions[i % len(questions)]
                text = []
                async with h.stream("POST", gm.url + "/v1/chat/completions", json={
                        "model": gm.model, "messages": ask(q), "temperature": 0, "max_tokens": 8,
                        "stream": True}) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])
                            text += [x["delta"].get("content") or "" for x in d["choices"]]
                return q, "".join(text)
            return await asyncio.gather(*(one(i) for i in range(100)))
    t0 = time.time()
    got = asyncio.run(run())
    assert all(text == alone[q] for q, text in got), [(q, t, alone[q]) for q, t in got if t != alone[q]][:3]
    assert time.time() - t0 < 240


def test_readme_curl_examples_run(gm):
    """Every curl line of the README's "Serving over HTTP" examples, as written, against this gateway."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Serving over HTTP", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    cmds = [b for b in blocks if "curl" in b][0]
    joined = cmds.replace("\\\n", " ")
    env = dict(os.environ, URL=gm.url, KEY=gm.key)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip().startswith("curl")]
    assert len(lines) >= 6 and gm.model == "SmolLM2-135M-Instruct.Q4_1"      # the name the README uses
    for line in lines:
        out = subprocess.run(["bash", "-c", line], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip(), (line, out.stderr)
        assert '"error":{' not in out.stdout.replace(" ", ""), (line, out.stdout[:500])


# ---------------------------------------------------------------- the front door: every API on the real model
TOKEN_LIP = '''from symphony.lip import send, tokenize, tokenizer
def main(*words):
    tok = tokenizer()
    send({w: [tokenize(w)[0], tok.decode([tokenize(w)[0]])] for w in words})
'''


def first_tokens(gm, tmp_path, *words) -> dict:
    """{word: [its first token id, that token's text]}, from the model's own tokenizer (a LIP)."""
    p = tmp_path / "tok.py"
    p.write_text(TOKEN_LIP)
    r = gm.run(p, *words)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_logit_bias_forces_and_bans_tokens_and_bad_biases_are_400(gm, tmp_path):
    c = oai(gm)
    ids = first_tokens(gm, tmp_path, " Paris", " London")
    paris, london = ids[" Paris"], ids[" London"]
    plain = c.completions.create(model=gm.model, prompt="The capital of France is", max_tokens=1, temperature=0)
    assert plain.choices[0].text == paris[1]
    forced = c.completions.create(model=gm.model, prompt="The capital of France is", max_tokens=1, temperature=0,
                                  logit_bias={str(london[0]): 100})
    assert forced.choices[0].text == london[1]
    banned = c.completions.create(model=gm.model, prompt="The capital of France is", max_tokens=1, temperature=0.7,
                                  seed=1, logit_bias={str(paris[0]): -100})
    assert banned.choices[0].text != paris[1]
    chat = c.chat.completions.create(model=gm.model, messages=ask("What is the capital of France?"), temperature=0,
                                     max_tokens=12, logit_bias={str(paris[0]): -100})
    assert "Paris" not in chat.choices[0].message.content
    for bias in ({"49152": 1}, {str(paris[0]): 100.5}, {str(paris[0]): -101}, {"-3": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=gm.model, messages=ask("Hi"), max_tokens=2, logit_bias=bias)
        assert (e.value.body.get("param") or "").startswith("logit_bias"), e.value.body


def test_structured_choices_regexes_and_grammars(gm):
    c = oai(gm)
    q = ask("Is the sky blue? Answer yes or no.")
    for extra, ok in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                      ({"structured_outputs": {"choice": ["blue sky", "green sky"]}}, lambda t: t in ("blue sky",
                                                                                                     "green sky")),
                      ({"guided_regex": r"(yes|no), [a-z]+"}, lambda t: re.fullmatch(r"(yes|no), [a-z]+", t)),
                      ({"structured_outputs": {"grammar": 'start: ("yes" | "no") "!"'}}, lambda t: t in ("yes!",
                                                                                                          "no!"))]:
        r = c.chat.completions.create(model=gm.model, messages=q, temperature=0, max_tokens=16, extra_body=extra)
        assert ok(r.choices[0].message.content) and r.choices[0].finish_reason == "stop", (extra, r.choices[0])
    t = c.completions.create(model=gm.model, prompt="My phone number is", max_tokens=20, temperature=0,
                             extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", t.choices[0].text)
    bad = httpx.post(gm.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {gm.key}"}, json={
        "model": gm.model, "messages": q, "guided_regex": "(unclosed"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_schema"


def test_required_tool_calls_end_as_tool_calls_with_one_id_each(gm):
    c = oai(gm)
    params = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                                "parameters": params}}]
    q = ask("What's the weather like in Paris and in Rome?")
    r = c.chat.completions.create(model=gm.model, messages=q, tools=tools, tool_choice="required", temperature=0,
                                  max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    seen = [(x.function.name, x.function.arguments) for x in calls]
    assert len(set(seen)) == len(seen) and len({x.id for x in calls}) == len(calls)     # no call twice
    for x in calls:
        jsonschema.validate(json.loads(x.function.arguments), dict(params, additionalProperties=False))
    ids, args, finish = {}, {}, None
    for ch in c.chat.completions.create(model=gm.model, messages=q, tools=tools, tool_choice="required",
                                        temperature=0, max_tokens=200, stream=True):
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if d.id is not None:
                assert d.index not in ids, "a call's id comes once, with its first delta"
                ids[d.index] = d.id
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        finish = (ch.choices[0].finish_reason if ch.choices else None) or finish
    assert finish == "tool_calls" and sorted(ids) == list(range(len(calls)))
    assert [args[i] for i in range(len(calls))] == [x.function.arguments for x in calls]
    resp = c.responses.create(model=gm.model, input="What's the weather like in Paris?", tool_choice="required",
                              tools=[{"type": "function", "name": "get_weather", "parameters": params}],
                              temperature=0, max_output_tokens=100, stream=True)
    items = {}
    for ev in resp:
        if ev.type in ("response.output_item.added", "response.output_item.done") and ev.item.type == "function_call":
            items.setdefault(ev.output_index, set()).add((ev.item.id, ev.item.call_id))
        if ev.type == "response.completed":
            final = ev.response
    assert items and all(len(v) == 1 for v in items.values())                           # one id from start to end
    assert {(o.id, o.call_id) for o in final.output if o.type == "function_call"} == set.union(*items.values())


def test_websocket_mode_and_compaction_on_the_model(gm):
    c = oai(gm)
    with c.responses.connect() as conn:
        conn.response.create(model=gm.model, input="Remember the code word: cobalt. Reply with OK.", store=False,
                             temperature=0, max_output_tokens=16)
        first = next(ev for ev in conn if ev.type in ("response.completed", "response.incomplete", "error"))
        assert first.type != "error"
        conn.response.create(model=gm.model, input="What is the code word?", store=False, temperature=0,
                             max_output_tokens=16, previous_response_id=first.response.id)
        second = next(ev for ev in conn if ev.type in ("response.completed", "response.incomplete", "error"))
    assert second.type != "error" and second.response.output_text
    usage = second.response.usage
    assert usage.input_tokens_details.cached_tokens >= first.response.usage.input_tokens   # the chain's KV reused
    comp = c.with_options(timeout=900).responses.compact(model=gm.model, input=[
        {"role": "user", "content": "Remember the compaction code word: slate."},
        {"role": "assistant", "content": "OK."}])
    assert comp.object == "response.compaction" and comp.output[-1].type == "compaction"
    assert comp.usage.output_tokens > 0
    window = [o.model_dump(exclude_none=True) for o in comp.output]
    with c.responses.connect() as conn:
        conn.response.create(model=gm.model, store=False, temperature=0, max_output_tokens=16,
                             input=window + [{"type": "message", "role": "user", "content": "Continue."}])
        last = next(ev for ev in conn if ev.type in ("response.completed", "response.incomplete", "error"))
    assert last.type != "error" and last.response.output_text


def test_the_messages_api_on_the_model(gm):
    import anthropic
    c = anthropic.Anthropic(base_url=gm.url, api_key=gm.key, max_retries=0, timeout=300)
    greedy = {"temperature": 0}
    r = c.messages.create(model=gm.model, max_tokens=24, system="You answer in one sentence.",
                          messages=ask("What is the capital of France?"), extra_body=greedy)
    assert "Paris" in r.content[0].text and r.stop_reason in ("end_turn", "max_tokens")
    with c.messages.stream(model=gm.model, max_tokens=24, system="You answer in one sentence.",
                           messages=ask("What is the capital of France?"), extra_body=greedy) as s:
        text = "".join(s.text_stream)
    assert text == r.content[0].text
    stop = r.content[0].text.split()[2]
    cut = c.messages.create(model=gm.model, max_tokens=24, system="You answer in one sentence.",
                            messages=ask("What is the capital of France?"), stop_sequences=[stop], extra_body=greedy)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == r.content[0].text[:r.content[0].text.index(stop)]
    tools = [{"name": "get_weather", "description": "Current weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    t = c.messages.create(model=gm.model, max_tokens=60, tools=tools, tool_choice={"type": "any"},
                          messages=ask("What's the weather in Paris?"), extra_body=greedy)
    uses = [b for b in t.content if b.type == "tool_use"]
    assert t.stop_reason == "tool_use" and uses and all(isinstance(u.input.get("city"), str) for u in uses)
    n = c.messages.count_tokens(model=gm.model, messages=ask("What's the weather in Paris?"), tools=tools)
    assert n.input_tokens == t.usage.input_tokens + t.usage.cache_read_input_tokens
