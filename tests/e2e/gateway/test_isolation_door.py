"""The gateway's front door against hostile clients of one key (alice), another key (bob) timed
alone and during each attack: nothing refused to bob, his request within 3x his time alone + 1 s,
the gateway's memory bounded.

A real `symphony-kernel --http` on the tiny model, its routes served by tests/e2e/lips/fake_serve.py
(answers without a model: the front door is what is tested), the door's bounds set small so that
each attack shows in seconds (perf/bench_isolation.py runs them at full size).  Alice attacks from
127.0.0.2/.3 (the door bounds connections per client address), bob asks from 127.0.0.1."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import REPO, KernelProc
from .attacks import (Flood, SlowHeaders, closed_by_peer, connect_from, gateway_pid, never_reading_streams,
                      read_response, request_bytes, rss_mib)
from .test_gateway import free_port, wait_for_gateway

FAKE = str(REPO / "tests" / "e2e" / "lips" / "fake_serve.py")
SLOWDOWN, SLACK_S = 3.0, 1.0
DOOR = ("--header-timeout", "2", "--body-timeout", "2", "--write-timeout", "2", "--max-pending-per-addr", "8",
        "--max-conns-per-addr", "64", "--max-http-connections", "512", "--max-header-kb", "16")


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    from symphony.gateway.keys import add_key
    from modelfiles import write_tiny_gguf
    d = tmp_path_factory.mktemp("door")
    model = write_tiny_gguf(d, seed=1)
    keys = d / "keys.json"
    alice, _ = add_key(str(keys), "alice-key", "alice", rpm=600, max_concurrent=8)
    bob, _ = add_key(str(keys), "bob-key", "bob")
    port = free_port()
    k = KernelProc(d, "--model", str(model), "--http", f"127.0.0.1:{port}", "--keys", str(keys), *DOOR,
                   *sum((["--program", f"{r}={FAKE}"] for r in ("chat", "completions", "responses")), []),
                   session=True)       # as a service runs: the attackers' threads here are not in its CPU group
    wait_for_gateway(k)
    k.port, k.url, k.keys = port, f"http://127.0.0.1:{port}", {"alice": alice, "bob": bob}
    k.gateway = gateway_pid(k.proc.pid)
    yield k
    k.stop()


def bob_asks(k, n: int = 5) -> float:
    """Bob's requests one after another on fresh connections: all 200 with the echoed answer;
    the seconds they took."""
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "bob is served"}]}
    t0 = time.monotonic()
    for _ in range(n):
        r = httpx.post(k.url + "/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {k.keys['bob']}"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "bob is served"
    return time.monotonic() - t0


def check_bob(k, alone: float, label: str) -> None:
    t = bob_asks(k)
    print(f"{label}: bob {alone:.2f} s alone, {t:.2f} s during the attack")
    assert t <= SLOWDOWN * alone + SLACK_S, f"{label}: bob took {t:.2f} s, {alone:.2f} s alone"


def metrics(k) -> dict:
    out = {}
    for line in httpx.get(k.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("symphony:gateway_connection") or line.startswith("symphony:gateway_client"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_slow_headers_from_one_address_never_refuse_another(door):
    """1,200 connections from one address that trickle their headers (a header line every 0.5 s):
    the address keeps at most 8 half-sent for over a second (and 64 in all), the oldest closed
    with 408 as new ones come, the last ones at the 2 s header timeout; bob is served as usual,
    the gateway does not grow."""
    alone = bob_asks(door)
    rss0 = rss_mib(door.gateway)
    stop = threading.Event()
    attack = SlowHeaders(door.port, n=1200, every=0.5)         # more than uvicorn's own bound (1,088)
    t = threading.Thread(target=attack.run, args=(stop,), daemon=True)
    t.start()
    try:
        time.sleep(1.5)
        check_bob(door, alone, "slow headers")
        m = metrics(door)
        assert m["symphony:gateway_connections_pending"] <= 64 + 1      # hers (64 per address), bob's
        time.sleep(2.5)                                                # past the header timeout
        check_bob(door, alone, "slow headers, later")
    finally:
        stop.set()
        t.join(10)
    m = metrics(door)
    print(f"slow headers: {attack.opened} opened, {attack.closed_by_server} closed by the gateway "
          f"{attack.statuses}, gateway RSS +{rss_mib(door.gateway) - rss0:.0f} MiB; {m}")
    assert attack.opened == attack.closed_by_server == 1200 and attack.statuses == {"408": 1200}
    evicted = m['symphony:gateway_connections_closed_total{reason="evicted_pending"}']
    timeouts = m['symphony:gateway_connections_closed_total{reason="header_timeouts"}']
    assert evicted >= 1200 - 64 and timeouts >= 8 and evicted + timeouts >= 1200
    assert m['symphony:gateway_connections_closed_total{reason="refused_full"}'] == 0
    assert rss_mib(door.gateway) - rss0 < 32


def test_headers_that_never_end_and_a_body_that_never_ends_are_closed(door):
    """A request whose headers never end: 431 at 16 KiB; one that sends its headers then a body
    a byte a second: closed after the body timeout, its key's concurrency slot given back."""
    s = connect_from("127.0.0.4", door.port)
    s.setblocking(True)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    with pytest.raises(OSError):
        for _ in range(100):
            s.sendall(b"X-Filler: " + b"y" * 1000 + b"\r\n")
            time.sleep(0.001)
    s.close()
    s = connect_from("127.0.0.4", door.port)
    s.setblocking(True)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Filler: yyyy\r\n" * 1200)
    assert s.recv(100).startswith(b"HTTP/1.1 431")
    s.close()
    tight = []
    for _ in range(8):                                        # alice's 8 concurrent slots, all trickling
        s = connect_from("127.0.0.4", door.port)
        s.setblocking(True)
        s.sendall(request_bytes("/v1/chat/completions", door.keys["alice"], {"x": 1})[:-3])
        tight.append(s)
    t0 = time.monotonic()
    assert all(closed_by_peer(s, 6) for s in tight) and time.monotonic() - t0 < 6
    for s in tight:
        s.close()
    r = httpx.post(door.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {door.keys['alice']}"},
                   json={"model": "tiny-test", "messages": [{"role": "user", "content": "slots back"}]}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "slots back"


def test_many_connections_from_one_address_only_close_its_own(door):
    """One address opens 200 connections that send nothing (it keeps 64, then 8 once they have
    been half-sent for over a second and it opens another), then 100 that each make a request
    and stay open (it keeps 64, its oldest idle ones closed first); bob's connection, idle all
    along, is untouched and then served."""
    bob_conn = connect_from("127.0.0.1", door.port)
    bob_conn.setblocking(True)
    bob_conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + door.keys["bob"].encode() + b"\r\n\r\n")
    assert read_response(bob_conn)[0] == 200                      # now idle, kept alive
    socks = [connect_from("127.0.0.5", door.port) for _ in range(200)]
    time.sleep(0.3)
    assert len([s for s in socks if not closed_by_peer(s)]) == 64              # the address's bound
    time.sleep(1.0)                                                           # now old half-sent ones
    socks.append(connect_from("127.0.0.5", door.port))
    time.sleep(0.3)
    assert len([s for s in socks[:200] if not closed_by_peer(s)]) == 8 and not closed_by_peer(socks[200])
    for s in socks:
        s.close()
    socks = []
    for _ in range(100):
        s = connect_from("127.0.0.5", door.port)
        s.setblocking(True)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  + door.keys["alice"].encode() + b"\r\n\r\n")
        assert read_response(s)[0] == 200
        socks.append(s)
    time.sleep(0.3)
    alive = [i for i, s in enumerate(socks) if not closed_by_peer(s)]
    assert alive == list(range(36, 100))                            # the newest 64
    bob_conn.sendall(request_bytes("/v1/chat/completions", door.keys["bob"],
                                   {"model": "tiny-test", "messages": [{"role": "user", "content": "kept"}]}))
    status, body = read_response(bob_conn)
    assert status == 200 and b'"content":"kept"' in body
    for s in socks + [bob_conn]:
        s.close()


def test_streams_that_are_never_read_are_closed_and_hold_nothing(door):
    """Alice's 8 streams of 20 MB each, their clients reading nothing: the gateway holds a bounded
    amount for each, closes each after the write timeout, and the kernel kills their programs."""
    kc = door.client()
    alone = bob_asks(door)
    rss0 = rss_mib(door.gateway)
    big = {"model": "tiny-test", "messages": [{"role": "user", "content": "BIG 20000"}], "stream": True,
           "max_tokens": 20000}
    socks = never_reading_streams(door.port, door.keys["alice"], big, 8)
    try:
        time.sleep(1.0)
        check_bob(door, alone, "never-read streams")
        grown = rss_mib(door.gateway) - rss0
        assert kc.stats()["output_queued_bytes"] <= 8 * (2 << 20)
        t0 = time.monotonic()
        assert all(closed_by_peer(s, 8) for s in socks), "a stream nobody reads was kept open"
        print(f"never-read streams: gateway RSS +{grown:.0f} MiB while held; all closed "
              f"{time.monotonic() - t0 + 1:.1f} s after they stopped reading")
        assert grown < 48
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while [x for x in kc.ps()["lips"] if x["user"] == "alice"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [x for x in kc.ps()["lips"] if x["user"] == "alice"]


def test_a_flood_of_programs_from_one_key_never_refuses_another(door):
    """Alice's 16 clients submit programs to /v1/lips back to back (her key answers 429 beyond its
    8 at once and 600 a minute): bob's requests are served as usual, none refused."""
    alone = bob_asks(door)
    prog = {"source": "import time\n\ndef main():\n    time.sleep(0.2)\n"}
    with Flood(door.url, door.keys["alice"], 16, lambda i, j: prog, path="/v1/lips", addr="127.0.0.6",
               retry_s=0) as flood:
        time.sleep(1.0)
        check_bob(door, alone, "/v1/lips flood")
    codes = flood.codes
    print(f"/v1/lips flood: alice's answers {codes}")
    assert codes.get(200, 0) > 0 and codes.get(429, 0) > 0 and set(codes) <= {200, 429}
