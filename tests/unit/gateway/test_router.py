"""The gateway's routing over several kernels, without processes: the routing table
(symphony/gateway/router.py) and the kernels it keeps true (symphony/gateway/kernels.py,
against fake kernel links)."""
import asyncio

import pytest

from symphony.gateway import kernels as kernels_mod
from symphony.gateway.errors import ApiError
from symphony.gateway.kernel import KernelRefused, KernelUnavailable
from symphony.gateway.kernels import Kernels
from symphony.gateway.router import (MAX_KEYS, NoKernel, PinnedKernelDown, RoutingTable, answer_keys,
                                     request_keys)


def chat(*contents, user="alice", cache=True, tools=None):
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"mode": "chat", "messages": [{"role": r, "content": c} for r, c in zip(roles, contents)],
            "tools": tools, "cache": {"dir": f"/home/{user}/serve-cache", "trust": []} if cache else None}


# ---------------------------------------------------------------- the table
def test_least_loaded_takes_ties_in_turn_and_counts_requests_in_flight():
    t = RoutingTable(3)
    assert [t.choose()[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]       # all idle: in turn
    t.begin(0)
    t.begin(0)
    t.begin(1)
    assert t.choose() == (2, "least_loaded")
    t.begin(2)
    assert t.choose() == (1, "least_loaded")                             # 2, 1, 1 in flight
    t.end(0)
    t.end(0)
    assert t.choose() == (0, "least_loaded")
    assert t.choose(exclude=frozenset({0})) == (1, "least_loaded")
    assert t.routed == [2, 1, 1] and t.in_flight == [0, 1, 1]


def test_affinity_follows_the_longest_known_prefix_unless_its_kernel_is_far_busier():
    t = RoutingTable(2, slack=2)
    t.remember([b"sys"], 0)
    t.remember([b"sys+q1+a1", b"sys+q1"], 1)
    assert t.choose([b"sys+q1+a1+q2", b"sys+q1+a1", b"sys+q1", b"sys"]) == (1, "affinity")
    assert t.choose([b"sys+other", b"sys"]) == (0, "affinity")
    assert t.choose([b"unknown"]) [1] == "least_loaded"
    for _ in range(3):
        t.begin(1)
    # kernel 1 has 3 in flight, kernel 0 none: beyond the slack of 2, balance instead
    assert t.choose([b"sys+q1"]) == (0, "least_loaded")
    t.end(1)
    assert t.choose([b"sys+q1"]) == (1, "affinity")                        # 2 more: within the slack
    assert t.choose([b"sys+q1"], exclude=frozenset({1})) == (0, "least_loaded")


def test_the_table_is_a_bounded_lru():
    t = RoutingTable(2, capacity=3)
    t.remember([b"a", b"b", b"c"], 0)
    assert t.choose([b"a"]) == (0, "affinity")             # a is now the most recent: b goes first
    t.remember([b"d"], 1)
    assert list(t.affinity) == [b"c", b"a", b"d"] and t.keys == [2, 1]
    t.remember([b"e", b"c"], 1)                            # c moves to kernel 1, a is dropped
    assert list(t.affinity) == [b"d", b"e", b"c"] and t.keys == [0, 3]
    assert t.choose([b"b"])[1] == "least_loaded" and len(t.affinity) == 3


def test_take_out_drops_a_kernels_keys_and_put_back_returns_it_to_rotation():
    t = RoutingTable(2)
    t.remember([b"x", b"y"], 1)
    t.remember([b"z"], 0)
    assert t.take_out(1) == 2 and t.keys == [1, 0] and list(t.affinity) == [b"z"]
    assert [t.choose([b"x"])[0] for _ in range(3)] == [0, 0, 0]
    t.remember([b"late"], 1)                                # an answer arriving from a dead kernel
    assert b"late" not in t.affinity
    with pytest.raises(PinnedKernelDown) as e:
        t.choose(pin=1)
    assert e.value.kernel == 1
    assert t.choose(pin=0) == (0, "pinned")
    t.take_out(0)
    with pytest.raises(NoKernel):
        t.choose([b"z"])
    t.put_back(1)
    assert t.choose([b"z"]) == (1, "least_loaded") and t.choose(pin=1) == (1, "pinned")


# ---------------------------------------------------------------- affinity keys
def test_a_conversations_next_turn_shares_its_keys_and_caches_do_not_mix():
    first = chat("be brief", "hello")
    k1 = request_keys(first)
    assert len(k1) == 2                                     # system; system + hello
    nxt = request_keys(chat("be brief", "hello", "hi there", "and then?"))
    assert answer_keys(first, "hi there", [])[0] == nxt[1] and nxt[2:] == k1
    assert request_keys(chat("be brief", "other"))[-1] == k1[-1]          # the system prompt is shared
    assert request_keys(chat("be brief", "hello", user="bob"))[-1] != k1[-1]   # another user's cache
    assert request_keys(chat("be brief", "hello", tools=[{"name": "f"}]))[-1] != k1[-1]
    assert request_keys(chat("be brief", "hello", cache=False)) == []
    assert len(request_keys(chat(*["m"] * 600))) == MAX_KEYS


def test_text_prompts_are_keyed_by_blocks():
    from symphony.gateway.router import TEXT_BLOCK
    cache = {"dir": "/home/a/serve-cache", "trust": []}
    doc = "x" * (2 * TEXT_BLOCK)
    a = request_keys({"mode": "text", "prompt": doc + " question one", "cache": cache})
    b = request_keys({"mode": "text", "prompt": doc + " question two", "cache": cache})
    assert len(a) == 3 and a[1:] == b[1:] and a[0] != b[0]
    cont = answer_keys({"mode": "text", "prompt": doc, "cache": cache}, " more", [])
    assert cont[1:] == a[1:]
    assert request_keys({"mode": "text", "prompt": list(range(600)), "cache": cache})[-1] == \
        request_keys({"mode": "text", "prompt": list(range(300)), "cache": cache})[-1]


# ---------------------------------------------------------------- the kernels, against fake links
class FakeSession:
    def __init__(self, lip):
        self.lip, self.kernel, self.on_close, self.on_lost = lip, None, None, None

    async def close(self):
        done, self.on_close = self.on_close, None
        if done:
            done()


class FakeLink:
    """A kernel that answers `stats` and spawns while ``up``."""

    def __init__(self, model="m"):
        self.up, self.model, self.spawned, self.refuse, self.instance = True, model, 0, None, "x"

    async def request(self, user, msg):
        if not self.up:
            raise KernelUnavailable("refused")
        return {"model": self.model, "context": 512, "instance": self.instance}

    async def start(self, user, source, args, **kw):
        if not self.up:
            raise KernelUnavailable("refused")
        if self.refuse:
            raise KernelRefused({"error": "EAGAIN", "type": self.refuse, "message": "queue full"})
        self.spawned += 1
        return FakeSession(self.spawned)


def kernels(n=2, **links):
    ks = Kernels([f"/k{i}.sock" for i in range(n)], "local")
    for k in ks:
        k.link = links.get(f"k{k.index}") or FakeLink()
    return ks


def test_a_dead_kernel_is_skipped_taken_out_and_put_back_when_it_answers(monkeypatch):
    monkeypatch.setattr(kernels_mod, "FIRST_BACKOFF_S", 0.01)

    async def main():
        ks = kernels()
        await ks.connect(1)
        assert [k.state for k in ks] == ["up", "up"] and ks.model == "m"
        s = await ks.spawn("alice", "src", [], keys=[b"p"], filename="f")
        ks.remember([b"p"], s.kernel)
        assert s.kernel.index == 0 and ks.table.in_flight == [1, 0]
        await s.close()
        await s.close()                                    # idempotent
        assert ks.table.in_flight == [0, 0]
        ks[0].link.up = False
        s = await ks.spawn("alice", "src", [], keys=[b"p"], filename="f")   # its kernel refuses: the other
        assert s.kernel.index == 1 and ks[0].state == "down" and ks.table.affinity == {}
        with pytest.raises(PinnedKernelDown):
            await ks.spawn("alice", "src", [], pin=0, filename="f")
        ks[1].link.up = False
        with pytest.raises(ApiError) as e:
            await ks.spawn("alice", "src", [], filename="f")
        assert e.value.status == 503 and e.value.code == "kernel_unavailable"
        assert "/k0.sock: down" in e.value.message and "/k1.sock: down" in e.value.message
        ks[0].link.up = True                               # the background probe finds it again
        for _ in range(200):
            if ks[0].state == "up":
                break
            await asyncio.sleep(0.01)
        assert [k.state for k in ks] == ["up", "down"] and ks.table.live == [True, False]
        assert (await ks.spawn("alice", "src", [], filename="f")).kernel.index == 0
        rows = ks.rows()
        assert [r["state"] for r in rows] == ["up", "down"] and rows[1]["error"] == "refused"
        await ks.close()
    asyncio.run(main())


def test_a_full_queue_spills_to_another_kernel_and_another_model_stays_out(monkeypatch):
    monkeypatch.setattr(kernels_mod, "FIRST_BACKOFF_S", 0.01)

    async def main():
        ks = kernels(3, k2=FakeLink(model="other"))
        await ks.connect(1)
        assert [k.state for k in ks] == ["up", "up", "wrong_model"] and ks.table.live == [True, True, False]
        ks[0].link.refuse = "QueueFull"
        s = await ks.spawn("alice", "src", [], filename="f")
        assert s.kernel.index == 1 and ks.table.in_flight == [0, 1, 0]
        ks[1].link.refuse = "QueueFull"
        with pytest.raises(KernelRefused):
            await ks.spawn("alice", "src", [], filename="f")
        assert ks.table.in_flight == [0, 1, 0]
        await ks.close()
    asyncio.run(main())


def test_a_kernel_that_restarted_between_probes_loses_its_keys():
    async def main():
        ks = kernels()
        await ks.connect(1)
        ks.remember([b"p", b"q"], ks[1])
        ks.remember([b"r"], ks[0])
        await ks.refresh()
        assert ks.table.keys == [1, 2]                     # the same instances: nothing changes
        ks[1].link.instance = "y"
        await ks.refresh()
        assert ks.table.keys == [1, 0] and ks.table.live == [True, True] and ks[1].fingerprint == "symphony-y"
        await ks.close()
    asyncio.run(main())


def test_a_request_that_finds_no_kernel_probes_them_once_before_its_503(monkeypatch):
    monkeypatch.setattr(kernels_mod, "FIRST_BACKOFF_S", 60.0)       # no background probe during the test

    async def main():
        ks = kernels(1)
        await ks.connect(1)
        ks[0].link.up = False
        with pytest.raises(ApiError):
            await ks.spawn("alice", "src", [], filename="f")
        assert ks[0].state == "down"
        ks[0].link.up = True                               # back on its socket: the next request finds it
        ks[0].probed = 0.0
        assert (await ks.spawn("alice", "src", [], filename="f")).kernel.index == 0 and ks[0].state == "up"
        await ks.close()
    asyncio.run(main())
