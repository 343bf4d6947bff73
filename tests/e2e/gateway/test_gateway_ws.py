"""The WebSocket mode of /v1/responses and /v1/responses/compact, against a real kernel with
the serving program whose answers are known (tests/e2e/lips/fake_serve.py).

Clients: the `openai` package's `responses.connect()` and, for what a well-behaved client
never sends, `websockets` itself and a raw TCP socket.  What must hold: the events of a turn
are the SSE ones; turns on one socket run in order; a store:false continuation on the same
socket carries the conversation (the program is shown it) and fails on another socket with
previous_response_not_found, after which the socket still serves; a failed continuation
evicts the response it named; bad messages get error envelopes and the socket lives on;
broken frames or a client gone mid-response end only that socket, stop its program and free
its key's slot; a key holds a bounded number of sockets (the handshake beyond is a 429), and
a socket lives a bounded time.  A compaction seeds a new chain and cannot be forged.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
import websockets
from websockets.sync.client import connect

from .test_gateway import fake_gateway

MAX_AGE = 8                             # --socket-max-age of this module's gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    from symphony.gateway.keys import add_key
    d = tmp_path_factory.mktemp("gateway-ws")
    keys = d / "keys.json"
    alice, _ = add_key(str(keys), "alice-key", "alice")
    bob, _ = add_key(str(keys), "bob-key", "bob")
    k = fake_gateway(d, keys, "--max-sockets-per-key", "2", "--socket-max-age", str(MAX_AGE), "--max-body-mb", "1")
    k.ws = k.url.replace("http://", "ws://") + "/v1/responses"
    k.keys = {"alice": alice, "bob": bob}
    yield k
    k.stop()


def sock(gw, who="alice"):
    return connect(gw.ws, additional_headers={"Authorization": f"Bearer {gw.keys[who]}"}, open_timeout=30)


def turn(ws, **body) -> list:
    """Send a response.create; the events up to the turn's last (a terminal event or an error)."""
    ws.send(json.dumps({"type": "response.create", "model": "tiny", **body}))
    return until_end(ws)


def until_end(ws) -> list:
    out = []
    while True:
        ev = json.loads(ws.recv(timeout=60))
        out.append(ev)
        if ev["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            return out


def text(events) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def lips(gw, user="alice") -> list:
    """The LIPs of ``user`` the kernel still runs."""
    with gw.client() as c:
        return [p for p in c.ps()["lips"] if p["user"] == user]


def test_the_openai_client_gets_the_sse_events_over_a_socket(gw):
    import openai
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys["alice"], max_retries=0)
    sse = [e.type for e in c.responses.create(model="tiny", input="one two three", stream=True)]
    with c.responses.connect() as conn:
        conn.response.create(model="tiny", input="one two three")
        got = []
        for ev in conn:
            got.append(ev)
            if ev.type == "response.completed":
                break
    assert [e.type for e in got] == sse
    assert [e.sequence_number for e in got] == list(range(len(got)))
    final = got[-1].response
    assert final.output_text == "one two three" and final.status == "completed" and final.usage.output_tokens == 3
    assert c.responses.retrieve(final.id).output_text == "one two three"        # store: true by default


def test_turns_run_in_order_and_a_store_false_chain_continues_only_on_its_socket(gw):
    with sock(gw) as ws:
        ws.send(json.dumps({"type": "response.create", "model": "tiny", "store": False, "input": "SLOW 5"}))
        ws.send(json.dumps({"type": "response.create", "model": "tiny", "store": False, "input": "second turn"}))
        first, second = until_end(ws), until_end(ws)
        assert text(first) == "w0 w1 w2 w3 w4" and text(second) == "second turn"    # in order, not interleaved
        assert first[0]["type"] == second[0]["type"] == "response.created"
        rid = second[-1]["response"]["id"]
        cont = turn(ws, store=False, previous_response_id=rid, input="REQUEST")
        msgs = json.loads(text(cont))["messages"]
        assert [(m["role"], m["content"]) for m in msgs] == [("user", "second turn"), ("assistant", "second turn"),
                                                             ("user", "REQUEST")]
        assert cont[-1]["response"]["previous_response_id"] == rid
        # the connection holds one conversation (its last response): an older store:false one is gone
        older = turn(ws, store=False, previous_response_id=first[-1]["response"]["id"], input="x")
        assert older[-1]["error"]["code"] == "previous_response_not_found"
    assert httpx.get(f"{gw.url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {gw.keys['alice']}"}
                     ).status_code == 404                                        # store: false is nowhere else
    with sock(gw) as ws:
        miss = turn(ws, store=False, previous_response_id=rid, input="again")
        assert len(miss) == 1 and miss[0]["error"]["code"] == "previous_response_not_found"
        assert miss[0]["status"] == 400 and miss[0]["error"]["param"] == "previous_response_id"
        ok = turn(ws, store=False, input="a fresh start")                       # the socket recovers
        assert ok[-1]["type"] == "response.completed" and text(ok) == "a fresh start"


def test_a_failed_continuation_evicts_the_response_it_named(gw):
    with sock(gw) as ws:
        rid = turn(ws, store=False, input="remember ember")[-1]["response"]["id"]
        bad = turn(ws, store=False, previous_response_id=rid,
                   input=[{"type": "function_call_output", "call_id": "call_missing", "output": "x"}])
        assert bad[-1]["type"] == "error" and bad[-1]["status"] == 400 and "call_missing" in bad[-1]["error"]["message"]
        again = turn(ws, store=False, previous_response_id=rid, input="stale")
        assert again[-1]["error"]["code"] == "previous_response_not_found"
        # a program that fails after the response started (response.failed) evicts it too
        rid = turn(ws, store=False, input="remember this")[-1]["response"]["id"]
        failed = turn(ws, store=False, previous_response_id=rid, input="BADEVENT index")
        assert failed[-1]["type"] in ("response.failed", "error")
        assert turn(ws, store=False, previous_response_id=rid, input="x")[-1]["error"]["code"] == \
            "previous_response_not_found"


def test_a_stored_response_continues_on_any_socket_of_its_user_only(gw):
    with sock(gw) as ws:
        rid = turn(ws, input="kept")[-1]["response"]["id"]                     # store: true
    with sock(gw) as ws:
        assert turn(ws, previous_response_id=rid, input="more")[-1]["type"] == "response.completed"
    with sock(gw, "bob") as ws:
        assert turn(ws, previous_response_id=rid, input="more")[-1]["error"]["code"] == "previous_response_not_found"


def test_bad_messages_get_error_envelopes_and_the_socket_lives_on(gw):
    with sock(gw) as ws:
        cases = [("not json", "invalid_json"), (b"\xff\xfe\x00binary", "invalid_json"), ("[1, 2]", "invalid_event"),
                 (json.dumps({"type": "session.update"}), "invalid_event"),
                 (json.dumps({"type": "response.create", "model": "tiny", "input": "x", "stream": True}), None),
                 (json.dumps({"type": "response.create", "model": "tiny", "input": "x", "background": True}), None),
                 (json.dumps({"type": "response.create", "model": "nope", "input": "x"}), "model_not_found"),
                 (json.dumps({"type": "response.create", "model": "tiny", "input": "x", "temperature": 9}), None),
                 (json.dumps({"type": "response.create", "model": "tiny", "input": "x" * (1 << 20)}),
                  "request_too_large")]
        for msg, code in cases:
            ws.send(msg)
            ev = json.loads(ws.recv(timeout=30))
            assert ev["type"] == "error" and 400 <= ev["status"] < 500, (msg[:40], ev)
            assert ev["error"]["code"] and (code is None or ev["error"]["code"] == code), (msg[:40], ev)
        assert text(turn(ws, input="still here")) == "still here"


def test_broken_frames_and_a_client_gone_mid_response_end_only_that_socket(gw):
    # a frame that breaks the WebSocket protocol (unmasked client frame, reserved opcode)
    port = int(gw.url.rsplit(":", 1)[1])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    raw.sendall((f"GET /v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                 f"Authorization: Bearer {gw.keys['alice']}\r\n\r\n").encode())
    assert b"101" in raw.recv(4096).split(b"\r\n")[0]
    raw.sendall(b"\x83\x05hello" + b"\x00" * 64)                                 # opcode 3, not masked
    raw.settimeout(10)
    try:
        closing = raw.recv(4096)
    except ConnectionError:
        closing = b""
    assert closing == b"" or closing[0] & 0x0F == 0x8                            # a close frame, or gone
    raw.close()
    # a client that goes away mid-response: its program is killed, its key's slot freed
    ws = sock(gw)
    ws.send(json.dumps({"type": "response.create", "model": "tiny", "input": "SLOW 200"}))
    while json.loads(ws.recv(timeout=30))["type"] != "response.output_text.delta":
        pass
    assert lips(gw)
    ws.close()
    deadline = time.time() + 30
    while lips(gw) and time.time() < deadline:
        time.sleep(0.2)
    assert not lips(gw)
    with sock(gw) as ws:                                                         # everything else goes on
        assert text(turn(ws, input="after")) == "after"


def test_a_key_holds_a_bounded_number_of_sockets_and_a_socket_a_bounded_time(gw):
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        connect(gw.ws, additional_headers={"Authorization": "Bearer sym-nope"}, open_timeout=30)
    assert e.value.response.status_code == 401
    a, b = sock(gw), sock(gw)
    t0 = time.time()
    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        sock(gw)
    assert e.value.response.status_code == 429
    assert json.loads(e.value.response.body)["error"]["code"] == "websocket_connection_limit"
    with sock(gw, "bob") as other:                                               # another key is not held back
        assert text(turn(other, input="bob here")) == "bob here"
    b.close()
    time.sleep(0.5)
    with sock(gw) as c:                                                          # a closed one frees its place
        assert text(turn(c, input="third")) == "third"
    # the age limit: an error naming it, then the close
    ev = json.loads(a.recv(timeout=MAX_AGE + 30))
    assert ev["type"] == "error" and ev["error"]["code"] == "websocket_connection_limit_reached"
    assert time.time() - t0 >= MAX_AGE - 5
    with pytest.raises(websockets.exceptions.ConnectionClosed):
        a.recv(timeout=10)


def test_a_compaction_seeds_a_new_chain_and_cannot_be_forged(gw):
    import openai
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.keys["alice"], max_retries=0)
    convo = [{"role": "user", "content": "remember slate"}, {"role": "assistant", "content": "OK"},
             {"role": "user", "content": "compress this"}]
    comp = c.responses.compact(model="tiny", input=convo)
    assert comp.object == "response.compaction" and [o.type for o in comp.output] == ["message", "message",
                                                                                      "compaction"]
    assert [o.content[0].text for o in comp.output[:2]] == ["remember slate", "compress this"]   # user turns kept
    window = [o.model_dump(exclude_none=True) for o in comp.output]
    with sock(gw) as ws:
        ev = turn(ws, store=False, input=window + [{"type": "message", "role": "user", "content": "REQUEST"}])
        msgs = json.loads(text(ev))["messages"]
        assert [m["role"] for m in msgs] == ["user", "user", "system", "user"]
        assert msgs[2]["content"].startswith("A summary of the conversation so far")
        forged = dict(window[-1], encrypted_content="symc1.AAAA")
        bad = turn(ws, store=False, input=[forged, {"type": "message", "role": "user", "content": "x"}])
        assert bad[-1]["type"] == "error" and bad[-1]["status"] == 400
    r = httpx.post(f"{gw.url}/v1/responses/compact", headers={"Authorization": f"Bearer {gw.keys['alice']}"},
                   json={"input": convo})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
