"""The serving program's request and events (symphony/lip/serving.py), without a kernel:
``stream`` in the request, and the merging of a choice's text and call arguments when
the client does not stream."""
import orjson
import pytest

from symphony.lip import serving
from symphony.lip.serving import HELD_BYTES, BadRequest, Events, Request


@pytest.fixture
def sent(monkeypatch):
    out = []
    monkeypatch.setattr(serving, "send", lambda ev: out.append(orjson.loads(orjson.dumps(ev))))
    return out


def text(i, s, lp=None):
    ev = {"event": "text", "index": i, "text": s}
    if lp is not None:
        ev["logprobs"] = [{"token": s, "bytes": list(s.encode()), "logprob": lp, "top_logprobs": []}]
    return ev


def call(i, k, args, name=None):
    ev = {"event": "tool_call", "index": i, "call": k}
    if name:
        ev.update(id=f"call_{i}{k}", name=name)
    ev["arguments"] = args
    return ev


def done(i):
    return {"event": "done", "index": i, "finish_reason": "stop", "completion_tokens": 3}


def replay(events, coalesce):
    ev = Events(coalesce=coalesce)
    for e in events:
        assert ev.send(e)
    ev.flush()


def content(events):
    """Per choice: its text, its logprobs, its calls {k: [name, arguments]}, its events' kinds in order."""
    out = {}
    for e in events:
        c = out.setdefault(e.get("index"), {"text": "", "logprobs": [], "calls": {}, "kinds": []})
        if e["event"] == "text":
            c["text"] += e["text"]
            c["logprobs"] += e.get("logprobs", [])
        elif e["event"] == "tool_call":
            c["calls"].setdefault(e["call"], [e.get("name"), ""])[1] += e["arguments"]
        if not c["kinds"] or c["kinds"][-1] != e["event"]:
            c["kinds"].append(e["event"])
    return out


def test_stream_is_a_field_true_by_default():
    base = {"mode": "text", "prompt": "hi"}
    assert Request.parse(orjson.dumps(base)).stream is True
    assert Request.parse(orjson.dumps(dict(base, stream=None))).stream is True
    assert Request.parse(orjson.dumps(dict(base, stream=False))).stream is False
    with pytest.raises(BadRequest) as e:
        Request.parse(orjson.dumps(dict(base, stream="no")))
    assert e.value.param == "stream"


def test_streamed_events_pass_one_by_one(sent):
    evs = [text(0, "a"), text(0, "b"), call(0, 0, "{", "f"), call(0, 0, "}"), done(0)]
    replay(evs, coalesce=False)
    assert sent == evs


def test_not_streamed_merges_each_choices_text_and_call_arguments(sent):
    """Two choices interleaved: text (with logprobs), then a call in pieces, then done. Each
    choice's first piece goes at once; the rest of its text is one event, the rest of each
    call one event; the content and its order are the streamed events'."""
    evs = []
    for k in range(40):
        evs += [text(0, f"w{k} ", -0.5), text(1, f"v{k} ", -0.25)]
    evs += [call(0, 0, '{"a":', "f"), call(0, 0, " 1"), call(0, 0, "}"), call(0, 1, "{", "g"), call(0, 1, "}"),
            done(0), done(1)]
    replay(evs, coalesce=False)
    streamed = list(sent)
    sent.clear()
    replay(evs, coalesce=True)
    assert content(sent) == content(streamed)
    kinds = [(e["index"], e["event"], e.get("name")) for e in sent]
    assert kinds == [(0, "text", None), (1, "text", None),          # the first pieces, at once
                     (0, "text", None),                             # the rest of choice 0's text
                     (0, "tool_call", "f"), (0, "tool_call", "g"),  # each call whole
                     (0, "done", None), (1, "text", None), (1, "done", None)]
    assert sent[2]["logprobs"] == [x for e in evs[2:80:2] for x in e["logprobs"]]


def test_a_merged_event_stays_small_and_an_error_sends_what_was_held(sent):
    piece = "x" * 1000
    ev = Events(coalesce=True)
    for _ in range(200):
        ev.send(text(0, piece, -1.0))
    ev.error(500, "internal_error", "boom")
    assert not ev.send(text(0, "late"))                             # nothing after an error
    assert sent[-1]["event"] == "error" and all(e["event"] == "text" for e in sent[:-1])
    assert "".join(e["text"] for e in sent[:-1]) == piece * 200
    assert len(sent) - 1 < 50                                       # of 200 pieces of ~5 KB with their logprobs
    assert all(len(orjson.dumps(e)) <= HELD_BYTES for e in sent)


# ---------------------------------------------------------------- tool calls: repeats and closed objects
def _parsed(text, chunk=3):
    """CallGuard's output for call blocks ``text`` fed ``chunk`` characters at a time, and the
    guard (as the serving program drives it: to the text's end, or until a call repeats)."""
    from symphony.lip.tools import CallGuard, CallParser
    p, g, out = CallParser(), CallGuard(), []
    for i in range(0, len(text), chunk):
        out += g.push(p.feed(text[i:i + chunk]), p.ended)
        if g.repeated is not None:
            break
    out += g.push(p.finish(), p.ended) + g.finish()
    return out, g


def _calls(events) -> dict:
    calls = {}
    for e in events:
        calls.setdefault(e["call"], ["", ""])
        calls[e["call"]][0] = e.get("name", calls[e["call"]][0])
        calls[e["call"]][1] += e["arguments"]
    return calls


def test_calls_never_end_in_a_runaway():
    from symphony.lip.tools import call_text
    a, b = call_text("get_weather", '{"city":"Paris"}'), call_text("get_weather", '{"city":"Rome"}')
    for chunk in (1, 3, 7, 1000):
        out, g = _parsed("\n".join([a, b, a, b]), chunk)          # the third call repeats the first: the end
        assert g.repeated == 2 and g.sent == 2
        assert _calls(out) == {0: ["get_weather", '{"city":"Paris"}'], 1: ["get_weather", '{"city":"Rome"}']}
        first = [e for e in out if e["call"] == 0]
        assert len(first) > 1 or chunk == 1000                     # the first call streams in pieces
        assert len([e for e in out if e["call"] == 1]) == 1           # a later one goes whole, in one event
    c = call_text("get_weather", '{"city":"Paris, TX"}')            # starts like an earlier call: sent whole
    out, g = _parsed("\n".join([a, c]), 2)
    assert g.repeated is None and _calls(out)[1] == ["get_weather", '{"city":"Paris, TX"}']
    out, g = _parsed(a + "\n" + b[:-20], 5)                         # a later call cut by the token limit: dropped
    assert g.cut and g.sent == 1 and _calls(out) == {0: ["get_weather", '{"city":"Paris"}']}
    out, g = _parsed(a + "\n" + b[:-12], 5)                         # only its closing tag cut: kept
    assert not g.cut and _calls(out)[1] == ["get_weather", '{"city":"Rome"}']
    out, g = _parsed(a[:-20], 5)                                     # the first call cut short: sent as it came
    assert not g.cut and g.sent == 1 and _calls(out) == {0: ["get_weather", '{"city":"P']}


def test_tool_objects_are_closed_unless_the_schema_says_otherwise():
    from symphony.lip.tools import closed
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                          "l": {"type": "array", "items": {"properties": {"c": {}}}},
                                          "open": {"properties": {}, "additionalProperties": True}},
         "anyOf": [{"properties": {"x": {}}}], "$defs": {"d": {"properties": {"y": {}}}}}
    c = closed(s)
    assert c["additionalProperties"] is False and c["properties"]["a"]["additionalProperties"] is False
    assert c["properties"]["l"]["items"]["additionalProperties"] is False
    assert c["properties"]["open"]["additionalProperties"] is True
    assert c["anyOf"][0]["additionalProperties"] is False and c["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in s and closed({"type": "object"}) == {"type": "object"}
