"""One gateway in front of two kernels (`symphony-gateway --kernel A --kernel B`).

Two kernels on a tiny random model, the stock serving program (with its prefix cache),
one key per user so that each kernel's `ps` says whose requests it served.  Checked: a
conversation (chat, and a /v1/responses chain) stays on one kernel and hits its prefix
cache there, the other kernel serving none of it; independent conversations spread over
both; a program naming its KV files runs where they are; a kernel killed mid-way is
taken out (a program running there ends, its pinned conversation gets a clear 503, the
rest is served by the other kernel), put back by the background probe when a kernel
answers on its socket again, and with no kernel left every request is a 503.
The routing table alone: tests/unit/gateway/test_router.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import IS_ROOT, REPO, start_kernels, stop_kernels
from .test_gateway import free_port

GATEWAY_UID = 2190                 # the uid the kernels trust as their gateway's (under a root kernel)
USERS = ("alice", "bob", "carol", "dave", "erin", "frank", "gina", "hank", "ivy", "jack", "kate")

MAKE = '''from symphony.lip import kv, send
def main(path):
    kv.create(path).close()
    send("made")
'''
USE = '''from symphony.lip import kv, send
def main(path):
    kv.open(path).close()
    send("found")
'''
WAIT = '''from symphony.lip import recv, send
def main():
    send("waiting")
    recv()
'''


def kernel_cmd(socket_path: str, model: Path) -> list[str]:
    trust = ["--gateway-uid", str(GATEWAY_UID)] if IS_ROOT else []
    return [sys.executable, "-c", "import sys; from symphony.cli import kernel_main; sys.exit(kernel_main())",
            "--socket", socket_path, "--kv-memory-mb", "192", "--model", str(model), *trust]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    from symphony.gateway.keys import add_key
    from modelfiles import write_tiny_gguf
    d = tmp_path_factory.mktemp("router")
    model = write_tiny_gguf(d, seed=1)
    trust = ["--gateway-uid", str(GATEWAY_UID)] if IS_ROOT else []
    ks = start_kernels({name: ((tmp_path_factory.mktemp(name), "--model", str(model), *trust), {})
                        for name in ("a", "b")})
    keys = d / "keys.json"
    tokens = {u: add_key(str(keys), f"{u}-key", u, rpm=100000, max_concurrent=50)[0] for u in USERS}
    port = free_port()
    log = open(d / "gateway.log", "w+")
    cmd = [sys.executable, "-m", "symphony.gateway", "--http", f"127.0.0.1:{port}", "--keys", str(keys),
           "--kernel", ks["a"].socket, "--kernel", ks["b"].socket]
    proc = subprocess.Popen(cmd + (["--run-as", str(GATEWAY_UID)] if IS_ROOT else []), stdout=log,
                            stderr=subprocess.STDOUT, env=ks["a"].env, cwd=REPO)

    class Two:
        pass
    t = Two()
    t.kernels, t.model_file, t.keys, t.url, t.proc, t.dir = ks, model, tokens, f"http://127.0.0.1:{port}", proc, d
    t.read_log = lambda: (log.flush(), Path(log.name).read_text())[1]
    t.extra = []                                        # kernels a test starts itself
    t.killed = []                                       # instances of kernels killed (their shm is left)
    try:
        deadline = time.time() + 60
        while "symphony-gateway: serving" not in t.read_log():
            assert proc.poll() is None and time.time() < deadline, t.read_log()
            time.sleep(0.1)
        assert f"for 2 kernels at {ks['a'].socket}, {ks['b'].socket}" in t.read_log()
        t.model = client(t, "alice").get("/v1/models").json()["data"][0]["id"]
        yield t
    finally:
        proc.terminate()
        proc.wait(20)
        for p in t.extra:
            p.terminate()
            p.wait(20)
        stop_kernels(ks)
        log.close()
        for name in os.listdir("/dev/shm"):             # what a killed kernel could not unlink
            if any(f"sym{i}_" in name for i in t.killed):
                os.unlink(os.path.join("/dev/shm", name))


def client(two, user: str) -> httpx.Client:
    return httpx.Client(base_url=two.url, timeout=60, headers={"Authorization": f"Bearer {two.keys[user]}"})


def oai(two, user: str):
    import openai
    return openai.OpenAI(base_url=two.url + "/v1", api_key=two.keys[user], max_retries=0, timeout=60)


def served(two, user: str) -> dict:
    """{kernel name: LIPs of ``user`` it runs or ran lately} (its own `ps`, as root), of the
    kernels still running."""
    out = {}
    for name, k in two.kernels.items():
        if k.proc.poll() is not None:
            continue
        ps = k.client().ps()
        out[name] = sum(r["user"] == user for r in ps["lips"] + ps["finished"])
    return out


def where(two, user: str) -> str:
    """The one kernel that served ``user``, checking the other served none of it."""
    counts = served(two, user)
    assert sorted(counts.values())[0] == 0 and max(counts.values()) > 0, counts
    return max(counts, key=counts.get)


def settle(two, users) -> None:
    """Wait until no LIP of ``users`` still runs (a reply can reach the client before its LIP exits)."""
    deadline = time.time() + 10
    while any(r["user"] in users for k in two.kernels.values() if k.proc.poll() is None
              for r in k.client().ps()["lips"]) and time.time() < deadline:
        time.sleep(0.05)


def lip_events(h: httpx.Client, body: dict) -> list[dict]:
    with h.stream("POST", "/v1/lips", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------- affinity
def test_a_conversation_stays_on_one_kernel_and_hits_its_prefix_cache(two):
    c = oai(two, "alice")
    msgs = [{"role": "system", "content": "You answer briefly. This is conversation one."},
            {"role": "user", "content": "Hello there."}]
    cached = []
    for turn in range(4):
        r = c.chat.completions.create(model=two.model, messages=msgs, max_tokens=4, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"And turn {turn}?"}]
    settle(two, {"alice"})
    assert sorted(served(two, "alice").values()) == [0, 4]
    assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached      # each turn reuses the last one's KV
    # a /v1/responses chain: each continuation where the response it continues was served
    with client(two, "bob") as h:
        prev = h.post("/v1/responses", json={"model": two.model, "input": "Tell me a story, conversation two.",
                                             "max_output_tokens": 4, "temperature": 0}).json()
        for _ in range(3):
            r = h.post("/v1/responses", json={"model": two.model, "input": "Go on.", "max_output_tokens": 4,
                                              "temperature": 0, "previous_response_id": prev["id"]})
            assert r.status_code == 200, r.text
            prev = r.json()
            cached.append(prev["usage"])
    settle(two, {"bob"})
    assert sorted(served(two, "bob").values()) == [0, 4], (served(two, "bob"), cached)
    # from the second continuation on, each reuses the KV of the turn before it, there
    assert all(u["input_tokens_details"]["cached_tokens"] > 0 for u in cached[5:]), cached


def test_independent_conversations_spread_over_both_kernels(two):
    users = ("carol", "dave", "erin", "frank")
    for u in users:
        with client(two, u) as h:
            msgs = [{"role": "user", "content": f"I am {u}, starting a conversation of my own."}]
            for turn in range(2):
                r = h.post("/v1/chat/completions", json={"model": two.model, "messages": msgs, "max_tokens": 3,
                                                         "temperature": 0})
                assert r.status_code == 200, r.text
                msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "More."}]
    settle(two, set(users))
    homes = [where(two, u) for u in users]                 # each conversation on one kernel...
    assert set(homes) == {"a", "b"}, homes                 # ... and the conversations on both
    with client(two, "carol") as h:
        health = httpx.get(two.url + "/health").json()
        assert health["status"] == "ok" and [k["state"] for k in health["kernels"]] == ["up", "up"]
        assert all(k["routed"] >= 4 for k in health["kernels"])
        rows = h.get("/v1/models").json()["data"][0]["kernels"]
        assert [(k["socket"], k["state"]) for k in rows] == [(two.kernels[n].socket, "up") for n in ("a", "b")]
    text = httpx.get(two.url + "/metrics").text
    for n in ("a", "b"):
        sock = two.kernels[n].socket
        assert f'symphony:kernel_live{{kernel="{sock}"}} 1.0' in text
        assert f'symphony:kernel_requests_routed_total{{kernel="{sock}",reason="affinity"}}' in text
    assert "symphony:kernel_up 2.0" in text


def test_a_program_runs_where_its_kv_files_are(two):
    path = "/home/gina/notes.kv"
    with client(two, "gina") as h:
        assert [e["event"] for e in lip_events(h, {"source": MAKE, "args": [path]})][-1] == "exit"
        holder = h.get("/v1/kv/stat", params={"path": path}).json()["kernel"]
        index = [k.socket for k in two.kernels.values()].index(holder)
        for _ in range(4):              # without kv_files, about half of these would not find the file
            events = lip_events(h, {"source": USE, "args": [path], "kv_files": [path]})
            assert events[-1]["status"] == 0 and events[1]["data"] == "found", events
            assert events[0]["lip"] % 2 == index               # the gateway's LIP id names the kernel
        names = [e["name"] for e in h.get("/v1/kv", params={"path": "/home/gina"}).json()["data"]]
        assert "notes.kv" in names
        assert h.delete("/v1/kv", params={"path": path}).json()["deleted"]
        assert h.get("/v1/kv/stat", params={"path": path}).status_code == 404


# ---------------------------------------------------------------- a kernel dies
def test_a_dead_kernel_is_taken_out_then_put_back(two):
    with client(two, "hank") as h:
        first = h.post("/v1/responses", json={"model": two.model, "input": "Remember this, conversation three.",
                                              "max_output_tokens": 4, "temperature": 0}).json()
    settle(two, {"hank"})
    victim = where(two, "hank")
    survivor = "b" if victim == "a" else "a"
    vk = two.kernels[victim]
    # chat conversations until one lives on the victim (fresh ones alternate between the kernels)
    convs = {}
    for u in ("ivy", "jack", "kate"):
        msgs = [{"role": "user", "content": f"{u} asks something."}]
        with client(two, u) as h:
            r = h.post("/v1/chat/completions", json={"model": two.model, "messages": msgs, "max_tokens": 3})
        convs[u] = msgs + [r.json()["choices"][0]["message"], {"role": "user", "content": "And?"}]
    settle(two, set(convs))
    on_victim = [u for u in convs if where(two, u) == victim]
    assert on_victim
    # a program running on the victim when it dies (its stream open in a thread)
    got: dict = {}
    started = threading.Event()

    def run_waiting():
        with client(two, "hank") as h:
            for _ in range(6):                      # until one starts on the victim
                with h.stream("POST", "/v1/lips", json={"source": WAIT}) as r:
                    events = []
                    for line in r.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        events.append(json.loads(line[6:]))
                        if events[-1]["event"] == "out":
                            if events[0]["lip"] % 2 != list(two.kernels).index(victim):
                                break               # on the survivor: closing the stream kills it
                            started.set()
                    if started.is_set():
                        got["events"] = events
                        return
    t = threading.Thread(target=run_waiting)
    t.start()
    assert started.wait(60)
    two.killed.append(vk.instance)
    vk.proc.send_signal(signal.SIGKILL)             # the kernel dies, as a crash would
    vk.proc.wait(20)
    t.join(30)
    assert got["events"][-1]["event"] == "exit" and got["events"][-1].get("lost"), got
    deadline = time.time() + 10
    while httpx.get(two.url + "/health").json()["kernels"][list(two.kernels).index(victim)]["state"] != "down":
        assert time.time() < deadline
        time.sleep(0.1)
    health = httpx.get(two.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    # the pinned conversation: a clear error naming what is gone; everything else: the survivor
    with client(two, "hank") as h:
        r = h.post("/v1/responses", json={"model": two.model, "input": "Go on.", "max_output_tokens": 4,
                                          "previous_response_id": first["id"]})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        err = r.json()["error"]
        assert err["code"] == "previous_response_unavailable" and err["param"] == "previous_response_id"
        assert vk.socket in err["message"] and first["id"] in err["message"]
        before = served(two, "hank")[survivor]
        r = h.post("/v1/responses", json={"model": two.model, "input": "A new one.", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
    for u in on_victim:                             # a chat conversation moves on (its prefix recomputed)
        with client(two, u) as h:
            r = h.post("/v1/chat/completions", json={"model": two.model, "messages": convs[u], "max_tokens": 3})
            assert r.status_code == 200, r.text
    settle(two, {"hank", *on_victim})
    assert served(two, "hank")[survivor] == before + 1
    assert f"{vk.socket}) is out of rotation" in two.read_log()
    # a kernel answers on the victim's socket again: the background probe puts it back (no /health call)
    log = open(two.dir / "restarted.log", "w")
    p = subprocess.Popen(kernel_cmd(vk.socket, two.model_file), stdout=log, stderr=subprocess.STDOUT,
                         env=vk.env, cwd=REPO)
    two.extra.append(p)
    deadline = time.time() + 90
    with client(two, "hank") as h:
        while [k["state"] for k in h.get("/v1/models").json()["data"][0]["kernels"]] != ["up", "up"]:
            assert time.time() < deadline and p.poll() is None, Path(log.name).read_text()[-2000:]
            time.sleep(0.2)
        assert "answers again: back in rotation" in two.read_log()
        r = h.post("/v1/responses", json={"model": two.model, "input": "Go on.", "max_output_tokens": 4,
                                          "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text                  # served there again, its KV computed anew
    # no kernel left: 503 for everything that needs one
    from symphony.client import Client
    with Client(vk.socket) as kc:
        two.killed += [kc.stats()["instance"], two.kernels[survivor].instance]
    for proc in (p, two.kernels[survivor].proc):
        proc.send_signal(signal.SIGKILL)
        proc.wait(20)
    with client(two, "ivy") as h:
        deadline = time.time() + 10
        while True:
            r = h.post("/v1/chat/completions", json={"model": two.model, "messages": convs["ivy"], "max_tokens": 3})
            if r.status_code == 503 or time.time() > deadline:
                break
        assert r.status_code == 503 and r.json()["error"]["code"] == "kernel_unavailable", r.text
        assert "no kernel answers" in r.json()["error"]["message"]
    health = httpx.get(two.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert [k["state"] for k in health.json()["kernels"]] == ["down", "down"]
