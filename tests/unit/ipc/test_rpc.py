"""The client RPC declared once (symphony/ipc/rpc.py) and its TCP transport (transport.py).

Every request type decodes its good form and refuses a bad one naming the field, on the
client side (check_request) as on the kernel side (decode_request); replies and events that
do not fit are ReplyErrors; the shared-secret handshake lets in only a peer that knows the
secret, and the client refuses a server that does not; tcp:// is loopback only; a secret
file others can read is refused."""
from __future__ import annotations

import asyncio
import os

import msgspec
import pytest

from symphony.ipc import rpc, transport
from symphony.ipc.protocol import encode_frame
from symphony.ipc.transport import AuthError, Credentials, Endpoint

GOOD = {
    "spawn": {"source": "def main(): pass", "args": ["a"], "grants": {"http": ["x:1"]}, "limits": {"timeout": 5},
              "attach": False, "priority": "batch", "kv_tokens": 100, "user": "alice"},
    "input": {"lip": 3, "data": "line"}, "kill": {"lip": 1}, "ps": {}, "stats": {}, "kv_ls": {"path": "/shared"},
    "kv_stat": {"path": "/a"}, "kv_rm": {"path": "/a"}, "kv_export": {"path": "/a"},
    "kv_import": {"path": "/a", "size": 10, "sha256": "0" * 64, "chunks": 1, "parents": True},
    "kv_adopt": {"peer": "ab" * 16, "dir": "/home/a"}, "drain": {}, "shutdown": {},
    "test_hook": {"hook": "stall", "seconds": 1.5},
}

BAD = [
    ({"op": "kill", "lip": "3"}, "lip", "kill: lip must be a LIP id (an int >= 1), got '3'"),
    ({"op": "kill", "lip": 0}, "lip", "kill: lip must be a LIP id"),
    ({"op": "spawn"}, "source", "spawn: source is required"),
    ({"op": "spawn", "source": "x", "extra": 1}, "extra", "spawn: unknown field 'extra'"),
    ({"op": "spawn", "source": "x", "grants": {"net": []}}, "grants", "spawn: grants must be an object of http, read"),
    ({"op": "spawn", "source": "x", "user": "Root;rm"}, "user", "spawn: user must be a KVFS user name"),
    ({"op": "input", "lip": 1}, "", "input: input needs exactly one of data"),
    ({"op": "input", "lip": 1, "data": "x", "eof": True}, "", "input needs exactly one"),
    ({"op": "kv_import", "path": "/a", "size": 0, "sha256": "0" * 64, "chunks": 1}, "size", "size must be a size"),
    ({"op": "kv_adopt", "peer": "../etc", "dir": "/a"}, "peer", "peer must be a durable directory's id"),
    ({"op": "kv_ls", "path": ""}, "path", "kv_ls: path must be a KVFS path"),
    ({"op": "fly"}, "op", "unknown op 'fly': a request's op is one of drain, input, kill"),
    ({"lip": 1}, "op", "a request needs an op"),
]


def test_every_request_type_has_a_good_form_and_a_reply_type():
    assert sorted(GOOD) == sorted(t.__struct_config__.tag for t in rpc.REQUESTS)
    for op, fields in GOOD.items():
        req = rpc.decode_request({"op": op, **fields})
        assert type(req).__struct_config__.tag == op and type(req) in rpc.REPLIES
        assert rpc.decode_request(msgspec.json.encode({"op": op, **fields})) == req       # bytes decode the same


@pytest.mark.parametrize("msg, field, words", BAD)
def test_a_bad_request_is_refused_naming_the_field_on_both_sides(msg, field, words):
    for side in (rpc.check_request, rpc.decode_request):
        with pytest.raises(rpc.RpcError) as e:
            side(msg)
        assert words in str(e.value) and e.value.field == field


def test_a_frame_that_is_not_an_object_or_not_json():
    with pytest.raises(rpc.RpcError, match="a request must be a JSON object"):
        rpc.decode_request([1, 2])
    with pytest.raises(rpc.RpcError, match="not JSON"):
        rpc.decode_request(b"{nope")


def test_replies_and_events_are_checked_keeping_fields_a_newer_kernel_adds():
    spawn = rpc.Spawn(source="x")
    assert rpc.check_reply(spawn, {"event": "queued", "lip": 2, "position": 1, "new": True})["new"]
    assert rpc.check_reply(spawn, {"error": "EPERM", "type": "PermissionError", "message": "no"})
    with pytest.raises(rpc.ReplyError):
        rpc.check_reply(spawn, {"event": "started", "lip": "two"})
    with pytest.raises(rpc.ReplyError):
        rpc.check_reply(rpc.Stats(), {"model": "m"})                      # no instance
    rpc.check_event({"event": "exit", "status": 0, "reason": "finished", "lip": 1})
    with pytest.raises(rpc.ReplyError):
        rpc.check_event({"event": "exit"})
    with pytest.raises(rpc.ReplyError):
        rpc.check_event({"event": "teleport"})


def test_kv_data_travels_as_raw_frames_that_a_json_reader_refuses():
    blob = os.urandom(rpc.CHUNK_BYTES + 5)
    frames = rpc.raw_frames(blob)
    assert len(frames) == 2 and len(rpc.raw_frames(b"")) == 1
    wire = b"".join(h + bytes(d) for h, d in frames)

    async def read_back():
        r = asyncio.StreamReader()
        r.feed_data(wire)
        r.feed_eof()
        return b"".join([await rpc.read_raw(r) for _ in frames])
    assert asyncio.run(read_back()) == blob
    with pytest.raises(rpc.RpcError, match="expected a raw frame of KV data, got a JSON frame"):
        rpc.raw_length(encode_frame({"op": "ps"})[:4])
    with pytest.raises(rpc.RpcError, match="at most"):
        rpc.raw_length((rpc.RAW | (rpc.CHUNK_BYTES + 1)).to_bytes(4, "big"))
    from symphony.ipc.protocol import MAX_FRAME, ProtocolError, read_frame

    async def as_request():                                 # where a request is expected: refused
        r = asyncio.StreamReader()
        r.feed_data(wire)
        await read_frame(r)
    assert int.from_bytes(frames[0][0], "big") > MAX_FRAME
    with pytest.raises(ProtocolError):
        asyncio.run(as_request())


# ---------------------------------------------------------------- transport
def test_endpoints_and_where_tcp_may_go():
    assert Endpoint.parse("/run/k.sock") == Endpoint("unix", path="/run/k.sock")
    assert Endpoint.parse("unix:///run/k.sock").path == "/run/k.sock"
    assert str(Endpoint.parse("tls://[::1]:7000")) == "tls://[::1]:7000"
    assert Endpoint.parse("tcp://127.0.0.1:7").kind == "tcp"
    for bad, words in (("tcp://10.0.0.1:7000", "serves loopback addresses only"), ("tls://h", "expected tls://"),
                       ("tls://h:99999", "expected tls://"), ("ftp://h:1", "unknown scheme")):
        with pytest.raises(ValueError, match=words):
            Endpoint.parse(bad)


def test_a_secret_file_must_be_private_and_long_enough(tmp_path):
    f = tmp_path / "s"
    f.write_text("x" * 40)
    f.chmod(0o644)
    with pytest.raises(ValueError, match="readable by other users .* chmod 600"):
        transport.read_secret(str(f))
    f.chmod(0o600)
    assert transport.read_secret(str(f)) == b"x" * 40
    f.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16 are needed"):
        transport.read_secret(str(f))
    with pytest.raises(ValueError, match="needs the CA"):
        Credentials(b"x" * 20).context(Endpoint.parse("tls://h:1"))


def _serve(secret: bytes, seen: list):
    async def handle(reader, writer):
        try:
            await transport.server_handshake(reader, writer, secret, timeout=2)
            seen.append("in")
            writer.write(encode_frame({"ok": True, "served": True}))
            await writer.drain()
        except AuthError as e:
            seen.append(f"refused: {e}")
        finally:
            writer.close()
    return handle


def test_the_handshake_admits_only_who_knows_the_secret_and_checks_the_kernel_too():
    async def go():
        seen: list = []
        server = await asyncio.start_server(_serve(b"k" * 32, seen), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ep = Endpoint.parse(f"tcp://127.0.0.1:{port}")
        r, w = await transport.open_connection(ep, Credentials(b"k" * 32))
        w.close()
        with pytest.raises(AuthError, match="authentication failed"):
            await transport.open_connection(ep, Credentials(b"x" * 32))
        # a client that skips the handshake and sends a request is refused before it is read
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(encode_frame({"op": "ps"}))
        await w.drain()
        await asyncio.sleep(0.3)
        w.close()
        server.close()
        # a server that does not know the secret: the client refuses it
        async def impostor(reader, writer):
            writer.write(encode_frame({"hello": transport.PROTOCOL, "nonce": "ab" * 32}))
            await transport._read_small(reader)
            writer.write(encode_frame({"ok": True, "mac": "00" * 32}))
            await writer.drain()
        fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
        with pytest.raises(AuthError, match="did not prove it knows the secret"):
            await transport.open_connection(Endpoint.parse(f"tcp://127.0.0.1:{fake.sockets[0].getsockname()[1]}"),
                                            Credentials(b"k" * 32))
        fake.close()
        return seen
    seen = asyncio.run(go())
    assert seen[0] == "in" and seen[1].startswith("refused: the client did not prove")
    assert seen[2].startswith("refused:")
