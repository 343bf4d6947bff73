"""kv_lookup and kv_publish on the real kernel: typed errors for bad calls; one LIP waits for the
prefix another is computing and forks it; a writer that never finishes (or dies) holds a waiter at
most the stall bound (or not at all); a burst of serve requests with one system prompt computes
it once."""
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from conftest import REPO
from symphony.kvfs.chains import STALL_S
from symphony.programs import resolve

CHAINS = (REPO / "tests/e2e/lips/chains.py").read_text()
N = 64                                       # tokens of the chain: 4 blocks


def spawn(kernel, *args, user="cara"):
    c = kernel.client(user=user)
    lip = c.spawn(CHAINS, list(args), filename="chains.py")
    return c, lip, c.events(timeout=120)


def outs(events):
    """The LIP's messages until it exits, and its exit status."""
    got = []
    for e in events:
        if e["event"] == "out":
            got.append(e["data"])
        elif e["event"] == "exit":
            return got, e["status"]
        elif e["event"] == "stderr":
            got.append(("stderr", e["data"]))
    raise AssertionError("no exit event")


def chain_stats(kernel):
    s = kernel.client().stats()
    return {k: s[k] for k in s if k.startswith("chain_")}


def test_bad_chain_calls_are_typed_errors(kernel):
    r = kernel.run(REPO / "tests/e2e/lips/chain_errors.py")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "keys not 16 bytes: InvalidArgument EINVAL",
        "block not pages: InvalidArgument EINVAL",
        "wait too long: InvalidArgument EINVAL",
        "missing dir: NotFound ENOENT",
        "dir is a file: NotADirectory ENOTDIR",
        "bad path: InvalidPath EINVAL",
        "keys and n_keys differ: InvalidArgument EINVAL",
        "publish anonymous: InvalidArgument EINVAL",
        "publish read-only: PermissionDenied EACCES",
        "publish bad block: InvalidArgument EINVAL",
        "publish: no error",
        "claim refused: None 0",
        "no keys: None 0",
        "prompt over the keys a call takes: 0 True False",    # its first 2048 blocks claimed
        "done"], r.stdout


def running(kernel, lip) -> bool:
    return lip in [p["lip"] for p in kernel.client().ps()["lips"]]


def test_a_lookup_waits_for_the_prefix_another_lip_computes_and_forks_it(kernel):
    d = f"/home/cara/chains-{uuid.uuid4().hex[:6]}"
    w, wlip, wev = spawn(kernel, "claim-feed", d, str(N))
    assert next(wev) == {"event": "out", "data": "claimed"}
    before = chain_stats(kernel)
    r, rlip, rev = spawn(kernel, "read", d, str(N), "60")
    time.sleep(1.5)
    assert running(kernel, rlip)                                  # parked in its lookup
    w.send_input(wlip, "go")                                      # the writer computes the prefix
    (got,), status = outs(rev)
    assert status == 0 and got == {"length": N, "waited": got["waited"], "same": True, "path": None}
    assert got["waited"] >= 1.0
    assert next(wev) == {"event": "out", "data": "fed"}
    after = chain_stats(kernel)
    assert after["chain_waits"] == before["chain_waits"] + 1 and after["chain_hit_blocks"] >= before[
        "chain_hit_blocks"] + N // 16
    w.send_input(wlip, "done")
    assert outs(wev)[1] == 0


def test_a_writer_that_never_finishes_holds_waiters_at_most_the_stall_bound(kernel):
    d = f"/home/cara/chains-{uuid.uuid4().hex[:6]}"
    w, wlip, wev = spawn(kernel, "claim-hang", d, str(N))
    assert next(wev) == {"event": "out", "data": "claimed"}
    t0 = time.monotonic()
    r, rlip, rev = spawn(kernel, "read", d, str(N), "120")
    (got,), status = outs(rev)
    # it waited for the stall bound (the writer never grew the file), not for its 120 s, and then
    # computed everything itself
    assert status == 0 and got["length"] == 0 and got["same"]
    assert STALL_S - 0.5 <= got["waited"] < STALL_S + 15 and time.monotonic() - t0 < 60
    before = chain_stats(kernel)
    r, rlip, rev = spawn(kernel, "read", d, str(N), "120")      # later lookups do not wait for it at all
    (got,), status = outs(rev)
    assert status == 0 and got["length"] == 0 and got["waited"] < STALL_S
    assert chain_stats(kernel)["chain_waits"] == before["chain_waits"]
    w.kill(wlip)
    outs(wev)


def test_a_writer_that_dies_releases_its_waiters(kernel):
    d = f"/home/cara/chains-{uuid.uuid4().hex[:6]}"
    w, wlip, wev = spawn(kernel, "claim-die", d, str(N))
    assert next(wev) == {"event": "out", "data": "claimed"}
    r, rlip, rev = spawn(kernel, "read", d, str(N), "120")
    time.sleep(1.5)
    assert running(kernel, rlip)
    w.send_input(wlip, "now")
    assert outs(wev)[1] != 0                                        # the writer failed
    (got,), status = outs(rev)
    assert status == 0 and got["length"] == 0 and got["same"] and got["waited"] < STALL_S


SYSTEM = " ".join(f"Rule {i}: greet visitor number {i} politely and answer in one short sentence."
                  for i in range(55))


def test_a_burst_with_one_system_prompt_computes_it_once(kernel):
    """Four serve requests arrive together with one ~1,000-token system prompt: one computes it,
    the others wait for it and fork it."""
    serve = resolve("serve").read_text()
    cache = {"dir": f"/home/cara/serve-{uuid.uuid4().hex[:6]}", "trust": []}

    def one(i):
        req = {"mode": "chat", "max_tokens": 4, "temperature": 0, "cache": cache,
               "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]}
        with kernel.client(user="cara") as c:
            c.spawn(serve, [json.dumps(req)], filename="serve.py")
            evs = [e["data"] for e in c.events(timeout=600) if e["event"] == "out"]
        return evs[0], next(e for e in evs if e["event"] == "done")

    before = kernel.client().stats()
    with ThreadPoolExecutor(4) as pool:
        res = list(pool.map(one, range(4)))
    after = kernel.client().stats()
    L = res[0][0]["prompt_tokens"]
    cached = sorted(p["cached_tokens"] for p, _ in res)
    assert L > 1000 and cached[0] == 0 and all(c >= 1000 // 16 * 16 for c in cached[1:]), cached
    computed = after["tokens_computed"] - before["tokens_computed"]
    fed = sum(p["prompt_tokens"] - p["cached_tokens"] + d["completion_tokens"] - 1 for p, d in res)
    assert computed == fed and computed < L + 3 * (L - 1000 + 16) + 16, (computed, L)
    assert after["chain_waits"] - before["chain_waits"] == 3
