"""The front door's policy (gateway/frontdoor.py) on fake connections: who is closed, who refused."""
import argparse

import pytest

from symphony.gateway import config as cfgmod
from symphony.gateway.frontdoor import Door, DoorConfig, State, address_of


class Conn:
    def __init__(self, door, addr, name):
        self.door, self.door_addr, self.name = door, addr, name
        self.door_state = None
        self.closed = None

    def door_close(self, status):
        self.closed = status
        self.door.release(self)

    def __repr__(self):
        return self.name


def opened(door, addr, name, state=None):
    c = Conn(door, addr, name)
    ok = door.admit(c)
    if ok and state is not None:
        c.door_state = state
    return c if ok else None


def test_half_sent_connections_beyond_an_address_bound_close_its_oldest():
    door = Door(DoorConfig(max_pending_per_addr=3, max_per_addr=10, pending_grace=0))
    a = [opened(door, "10.0.0.2", f"a{i}") for i in range(5)]
    assert [c.closed for c in a] == [408, 408, None, None, None]
    b = opened(door, "10.0.0.3", "b")
    assert b.closed is None and door.stats()["pending"] == 4 and door.counts["evicted_pending"] == 2
    a[2].door_state = State.ACTIVE                       # its headers are in: no longer counted
    opened(door, "10.0.0.2", "a5")
    assert a[3].closed is None
    a[2].door_state = State.IDLE
    door.pending(a[2])                                   # its next request begins: the newest pending
    assert a[3].closed == 408 and a[2].closed is None


def test_a_burst_of_new_connections_is_not_evicted_but_old_half_sent_ones_are(monkeypatch):
    """Honest clients opening at once are all PENDING for a moment: only connections
    PENDING for longer than the grace count against the address's bound."""
    import symphony.gateway.frontdoor as fd
    now = [1000.0]
    monkeypatch.setattr(fd.time, "monotonic", lambda: now[0])
    door = Door(DoorConfig(max_pending_per_addr=3, max_per_addr=200, pending_grace=1.0))
    slow = [opened(door, "10.0.0.2", f"s{i}") for i in range(5)]
    assert all(c.closed is None for c in slow)
    now[0] += 2.0                                        # the first five are old now
    burst = [opened(door, "10.0.0.2", f"b{i}") for i in range(100)]
    assert [c.closed for c in slow] == [408, 408, None, None, None]
    assert all(c.closed is None for c in burst) and door.counts["evicted_pending"] == 2
    with pytest.raises(ValueError, match="pending_grace"):
        DoorConfig(pending_grace=-1)


def test_an_address_at_its_bound_gives_up_its_oldest_idle_then_pending_else_refuses():
    door = Door(DoorConfig(max_pending_per_addr=4, max_per_addr=4, pending_grace=0))
    busy = [opened(door, "10.0.0.2", f"b{i}", State.ACTIVE) for i in range(2)]
    idle = opened(door, "10.0.0.2", "i", State.IDLE)
    pend = opened(door, "10.0.0.2", "p")
    new = opened(door, "10.0.0.2", "n1")
    assert idle.closed is None and new is not None and door.counts["evicted_idle"] == 1
    new2 = opened(door, "10.0.0.2", "n2")
    assert pend.closed == 408 and new2 is not None
    new.door_state = new2.door_state = State.ACTIVE
    assert opened(door, "10.0.0.2", "n3") is None and door.counts["refused_per_address"] == 1
    assert all(c.closed is None for c in busy)
    assert opened(door, "10.0.0.9", "other") is not None


def test_a_full_door_makes_room_at_the_heaviest_other_address_only():
    door = Door(DoorConfig(max_connections=6, max_per_addr=6, max_pending_per_addr=6, pending_grace=0))
    heavy = [opened(door, "10.0.0.2", f"h{i}") for i in range(5)]
    light = opened(door, "10.0.0.3", "l")
    assert door.open == 6
    other = opened(door, "10.0.0.4", "o")               # full: the heavy address gives its oldest up
    assert other is not None and heavy[0].closed == 408 and door.open == 6
    assert opened(door, "10.0.0.2", "h5") is None       # the heaviest itself: refused
    assert door.counts["refused_full"] == 1 and light.closed is None


def test_addresses_and_the_door_config():
    assert address_of(("127.0.0.2", 5000)) == "127.0.0.2"
    assert address_of(("2001:db8::1:2:3:4", 1, 0, 0)) == address_of(("2001:db8::9", 1)) == "2001:db8::/64"
    assert address_of(("::ffff:10.1.2.3", 1)) == "10.1.2.3"
    assert address_of(None) == "local"
    for bad in ({"header_timeout": 0}, {"max_per_addr": 0}, {"max_header_bytes": 100}, {"write_timeout": -1}):
        with pytest.raises(ValueError):
            DoorConfig(**bad)


def test_gateway_flags_make_the_door_and_refuse_nonsense():
    p = argparse.ArgumentParser()
    cfgmod.add_args(p)
    args = p.parse_args(["--header-timeout", "5", "--max-conns-per-addr", "32", "--max-pending-per-addr", "4",
                         "--max-http-connections", "100", "--max-header-kb", "8", "--write-timeout", "7"])
    cfg = cfgmod.from_args(args, "/tmp/k.sock", "127.0.0.1", 8000)
    door = cfg.door()
    assert (door.header_timeout, door.max_per_addr, door.max_pending_per_addr, door.max_connections,
            door.max_header_bytes, door.write_timeout) == (5.0, 32, 4, 100, 8192, 7.0)
    argv = cfgmod.to_argv(args)
    assert argv[argv.index("--max-pending-per-addr") + 1] == "4"
    for flags, msg in ((["--header-timeout", "0"], "--header-timeout"), (["--max-header-kb", "0"], "--max-header-kb"),
                       (["--max-conns-per-addr", "2", "--max-pending-per-addr", "4"], "--max-conns-per-addr")):
        with pytest.raises(cfgmod.ConfigError, match=msg):
            cfgmod.from_args(p.parse_args(flags), "/tmp/k.sock", "127.0.0.1", 8000)


def test_a_websocket_stays_counted_against_its_address_until_it_closes():
    """Any route is bounded: uvicorn hands an upgraded connection to its WebSocket protocol, and
    the door keeps counting it (ACTIVE) against its address until that one closes."""
    import asyncio
    import socket
    import threading
    import time

    import uvicorn
    from websockets.sync.client import connect

    from symphony.gateway.frontdoor import protocol_class

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        assert scope["type"] == "websocket"
        await receive()
        await send({"type": "websocket.accept"})
        while (msg := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": msg["text"]})

    door = Door(DoorConfig(max_per_addr=3, max_pending_per_addr=2, pending_grace=0))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=protocol_class(door), ws="websockets-sansio", log_level="error",
                                           lifespan="on"))
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)

    def ws():
        s = socket.socket()
        s.bind(("127.0.0.7", 0))
        s.connect(("127.0.0.1", port))
        return connect(f"ws://127.0.0.1:{port}/", sock=s, open_timeout=5, legacy=True)

    def settle(n):
        deadline = time.monotonic() + 5
        while door.stats()["connections"] != n and time.monotonic() < deadline:
            time.sleep(0.01)
        return door.stats()["connections"]
    try:
        sessions = [ws() for _ in range(3)]
        assert settle(3) == 3 and door.stats()["pending"] == 0
        s = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.7", 0))
        assert s.recv(100).startswith(b"HTTP/1.1 503")    # its address holds 3 sessions, none idle
        s.close()
        sessions[0].close()
        assert settle(2) == 2
        sessions.append(ws())
        sessions[-1].send("still echoed")
        assert sessions[-1].recv(timeout=5) == "still echoed"
        for w in sessions[1:]:
            w.close()
        assert settle(0) == 0
    finally:
        server.should_exit = True
        t.join(10)


def test_sampling_defaults_fill_what_a_client_leaves_unset_and_bad_ones_stop_the_start():
    import argparse
    from symphony.gateway import config as cfgmod
    from symphony.gateway.app import Gateway
    from symphony.gateway.completions import chat_request
    from symphony.gateway.keys import KeyStore
    from symphony.gateway.schema import ChatRequest, decode
    from symphony.lip.serving import Request
    p = argparse.ArgumentParser()
    cfgmod.add_args(p)
    args = p.parse_args(["--sampling-defaults", '{"top_p": 0.95, "min_p": 0.05, "top_k": 40}'])
    cfg = cfgmod.from_args(args, "/tmp/k.sock", "127.0.0.1", 8000)
    assert cfg.sampling_defaults == {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    argv = cfgmod.to_argv(args)                  # symphony-kernel --http passes it on to its gateway
    assert cfgmod.parse_sampling_defaults(argv[argv.index("--sampling-defaults") + 1]) == cfg.sampling_defaults
    gw = Gateway(cfg, KeyStore(None))
    key = gw.authenticate(type("R", (), {"headers": {}})())
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    req = gw.prepare(chat_request(decode(body, ChatRequest), "refuse"), key)
    assert (req["temperature"], req["top_p"], req["top_k"], req["min_p"]) == (1.0, 0.95, 40, 0.05)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5, "min_p": 0, "top_k": -1}'
    req = gw.prepare(chat_request(decode(body, ChatRequest), "refuse"), key)
    assert (req["top_p"], req["top_k"], req["min_p"]) == (0.5, 0, 0)           # what the client sent wins
    assert Request.parse(__import__("json").dumps(req)).min_p == 0            # the program's contract takes it
    # without the flag: OpenAI's defaults
    plain = cfgmod.from_args(p.parse_args([]), "/tmp/k.sock", "127.0.0.1", 8000)
    assert plain.sampling_defaults == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    for text, msg in (('{"min_p": 2}', "min_p must be a number in"), ('{"top_k": 1.5}', "top_k must be"),
                      ('{"top_p": 0}', "top_p must be"), ('{"temperature": true}', "temperature must be"),
                      ('{"typical_p": 0.9}', "unknown parameter 'typical_p'"), ("[0.9]", "a JSON object"),
                      ("top_p=0.9", "must be a JSON object"),
                      ('{"top_k": 1099511627776}', "top_k must be"),     # past what a request's contract takes
                      ('{"min_p": null}', "min_p must be")):
        with pytest.raises(cfgmod.ConfigError, match=msg):
            cfgmod.from_args(p.parse_args(["--sampling-defaults", text]), "/tmp/k.sock", "127.0.0.1", 8000)
