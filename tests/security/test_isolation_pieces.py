"""The pieces of isolation between users, alone (no kernel): the connection
table and its frame reader, the escaping of control characters, the slow
lane's turns, and the re-charge of shared pages in KVFS."""
import asyncio
import struct

import pytest

from conftest import tiny_config


def test_connections_per_user_and_root_reserve():
    from symphony.kernel.loop.bounds import ClientBounds, ConnectionRefused, Connections
    c = Connections(ClientBounds(max_connections_per_user=2, root_connections=2), total=5)
    c.open(1000)
    c.open(1000)
    with pytest.raises(ConnectionRefused, match=r"uid 1000 has 2 open.*--max-connections-per-user 2"):
        c.open(1000)
    c.open(1001)
    with pytest.raises(ConnectionRefused, match=r"3 are open.*--max-connections 5; the last 2 are root's"):
        c.open(1002)                                       # the last two are root's
    c.open(0)
    c.open(0)
    with pytest.raises(ConnectionRefused):
        c.open(0)
    c.close(0)                                             # root's count too: 4 open, the others' 3 taken
    with pytest.raises(ConnectionRefused):
        c.open(1002)
    c.close(1000)
    c.close(1001)                                          # now 1 of root's, 1 of the others
    c.open(1002)
    assert len(c) == 3 and c.refused == 4
    with pytest.raises(ValueError, match="at least one frame"):
        ClientBounds(max_partial_bytes_per_user=1 << 20)


def test_frames_in_flight_are_bounded_per_user_and_idle_ones_time_out():
    from symphony.ipc.protocol import MAX_FRAME, ProtocolError
    from symphony.kernel.loop.bounds import ClientBounds, Connections

    async def run():
        c = Connections(ClientBounds(max_partial_bytes_per_user=MAX_FRAME, idle_timeout_s=0.2), total=10)
        a, b = asyncio.StreamReader(), asyncio.StreamReader()
        body = b'{"op": "ps"}'
        a.feed_data(struct.pack(">I", MAX_FRAME - 10))     # a frame that never ends
        ta = asyncio.ensure_future(c.read_request(a, 7, None))
        await asyncio.sleep(0.05)
        assert c.partial[7] == MAX_FRAME - 10
        b.feed_data(struct.pack(">I", len(body)) + body)  # the same user's next frame waits for room
        tb = asyncio.ensure_future(c.read_request(b, 7, None))
        await asyncio.sleep(0.05)
        assert not tb.done()
        with pytest.raises(ProtocolError, match="did not arrive within 0.2 s"):
            await ta                                        # the stalled one is given up
        assert await tb == {"op": "ps"} and not c.partial
        with pytest.raises(asyncio.TimeoutError):         # no request at all: the caller closes it
            await c.read_request(asyncio.StreamReader(), 8, 0.05)
    asyncio.run(run())


def test_printable_escapes_controls_only():
    from symphony.kernel.escape import printable
    assert printable("naïve 🎉 'q' \\ ok") == "naïve 🎉 'q' \\ ok"
    assert printable("a\nb\rc\td\x1b[2J\x00\x7f\x85\u202e\u2028") == \
        "a\\nb\\rc\\td\\x1b[2J\\x00\\x7f\\x85\\u202e\\u2028"
    assert printable(ValueError("x\ny")) == "x\\ny"


def test_slow_lane_takes_turns_between_users():
    from symphony.kernel.syscall.slowlane import SlowLane
    lane, order, done = SlowLane(), [], []

    def job(tag, n):
        for i in range(n):
            order.append(tag)
            yield
        return tag
    for i in range(3):                                     # ann asks three times, bob once
        lane.submit("ann", job(f"a{i}", 2), lambda r, e: done.append(r))
    lane.submit("bob", job("b", 2), lambda r, e: done.append(r))
    while len(lane):
        lane.run(budget_s=1.0)
    assert order[:4] == ["a0", "b", "a0", "b"], order    # one slice each per round
    assert done == ["a0", "b", "a1", "a2"]


def test_a_shared_page_is_charged_to_a_user_who_maps_it():
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine
    from symphony.engine.weights import random_weights
    from symphony.kvfs import KVFS, KVFSConfig, Principal, QuotaExceeded
    eng = Engine(random_weights(tiny_config(), seed=0), EngineConfig(page_size=16, num_pages=64))
    fs = KVFS(eng, KVFSConfig(user_page_quota=20, user_ref_quota=40))
    bob, alice = Principal("bob", 1), Principal("alice", 2)
    h = fs.create(bob, "/shared/b.kv", 0o644)
    fs.pred(bob, h, list(range(3, 83)))                    # 5 pages, bob's
    fs.close(bob, h)
    r = fs.open(alice, "/shared/b.kv")
    forks = [fs.fork(alice, r) for _ in range(3)]
    assert (fs.quotas.by_user["bob"], fs.quotas.by_user["alice"]) == (5, 0)
    assert fs.quotas.refs_by_user["alice"] == 15          # her three forks map 15 pages
    with pytest.raises(QuotaExceeded, match="would map 45 pages.*at most 40.*--user-page-refs"):
        [fs.fork(alice, r) for _ in range(6)]
    fs.close(alice, r)
    fs.remove(bob, "/shared/b.kv")                         # bob's file, his last reference: alice pays
    assert (fs.quotas.by_user["bob"], fs.quotas.by_user["alice"]) == (0, 5)
    for hid in [hid for hid, x in fs.handles.items() if x.pid == 2]:
        fs.close(alice, hid)
    assert fs.quotas.by_user["alice"] == 0 and eng.kv.allocator.num_used == 0
