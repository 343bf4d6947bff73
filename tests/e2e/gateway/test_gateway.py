"""The HTTP gateway against a real kernel, with a serving program whose answers are known.

`symphony-kernel --http` starts the gateway (as a child that drops root for a
uid of its own); every OpenAI route is served by tests/e2e/lips/fake_serve.py (the
serve contract without a model: it echoes words, calls tools, refuses or
crashes on command), so these tests check the gateway itself: shapes as the
`openai` package parses them, streamed == not streamed, statuses and error
bodies, keys, limits, disconnects, programs over HTTP and `symphony run
--remote`.  The real serving program on the real model: test_gateway_model.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, KernelProc

FAKE = str(REPO / "tests" / "e2e" / "lips" / "fake_serve.py")
HELLO = '''from symphony.lip import send, recv
def main(*args):
    send("hello " + " ".join(args) + "\\n")
    print("to stdout")
    send({"got": recv()})
    return 3
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_gateway(k: KernelProc, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if "symphony-gateway: serving" in k.read_log():
            return
        if k.proc.poll() is not None:
            raise RuntimeError("kernel died:\n" + k.read_log()[-3000:])
        time.sleep(0.1)
    raise RuntimeError("the gateway did not start:\n" + k.read_log()[-3000:])


def fake_gateway(d: Path, keys: Path, *extra: str) -> KernelProc:
    """A kernel on a tiny random model whose gateway serves every route with fake_serve.py
    (``extra``: more flags); ``url`` set once the gateway answers."""
    from modelfiles import write_tiny_gguf
    port = free_port()
    k = KernelProc(d, "--model", str(write_tiny_gguf(d, seed=1)), "--http", f"127.0.0.1:{port}", "--keys",
                   str(keys), *extra, *sum((["--program", f"{r}={FAKE}"] for r in
                                            ("chat", "completions", "responses", "messages")), []))
    wait_for_gateway(k)
    k.url = f"http://127.0.0.1:{port}"
    return k


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    from symphony.gateway.keys import add_key
    from modelfiles import write_tiny_gguf
    d = tmp_path_factory.mktemp("gateway")
    model = write_tiny_gguf(d, seed=1)
    keys = d / "keys.json"
    alice, _ = add_key(str(keys), "alice-key", "alice", grants={"http": ["127.0.0.1"], "read": []})
    bob, _ = add_key(str(keys), "bob-key", "bob", max_priority="interactive")
    slow, _ = add_key(str(keys), "tight", "carol", rpm=3, max_concurrent=1)
    port = free_port()
    k = KernelProc(d, "--model", str(model), "--http", f"127.0.0.1:{port}", "--keys", str(keys),
                   "--max-body-mb", "1", *sum((["--program", f"{r}={FAKE}"] for r in
                                                ("chat", "completions", "responses")), []))
    wait_for_gateway(k)
    k.url = f"http://127.0.0.1:{port}"
    k.keys = {"alice": alice, "bob": bob, "tight": slow}
    k.key_file = keys
    yield k
    k.stop()


def client(gw, who="alice"):
    return httpx.Client(base_url=gw.url, timeout=30, headers={"Authorization": f"Bearer {gw.keys[who]}"})


def oai(gw, who="alice"):
    import openai
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys[who], max_retries=0)


def sse(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


# ---------------------------------------------------------------- OpenAI shapes, through the openai package
def test_models_chat_and_completions_streamed_equal_plain(gw):
    c = oai(gw)
    assert [m.id for m in c.models.list().data] == ["tiny", "tiny-test"]      # the file, then its general.name
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"}]
    r = c.chat.completions.create(model="tiny-test", messages=msgs, n=2, temperature=0)
    assert [ch.message.content for ch in r.choices] == ["one two three", "[1] one two three"]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6 and r.usage.total_tokens == 11
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    stream = c.chat.completions.create(model="tiny-test", messages=msgs, n=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = ["", ""], [None, None], None
    for ch in stream:
        if ch.usage:
            usage = ch.usage
        for x in ch.choices:
            texts[x.index] += x.delta.content or ""
            finish[x.index] = x.finish_reason or finish[x.index]
    assert texts == [ch.message.content for ch in r.choices] and finish == ["stop", "stop"]
    assert usage.total_tokens == 11
    # max_tokens cuts: finish "length"; logprobs come through in OpenAI's shape
    r = c.chat.completions.create(model="tiny-test", messages=msgs, max_tokens=2, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == "one two" and r.choices[0].finish_reason == "length"
    lp = r.choices[0].logprobs.content
    assert [e.logprob for e in lp] == [-0.5, -0.5] and len(lp[0].top_logprobs) == 2
    # completions: a batch of prompts, legacy logprobs, streamed == plain
    r = c.completions.create(model="tiny-test", prompt=["a b c", "d e"], max_tokens=2, logprobs=1)
    assert [x.text for x in r.choices] == ["a b", "d e"] and [x.finish_reason for x in r.choices] == ["length", "stop"]
    assert r.choices[0].logprobs.tokens == ["a ", "b"] and r.choices[0].logprobs.text_offset == [0, 2]
    s = "".join(x.choices[0].text for x in c.completions.create(model="tiny-test", prompt="a b c", stream=True)
                if x.choices)
    assert s == c.completions.create(model="tiny-test", prompt="a b c").choices[0].text == "a b c"


def test_the_program_is_told_whether_the_client_streams(gw):
    """``stream`` in the program's request is the client's, on every route: false lets it merge
    its text into a few events (the not-streamed answers above are merged ones)."""
    c, ask = oai(gw), [{"role": "user", "content": "REQUEST"}]
    told = lambda text: json.loads(text)["stream"]                      # noqa: E731
    assert told(c.chat.completions.create(model="tiny-test", messages=ask).choices[0].message.content) is False
    assert told("".join(x.delta.content or "" for ch in c.chat.completions.create(
        model="tiny-test", messages=ask, stream=True) for x in ch.choices)) is True
    assert told(c.completions.create(model="tiny-test", prompt="REQUEST").choices[0].text) is False
    assert told("".join(x.text for ch in c.completions.create(model="tiny-test", prompt="REQUEST", stream=True)
                        for x in ch.choices)) is True
    assert told(c.responses.create(model="tiny-test", input="REQUEST").output_text) is False
    assert told("".join(e.delta for e in c.responses.create(model="tiny-test", input="REQUEST", stream=True)
                        if e.type == "response.output_text.delta")) is True


def test_tool_calls_chat_and_responses(gw):
    c = oai(gw)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]
    ask = [{"role": "user", "content": 'TOOL get_weather {"location": "Paris"}'}]
    r = c.chat.completions.create(model="tiny-test", messages=ask, tools=tools)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris"} and r.choices[0].message.content is None
    args = ""
    for ch in c.chat.completions.create(model="tiny-test", messages=ask, tools=tools, stream=True):
        for x in ch.choices:
            for tc in x.delta.tool_calls or []:
                args += tc.function.arguments or ""
    assert json.loads(args) == {"location": "Paris"}
    # the tool-result turn is accepted and reaches the program as a tool message
    turn = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny and warm"}]
    assert c.chat.completions.create(model="tiny-test", messages=turn, tools=tools).choices[0].message.content == \
        "sunny and warm"
    # Responses: a function_call item, streamed with its argument events
    rtools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    resp = c.responses.create(model="tiny-test", input=ask[0]["content"], tools=rtools)
    fc = [o for o in resp.output if o.type == "function_call"][0]
    assert json.loads(fc.arguments) == {"location": "Paris"} and resp.status == "completed"
    kinds = [e.type for e in c.responses.create(model="tiny-test", input=ask[0]["content"], tools=rtools,
                                                stream=True)]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")


def test_responses_store_continue_and_delete(gw):
    c = oai(gw)
    r1 = c.responses.create(model="tiny-test", input="first turn here", instructions="sys words")
    assert r1.output_text == "first turn here" and r1.usage.input_tokens == 5
    r2 = c.responses.create(model="tiny-test", input="second", previous_response_id=r1.id)
    # the program sees the stored conversation (2 + 3 words), not the old instructions, then the new input
    assert r2.usage.input_tokens == 3 + 3 + 1 and r2.previous_response_id == r1.id
    events = list(c.responses.create(model="tiny-test", input="one two", stream=True))
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events)))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta",
                                        "response.output_text.delta", "response.output_text.done",
                                        "response.content_part.done", "response.output_item.done",
                                        "response.completed"]
    assert c.responses.retrieve(r1.id).output_text == "first turn here"
    with client(gw, "bob") as h:                       # another user's stored response does not exist for bob
        assert h.get(f"/v1/responses/{r1.id}").status_code == 404
        assert h.post("/v1/responses", json={"model": "tiny-test", "input": "x",
                                              "previous_response_id": r1.id}).status_code == 404
    with client(gw) as h:
        assert h.delete(f"/v1/responses/{r1.id}").json() == {"id": r1.id, "object": "response", "deleted": True}
        assert h.get(f"/v1/responses/{r1.id}").status_code == 404
        assert h.delete(f"/v1/responses/{r1.id}").status_code == 404
        r = h.post("/v1/responses", json={"model": "tiny-test", "input": "a b c d", "max_output_tokens": 2})
        assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"] == {"reason": "max_output_tokens"}


# ---------------------------------------------------------------- every error has its status and body
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "bot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "x"}],
                              "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "n": 99}, 400,
     "n"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": [
        {"type": "input_audio"}]}]}, 400, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "ERROR 400 "
                                                                  "context_length_exceeded"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny-test", "messages": [{"role": "user", "content": "ERROR 422 "
                                                                  "invalid_schema"}], "stream": True}, 422, "messages"),
    ("/v1/completions", {"model": "tiny-test", "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"model": "tiny-test", "prompt": ["a", 1]}, 400, "prompt"),
    ("/v1/responses", {"model": "tiny-test"}, 400, "input"),
    ("/v1/responses", {"model": "tiny-test", "input": "x", "background": True}, 400, "background"),
    ("/v1/nothing", {}, 404, None),
])
def test_bad_requests_get_openai_errors(gw, path, body, status, param):
    with client(gw) as h:
        r = h.post(path, content=body if isinstance(body, bytes) else json.dumps(body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    assert r.headers["x-request-id"].startswith("req_")


def test_content_parts_files_and_images():
    """Text parts join; an inline text file is read; an image or binary file becomes a line saying
    what it was (or 400 with --attachments refuse); audio is always 400."""
    from symphony.gateway.errors import ApiError
    from symphony.gateway.schema import Part, text_of
    import base64
    txt = "data:text/plain;base64," + base64.b64encode("Title: Fixture".encode()).decode()
    pdf = "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.1 ...").decode()
    parts = [Part("input_text", text="Read: "), Part("input_file", filename="a.txt", file_data=txt),
             Part("input_image"), Part("input_file", filename="b.pdf", file_data=pdf)]
    assert text_of(parts, "c", attachments="placeholder") == (
        "Read: [file a.txt]\nTitle: Fixture\n[image][file b.pdf: application/pdf, 12 bytes, not readable as text]")
    for bad, param in (([Part("input_image")], "c[0].type"), ([Part("input_audio")], "c[0].type"),
                       ([Part("input_file", file_data="data:text/plain;base64,@@@")], "c[0].file_data"),
                       ([Part("text")], "c[0].text")):
        with pytest.raises(ApiError) as e:
            text_of(bad, "c", attachments="refuse")
        assert e.value.status == 400 and e.value.param == param


def test_response_store_is_bounded_per_user():
    from symphony.gateway.store import ResponseStore, Stored
    st = ResponseStore(per_user=3, max_bytes=1000)
    one = lambda who, n: Stored(who, {}, [], [{"content": "x" * n}])  # noqa: E731
    st.put("bob1", one("bob", 100))
    for i in range(5):
        assert st.put(f"r{i}", one("alice", 100))
    assert [st.get("alice", f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert st.put("big", one("alice", 700))                   # over 1000 bytes with the rest: oldest go
    assert st.get("alice", "r2") is None and st.get("alice", "big") is not None
    assert not st.put("huge", one("alice", 2000))              # alone over the bound: not kept, nothing dropped
    assert st.get("alice", "big") is not None and st.get("bob", "bob1") is not None
    assert st.get("bob", "big") is None and st.delete("alice", "big") and not st.delete("alice", "big")


def test_auth_size_method_and_program_failure(gw):
    ok = {"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(gw.url + "/v1/chat/completions", json=ok)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(gw.url + "/v1/chat/completions", json=ok, headers={"Authorization": "Bearer sym-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with client(gw) as h:
        r = h.post("/v1/chat/completions", content=b"x" * (1 << 20 | 1))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = h.put("/v1/chat/completions", json=ok)
        assert r.status_code == 405 and "error" in r.json()
        r = h.post("/v1/chat/completions", json=dict(ok, messages=[{"role": "user", "content": "CRASH"}]))
        assert r.status_code == 500 and r.json()["error"]["code"] == "program_failed"
        assert "Traceback" not in r.text                 # the program's stderr goes to the log, not the client
    # the gateway logs the program's stderr as its lines arrive, which may be after the reply
    deadline = time.monotonic() + 15
    while "fake_serve crashed on purpose" not in gw.read_log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "fake_serve crashed on purpose" in gw.read_log()
    health = httpx.get(gw.url + "/health").json()
    assert health["status"] == "ok" and [(k["socket"], k["state"]) for k in health["kernels"]] == [(gw.socket, "up")]


def test_rate_and_concurrency_limits(gw):
    ok = {"model": "tiny-test", "messages": [{"role": "user", "content": "SLOW 10"}], "stream": True}
    with client(gw, "tight") as h, client(gw, "alice") as other:
        with h.stream("POST", "/v1/chat/completions", json=ok) as busy:
            assert busy.status_code == 200
            r = h.post("/v1/chat/completions", json=ok)                       # max_concurrent 1
            assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1
            assert other.post("/v1/chat/completions", json=dict(ok, stream=False, messages=[
                {"role": "user", "content": "unaffected"}])).json()["choices"][0]["message"]["content"] == "unaffected"
        small = dict(ok, messages=[{"role": "user", "content": "x"}], stream=False)
        got = []
        for _ in range(6):          # (the closed stream's slot may still be held for a moment: 429 concurrency)
            r = h.post("/v1/chat/completions", json=small)
            got.append((r.status_code, r.json().get("error", {}).get("code")))
        assert [g for g in got if g[0] == 200] == [(200, None)] * 2              # rpm 3, the stream was one
        assert got[-1] == (429, "rate_limit_exceeded") and int(r.headers["retry-after"]) >= 1


def test_disconnect_mid_stream_kills_the_program(gw):
    ok = {"model": "tiny-test", "messages": [{"role": "user", "content": "SLOW 200"}], "stream": True}
    kc = gw.client()
    before = kc.stats()["kv_pages_used"]
    with client(gw, "bob") as h:
        with h.stream("POST", "/v1/chat/completions", json=ok) as r:
            it = r.iter_lines()
            next(it)
            deadline = time.time() + 10
            while not [x for x in kc.ps()["lips"] if x["user"] == "bob"] and time.time() < deadline:
                time.sleep(0.05)
            assert [x for x in kc.ps()["lips"] if x["user"] == "bob"]
    deadline = time.time() + 10                          # the connection closed: the LIP is killed and reclaimed
    while [x for x in kc.ps()["lips"] if x["user"] == "bob"] and time.time() < deadline:
        time.sleep(0.05)
    assert not [x for x in kc.ps()["lips"] if x["user"] == "bob"]
    assert kc.stats()["kv_pages_used"] == before
    assert "client that ran it disconnected" in gw.read_log()
    # a request that is not streamed: the gateway watches for the disconnect while it waits
    with client(gw, "bob") as h:
        with pytest.raises(httpx.ReadTimeout):
            h.post("/v1/chat/completions", json=dict(ok, stream=False), timeout=1.5)
    deadline = time.time() + 10
    while [x for x in kc.ps()["lips"] if x["user"] == "bob"] and time.time() < deadline:
        time.sleep(0.05)
    assert not [x for x in kc.ps()["lips"] if x["user"] == "bob"]
    assert gw.read_log().count("client that ran it disconnected") >= 2


def test_a_slow_reader_holds_back_only_its_own_program(gw):
    """A client that stops reading a large stream: the kernel's output credit stops that program's
    send() (bounded bytes held for it), and every other client is served as usual."""
    big = {"model": "tiny-test", "messages": [{"role": "user", "content": "BIG 20000"}], "stream": True,
           "max_tokens": 20000}
    kc = gw.client()
    with socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps(big).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + gw.keys["bob"].encode() + b"\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(100)                                           # it started; then read nothing more
        time.sleep(2)
        lip = [x for x in kc.ps()["lips"] if x["user"] == "bob"]
        assert lip and lip[0]["state"] == "running"          # blocked in send(), not finished
        t0 = time.time()
        with client(gw, "alice") as h:
            r = h.post("/v1/chat/completions", json={"model": "tiny-test", "messages": [
                {"role": "user", "content": "still served"}]})
        assert r.json()["choices"][0]["message"]["content"] == "still served" and time.time() - t0 < 5
        assert kc.stats()["output_queued_bytes"] <= 2 << 20      # the kernel holds at most its output bound
    deadline = time.time() + 10                               # the reader went away: the program is killed
    while [x for x in kc.ps()["lips"] if x["user"] == "bob"] and time.time() < deadline:
        time.sleep(0.05)
    assert not [x for x in kc.ps()["lips"] if x["user"] == "bob"]


def _bound_address(port: int) -> str:
    """The local address a TCP socket of ``port`` listens on (/proc/net/tcp)."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            return socket.inet_ntoa(bytes.fromhex(addr)[::-1])
    return ""


@pytest.mark.skipif(not os.path.exists("/usr/bin/openssl"), reason="needs openssl to make a certificate")
def test_standalone_gateway_with_tls_and_no_keys_serves_loopback_only(gw, tmp_path):
    """`symphony-gateway` run by hand: as root it needs --run-as (the uid the kernel trusts); with
    no keys it binds loopback only, whatever --http says, and says so; --tls-* serve HTTPS."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    uid = int(gw.read_log().split("serving as uid ")[1].split(")")[0])
    port = free_port()
    base = [sys.executable, "-m", "symphony.gateway", "--http", f"0.0.0.0:{port}", "--socket", gw.socket,
            "--keys", str(tmp_path / "none.json"), *sum((["--program", f"{r}={FAKE}"] for r in
                                                        ("chat", "completions", "responses")), [])]
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env=gw.env, cwd=REPO)
    assert refused.returncode == 2 and "--run-as" in refused.stderr
    p = subprocess.Popen(base + ["--run-as", str(uid), "--tls-cert", str(cert), "--tls-key", str(key)],
                         stderr=subprocess.PIPE, text=True, env=gw.env, cwd=REPO)
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            if "symphony-gateway: serving" in line:
                break
        out = "".join(lines)
        assert "serving loopback only (127.0.0.1), not 0.0.0.0" in out and f"https://127.0.0.1:{port}" in out
        assert _bound_address(port) == "127.0.0.1"
        r = httpx.post(f"https://127.0.0.1:{port}/v1/chat/completions", verify=False,
                       json={"model": "tiny-test", "messages": [{"role": "user", "content": "over tls"}]})
        assert r.json()["choices"][0]["message"]["content"] is not None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)      # plain HTTP is not spoken there
    finally:
        p.terminate()
        p.wait(10)


# ---------------------------------------------------------------- programs over HTTP
def test_lips_over_http_and_symphony_run_remote(gw, tmp_path):
    with client(gw, "alice") as h, client(gw, "bob") as b:
        with h.stream("POST", "/v1/lips", json={"source": HELLO, "args": ["a", "b"]}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                events.append(ev)
                if ev["event"] == "started":
                    lip = ev["lip"]
                    assert [x["lip"] for x in h.get("/v1/lips").json()["data"]] == [lip]
                    assert b.get("/v1/lips").json()["data"] == []                   # bob sees none of alice's
                    assert b.post(f"/v1/lips/{lip}/input", json={"data": "x"}).status_code == 404
                    assert b.delete(f"/v1/lips/{lip}").status_code == 404
                    assert h.post(f"/v1/lips/{lip}/input", json={"data": "the line"}).json()["ok"]
        assert [e["event"] for e in events] == ["started", "out", "stdout", "out", "exit"]
        assert events[3]["data"] == {"got": "the line"} and events[-1]["status"] == 3
        # grants and priority beyond the key's policy: 403; a path as a program name: 404
        assert h.post("/v1/lips", json={"source": HELLO, "grants": {"http": ["evil.example"]}}).status_code == 403
        assert h.post("/v1/lips", json={"source": HELLO, "priority": "interactive"}).status_code == 403
        assert h.post("/v1/lips", json={"program": "../../etc/passwd"}).status_code == 404
        assert h.post("/v1/lips", json={"source": HELLO, "program": "chat"}).status_code == 400
        # KV files of the key's user, with the kernel's permissions
        assert {e["name"] for e in h.get("/v1/kv", params={"path": "/"}).json()["data"]} >= {"home", "shared"}
        assert h.get("/v1/kv/stat", params={"path": "/home/alice/none.kv"}).status_code == 404
        assert h.get("/v1/kv/stat").status_code == 400
    lip = tmp_path / "hello.py"
    lip.write_text(HELLO)
    env = dict(gw.env, SYMPHONY_API_KEY=gw.keys["alice"])
    cmd = [sys.executable, "-m", "symphony.cli", "run"]
    remote = subprocess.run(cmd + ["--remote", gw.url, str(lip), "x"], input="line\n", capture_output=True,
                            text=True, env=env, timeout=60, cwd=REPO)
    local = subprocess.run(cmd + [str(lip), "x"], input="line\n", capture_output=True, text=True, env=gw.env,
                           timeout=60, cwd=REPO)
    assert remote.returncode == local.returncode == 3
    assert remote.stdout == local.stdout == 'hello x\nto stdout\n{"got": "line"}\n'
    bad = subprocess.run(cmd + ["--remote", gw.url, str(lip)], capture_output=True, text=True,
                         env=dict(gw.env, SYMPHONY_API_KEY="sym-nope"), timeout=60, cwd=REPO)
    assert bad.returncode == 1 and "HTTP 401" in bad.stderr


# ---------------------------------------------------------------- operations
def test_metrics_logs_privilege_and_key_reload(gw):
    with client(gw) as h:
        h.post("/v1/chat/completions", json={"model": "tiny-test", "messages": [{"role": "user", "content": "a b"}]})
    text = httpx.get(gw.url + "/metrics").text
    for name in ("symphony:http_requests_total", "symphony:time_to_first_token_seconds_bucket",
                 "symphony:inter_token_latency_seconds", "symphony:e2e_request_latency_seconds",
                 "symphony:prompt_tokens_total", "symphony:generation_tokens_total",
                 "symphony:prefix_cache_hits_total", "symphony:num_requests_running",
                 'symphony:kv_pages{state="free",tier="device"}', "symphony:kernel_up 1.0"):
        assert name in text, name
    log = gw.read_log()
    assert "symphony.gateway.access" in log and "key=alice-key status=200 tokens=2+2" in log
    pid = int(subprocess.check_output(["pgrep", "-f", f"symphony.gateway --http {gw.url[7:]}"]).split()[0])
    uid = int(open(f"/proc/{pid}/status").read().split("Uid:")[1].split()[0])
    assert uid != 0                                              # the gateway never serves as root
    from symphony.gateway.keys import add_key
    new, _ = add_key(str(gw.key_file), "late", "dave")
    assert httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {new}"}).status_code == 401
    os.kill(pid, signal.SIGHUP)
    deadline = time.time() + 10
    while httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {new}"}).status_code != 200:
        assert time.time() < deadline, "SIGHUP did not load the new key"
        time.sleep(0.1)


@pytest.mark.skipif(os.geteuid() != 0, reason="the gateway drops to another uid only under a root kernel")
def test_http_refuses_a_socket_the_gateway_could_not_reach(public_tmp):
    """A root kernel's gateway runs as another uid: a socket in a directory other users may not
    search would leave it restarting forever. The kernel says so at start, before loading anything."""
    private = Path(public_tmp) / "private"
    private.mkdir(mode=0o700)
    r = subprocess.run([sys.executable, "-m", "symphony.kernel", "--socket", str(private / "k.sock"),
                        "--http", "127.0.0.1:1"], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2
    assert f"{private} is not searchable by other users" in r.stderr
