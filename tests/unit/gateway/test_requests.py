"""The serving program's requests the gateway builds from OpenAI requests (completions.py,
responses.py): each one the program's own check accepts (symphony.lip.serving.Request), and
``stream`` says whether the client streams, on every route."""
import orjson
import pytest

from symphony.gateway.completions import chat_request, completion_requests
from symphony.gateway.responses import serve_request
from symphony.gateway.schema import ChatRequest, CompletionRequest, ResponsesRequest, decode
from symphony.lip.serving import Request

MSGS = [{"role": "user", "content": "Hi"}]


def built(route, body):
    if route == "chat":
        return [chat_request(decode(orjson.dumps(body), ChatRequest), "refuse")]
    if route == "completions":
        return completion_requests(decode(orjson.dumps(body), CompletionRequest))
    r = decode(orjson.dumps(body), ResponsesRequest)
    return [serve_request(r, [{"role": "user", "content": r.input}])[0]]


@pytest.mark.parametrize("route,body", [
    ("chat", {"model": "m", "messages": MSGS, "n": 2, "logprobs": True, "top_logprobs": 2, "stop": "x"}),
    ("completions", {"model": "m", "prompt": ["a b", "c"], "max_tokens": 4, "logprobs": 1}),
    ("responses", {"model": "m", "input": "Hi", "max_output_tokens": 8}),
])
@pytest.mark.parametrize("stream", [None, False, True])
def test_stream_reaches_the_program(route, body, stream):
    if stream is not None:
        body = dict(body, stream=stream)
    reqs = built(route, body)
    assert reqs and all(r["stream"] is bool(stream) for r in reqs)
    for r in reqs:
        assert Request.parse(orjson.dumps(dict(r, cache=None))).stream is bool(stream)


def test_kv_files_a_client_sends_are_bounded():
    """A hostile POST /v1/lips: too many kv_files, an empty one, a path past 4 KiB, not a list:
    each a 400 naming kv_files (the router asks every kernel about each file it keeps)."""
    import orjson
    import pytest
    from symphony.gateway.errors import ApiError
    from symphony.gateway.schema import MAX_KV_FILES, LipRequest
    ok = decode(orjson.dumps({"program": "chat", "kv_files": ["/home/a/x.kv"] * MAX_KV_FILES}), LipRequest)
    assert len(ok.kv_files) == MAX_KV_FILES
    for bad in (["/x"] * (MAX_KV_FILES + 1), [""], ["/" + "a" * 4096], "/x"):
        with pytest.raises(ApiError) as e:
            decode(orjson.dumps({"program": "chat", "kv_files": bad}), LipRequest)
        assert e.value.status == 400 and e.value.param and "kv_files" in e.value.param
