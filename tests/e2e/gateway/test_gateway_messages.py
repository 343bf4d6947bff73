"""Anthropic's Messages API, OpenAI's extra parameters and the serving contract's boundary,
against a real kernel with the serving program whose answers are known (fake_serve.py).

The client is the real `anthropic` package (and raw HTTP for what it would not send): the
message object and the stream's events as it parses them, streamed == not streamed, system
prompts, multi-turn, tool_use / tool_result round trips, stop sequences, token counting, both
ways of giving a key, and Anthropic's error shape for bad blocks, bad fields and bad keys.
The serving program is shown exactly what the gateway asks of it (its "REQUEST" answer), so
the mapping of each parameter is checked; a program that breaks the contract fails its
request, and only it.
"""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from .test_gateway import fake_gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    from symphony.gateway.keys import add_key
    d = tmp_path_factory.mktemp("gateway-messages")
    keys = d / "keys.json"
    alice, _ = add_key(str(keys), "alice-key", "alice")
    k = fake_gateway(d, keys)
    k.key = alice
    yield k
    k.stop()


def ant(gw):
    return anthropic.Anthropic(base_url=gw.url, api_key=gw.key, max_retries=0, timeout=60)


def oai(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.key, max_retries=0, timeout=60)


def asked(gw, **kw) -> dict:
    """The serving program's request for a Messages request whose last user turn is REQUEST."""
    r = ant(gw).messages.create(model="tiny", max_tokens=50, **kw)
    return json.loads(r.content[0].text)


USER = [{"role": "user", "content": "REQUEST"}]
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_a_message_streamed_and_not(gw):
    c = ant(gw)
    r = c.messages.create(model="tiny", max_tokens=10, system="be brief",
                          messages=[{"role": "user", "content": "one two three"}])
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny" and r.id.startswith("msg_")
    assert [(b.type, b.text) for b in r.content] == [("text", "one two three")]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens == 5 and r.usage.output_tokens == 3 and r.usage.cache_read_input_tokens == 0
    kinds = []
    with c.messages.stream(model="tiny", max_tokens=10, system="be brief",
                           messages=[{"role": "user", "content": "one two three"}]) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    assert final.content[0].text == "one two three" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 3
    raw = [k for k in kinds if k not in ("text",)]                     # the SDK adds its own "text" events
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    cut = c.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "one two three"}])
    assert cut.content[0].text == "one two" and cut.stop_reason == "max_tokens"


def test_each_parameter_reaches_the_serving_program(gw):
    req = asked(gw, system=[{"type": "text", "text": "rule one"}, {"type": "text", "text": "rule two"}],
                messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}] + USER,
                stop_sequences=["END", "STOP"], extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7},
                metadata={"user_id": "u1"})
    assert req["messages"] == [{"role": "system", "content": "rule one\nrule two"}, {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": "hello"}, {"role": "user", "content": "REQUEST"}]
    assert (req["max_tokens"], req["temperature"], req["top_p"], req["top_k"], req["stop"]) == (
        50, 0.5, 0.9, 7, ["END", "STOP"])
    req = asked(gw, messages=USER, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather",
                                                             "disable_parallel_tool_use": True})
    assert req["tool_choice"] == {"name": "get_weather"} and req["parallel_tool_calls"] is False
    assert req["tools"][0]["parameters"] == TOOLS[0]["input_schema"]
    assert asked(gw, messages=USER, tools=TOOLS, tool_choice={"type": "any"})["tool_choice"] == "required"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = asked(gw, messages=USER, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert fmt["response_format"] == {"type": "json_schema", "schema": schema}


def test_tool_use_and_tool_result_round_trip(gw):
    c = ant(gw)
    ask = [{"role": "user", "content": 'TOOL get_weather {"city": "Paris"}'}]
    r = c.messages.create(model="tiny", max_tokens=50, tools=TOOLS, messages=ask)
    assert r.stop_reason == "tool_use" and len(r.content) == 1
    use = r.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    with c.messages.stream(model="tiny", max_tokens=50, tools=TOOLS, messages=ask) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"
    turn = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "REQUEST"}]}]
    req = json.loads(c.messages.create(model="tiny", max_tokens=50, tools=TOOLS, messages=turn).content[0].text)
    assert req["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "name": "get_weather", "arguments": '{"city": "Paris"}'}]}
    assert req["messages"][2] == {"role": "tool", "tool_call_id": use.id, "content": "REQUEST"}
    wrong = turn[:2] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope",
                                                      "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=50, tools=TOOLS, messages=wrong)
    assert e.value.body["error"]["type"] == "invalid_request_error" and "toolu_nope" in e.value.body["error"]["message"]


def test_token_counting_renders_the_prompt_the_program_would(gw):
    c = ant(gw)
    n = c.messages.count_tokens(model="tiny", system="be brief", messages=[{"role": "user", "content": "a b c"}])
    assert n.input_tokens == 5
    got = c.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "a"}], tools=TOOLS)
    assert got.input_tokens == 1


def test_errors_are_anthropic_shaped(gw):
    c = ant(gw)
    bad = [([{"role": "user", "content": [{"type": "video", "url": "x"}]}], "messages.0.content.0.type"),
           ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
            "messages.0.content.0.type"),
           ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "prefill"}], "messages")]
    for messages, where in bad:
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tiny", max_tokens=5, messages=messages)
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert where in body["error"]["message"] or where == "messages", body
    h = {"x-api-key": gw.key, "anthropic-version": "2023-06-01"}
    for body in ({"model": "tiny", "messages": USER},                                   # no max_tokens
                 {"model": "tiny", "max_tokens": 5, "messages": USER, "temperature": 1.5},
                 {"model": "tiny", "max_tokens": 5, "messages": []},
                 {"model": "tiny", "max_tokens": 5, "messages": USER, "thinking": {"type": "enabled",
                                                                                   "budget_tokens": 1024}}):
        r = httpx.post(gw.url + "/v1/messages", headers=h, json=body)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(gw.url + "/v1/messages", headers={"x-api-key": "sym-wrong"}, json={})
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                            "message": "invalid API key"}}
    r = httpx.post(gw.url + "/v1/messages", headers={"Authorization": f"Bearer {gw.key}"}, content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"


def test_openai_extras_reach_the_program_and_bad_ones_are_400(gw):
    c = oai(gw)

    def req(**kw):
        r = c.chat.completions.create(model="tiny", messages=USER, **kw)
        return json.loads(r.choices[0].message.content)
    assert req(logit_bias={"5": 100, "17": -3.5})["logit_bias"] == [[5, 100.0], [17, -3.5]]
    assert req(extra_body={"guided_choice": ["yes", "no"]})["response_format"] == {"type": "choice",
                                                                                   "choices": ["yes", "no"]}
    assert req(extra_body={"structured_outputs": {"regex": "[a-z]+"}})["response_format"] == {
        "type": "regex", "pattern": "[a-z]+"}
    assert req(extra_body={"guided_json": '{"type": "object"}'})["response_format"] == {
        "type": "json_schema", "schema": {"type": "object"}}
    assert req(extra_body={"structured_outputs": {"grammar": 'start: "a"'}, "top_k": 5})["top_k"] == 5
    t = c.completions.create(model="tiny", prompt="REQUEST", logit_bias={"3": 1}, max_tokens=50,
                             extra_body={"guided_regex": "x+"})
    got = json.loads(t.choices[0].text)
    assert got["logit_bias"] == [[3, 1.0]] and got["response_format"] == {"type": "regex", "pattern": "x+"}
    for kw, param in [(dict(logit_bias={"5": 101}), "logit_bias"), (dict(logit_bias={"five": 1}), "logit_bias"),
                      (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias"),
                      (dict(extra_body={"guided_choice": ["a"], "guided_regex": "a"}), "guided_regex"),
                      (dict(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}),
                       "guided_choice"),
                      (dict(extra_body={"structured_outputs": {"structural_tag": {}}}), "structured_outputs"),
                      (dict(extra_body={"guided_choice": ["a", "a"]}), "response_format.choices")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=USER, **kw)
        assert e.value.status_code == 400 and (e.value.body.get("param") or "").startswith(param), (kw, e.value.body)


def test_a_program_that_breaks_the_contract_fails_only_its_request(gw):
    c = oai(gw)
    for kind in ("index", "order", "shape"):
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"BADEVENT {kind}"}])
        assert e.value.body["code"] == "program_failed", e.value.body
    assert c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fine"}]
                                     ).choices[0].message.content == "fine"
