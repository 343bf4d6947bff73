"""Overload is queued, never refused, on a real kernel.

A tiny random model whose device KV pool holds 32 pages (512 tokens) and a
host tier of 64 pages: far more work than fits.  Every LIP must finish with
the output it has alone (greedy, compared with an in-process engine on the
same weights), the kernel must suspend whole LIPs rather than fail calls,
and the pages must be back to the baseline afterwards.  On the kernel before
admission control these LIPs failed with NoSpace (the pager moved pages until the host
tier was full).
"""
from __future__ import annotations

import random
import threading
import time

import pytest

from conftest import start_kernels, stop_kernels, stopped_cleanly

POOL_PAGES = 32             # --kv-memory-mb 1 at 32 KiB a page (the config below; the kernel may keep one back)
HOST_PAGES = 64

# each LIP: a prompt of N_PROMPT random tokens, then N_GEN greedy tokens, one pred each
GREEDY = '''
import random
from symphony.lip import kv, pred, send

def main(seed, n_prompt, n_gen, chunk="0"):
    rnd = random.Random(int(seed))
    toks = [rnd.randrange(3, 262) for _ in range(int(n_prompt))]
    out = []
    with kv.create() as f:
        step = int(chunk) or len(toks)
        for i in range(0, len(toks), step):              # chunk > 0: the file grows call by call
            t = pred(f, toks[i:i + step], output="argmax")
        out.append(t)
        for _ in range(int(n_gen) - 1):
            t = pred(f, [t], output="argmax")
            out.append(t)
    send({"seed": int(seed), "tokens": out})
'''


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from modelfiles import write_tiny_gguf
    # 4 layers x 4 KV heads x 16 dims, float32: 2 KiB a token, 32 KiB a 16-token page
    return write_tiny_gguf(tmp_path_factory.mktemp("ovmodel"), seed=3, num_hidden_layers=4,
                           num_key_value_heads=4, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory, tiny_gguf):
    """The module's two kernels (``ok`` and ``quota_kernel`` below), started and stopped at once."""
    model = ("--model", str(tiny_gguf), "--kv-memory-mb", "1", "--host-pages", str(HOST_PAGES), "--token-budget", "64")
    ks = start_kernels({
        "ok": ((tmp_path_factory.mktemp("overload"), *model, "--max-lips", "80", "--max-lips-per-user", "80",
                "--max-priority", "interactive",
                "--lip-kv-tokens", "16"), {}),     # admission lets everything in: the memory manager copes
        "quota": ((tmp_path_factory.mktemp("userquota"), *model, "--user-quota", str(USER_QUOTA),
                   "--lip-kv-tokens", "80"), {})})
    yield ks
    stopped_cleanly(ks, stop_kernels(ks))


@pytest.fixture(scope="module")
def ok(kernels):
    """A kernel whose pool holds 32 pages, with a 64-page host tier and no disk.
    Admission expects 1 page a LIP, so it starts far more LIPs than fit and the
    memory manager must cope (tests/e2e/kernel/test_admission.py covers the queue)."""
    return kernels["ok"]


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """greedy(seed, n_prompt, n_gen, chunk) on an in-process engine with the same weights."""
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import Engine
    eng = Engine.load(str(tiny_gguf), EngineConfig(kv_memory_bytes=8 << 20), progress=False)

    def greedy(seed, n_prompt, n_gen, chunk=0):
        rnd = random.Random(seed)
        toks = [rnd.randrange(3, 262) for _ in range(n_prompt)]
        seq = eng.new_sequence()
        try:
            step = chunk or len(toks)
            for i in range(0, len(toks), step):
                logits = eng.pred(seq, toks[i:i + step])
            out = [int(logits.argmax())]
            for _ in range(n_gen - 1):
                out.append(int(eng.pred(seq, [out[-1]]).argmax()))
            return out
        finally:
            eng.release(seq)
    return greedy


def _run_all(k, jobs, *, priority="normal", results=None, timeout=240):
    """Spawn every job (args of GREEDY) at once, each on its own connection;
    returns {seed: (exit event, output, finish time)}."""
    results = {} if results is None else results
    clients = []
    for args, prio in jobs:
        c = k.client(timeout=timeout)
        c.spawn(GREEDY, [str(a) for a in args], filename="greedy.py", priority=prio)
        clients.append((args[0], c))
    return _collect(clients, results, timeout)


def _collect(clients, results, timeout):
    """Read each (seed, client)'s events to its LIP's exit, all at once; closes the clients.
    results[seed] = (exit event, output, finish time)."""
    def wait(seed, c):
        out, exit_ev = None, None
        for ev in c.events(timeout=timeout):
            if ev["event"] == "out":
                out = ev["data"]
            elif ev["event"] == "exit":
                exit_ev = ev
        results[seed] = (exit_ev, out, time.monotonic())
        c.close()
    threads = [threading.Thread(target=wait, args=sc) for sc in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


def _settled(k, baseline: int, timeout: float = 30) -> dict:
    deadline = time.time() + timeout
    while True:
        s = k.client().stats()
        if (s["kv_pages_used"] == baseline and s["lips"] == 0) or time.time() > deadline:
            return s
        time.sleep(0.2)


def _check(results, reference, jobs):
    bad = {seed: (ev, out) for seed, (ev, out, _) in results.items()
           if ev is None or ev["status"] != 0 or out is None}
    assert not bad, f"{len(bad)} of {len(jobs)} LIPs did not finish: {list(bad.items())[:3]}"
    for (seed, n_prompt, n_gen, *chunk), _ in jobs:
        assert results[seed][1]["tokens"] == reference(seed, n_prompt, n_gen, *map(int, chunk)), seed


def test_64_lips_on_a_pool_for_8_all_finish_as_alone(ok, reference):
    """64 LIPs of 60 tokens (4 pages each) on a 32-page pool: all finish, each
    with its own greedy output, and the pages come back."""
    base = ok.client().stats()
    jobs = [((1000 + i, 48, 12), "normal") for i in range(64)]
    results = _run_all(ok, jobs)
    _check(results, reference, jobs)
    after = _settled(ok, base["kv_pages_used"])
    assert after["kv_pages_used"] == base["kv_pages_used"], after
    assert after["suspended_lips"] == 0 and after["suspended_pages"] == 0, after
    moved = {k: after.get(k, 0) - base.get(k, 0) for k in ("suspensions", "admission_waits")}
    assert any(moved.values()), f"the pool was never short: the test proves nothing ({moved})"


def test_every_lip_keeps_asking_for_pages_no_deadlock(ok, reference):
    """8 LIPs each grow one file page by page to 12 pages (96 pages in all, 3x
    the pool and more than pool + host): no deadlock, no failure; `ps` shows
    the suspended ones meanwhile."""
    base = ok.client().stats()
    jobs = [((2000 + i, 192, 4, 16), "normal") for i in range(8)]
    seen, done = set(), threading.Event()

    def watch():
        with ok.client() as c:
            while not done.is_set():
                seen.update(l["state"] for l in c.ps()["lips"])
                time.sleep(0.02)
    w = threading.Thread(target=watch)
    w.start()
    try:
        results = _run_all(ok, jobs)
    finally:
        done.set()
        w.join()
    _check(results, reference, jobs)
    assert "suspended" in seen, seen
    after = _settled(ok, base["kv_pages_used"])
    assert after["kv_pages_used"] == base["kv_pages_used"], after
    assert after["suspensions"] > base["suspensions"]
    assert after["kv_wait_failures"] == base["kv_wait_failures"]


def test_interactive_lips_finish_first(ok, reference):
    """24 batch LIPs, then 4 interactive ones: the interactive ones take the
    device (batch LIPs are suspended for them) and finish before most."""
    jobs = [((3000 + i, 96, 160), "batch") for i in range(24)]
    results: dict = {}
    t = threading.Thread(target=_run_all, args=(ok, jobs), kwargs={"results": results})
    base = ok.client().stats()["kv_pages_used"]
    t.start()
    deadline = time.monotonic() + 1.0                 # until the batch LIPs hold the device
    while time.monotonic() < deadline and ok.client().stats()["kv_pages_used"] < base + POOL_PAGES // 2:
        time.sleep(0.02)
    inter = [((4000 + i, 96, 24), "interactive") for i in range(4)]
    t_inter = time.monotonic()
    _run_all(ok, inter, results=results)
    t.join(300)
    _check(results, reference, jobs + inter)
    # against the batch LIPs still running when the interactive ones came (how many finished
    # before depends on the machine's speed): most of them
    running = sorted(results[s][2] for (s, *_), _ in jobs if results[s][2] > t_inter)
    assert len(running) >= len(jobs) // 2, f"only {len(running)} batch LIPs were still running"
    for (s, *_), _ in inter:
        later = sum(1 for b in running if b > results[s][2])
        assert later >= len(running) // 2, \
            f"interactive LIP {s} finished after {len(running) - later} of {len(running)} running batch LIPs"


def test_pred_larger_than_the_pool_is_refused_with_numbers(ok):
    """A single pred of 600 tokens (38 pages) on a 32-page pool: NoSpace now,
    saying so with the numbers; a neighbour is unaffected."""
    src = '''
from symphony.lip import kv, pred, send
from symphony.lip.errors import SyscallError

def main():
    with kv.create() as f:
        try:
            pred(f, [5] * 600)
        except SyscallError as e:
            send({"type": type(e).__name__, "message": str(e)})
            return
    send({"type": None})
'''
    c = ok.client(timeout=60)
    c.spawn(src, [], filename="big.py")
    out = [e["data"] for e in c.events(timeout=60) if e["event"] == "out"]
    assert out and out[0]["type"] == "NoSpace", out
    msg = out[0]["message"]
    pool = ok.client().stats()["kv_pages_total"]
    assert POOL_PAGES - 2 <= pool <= POOL_PAGES
    assert f"pool holds {pool} pages" in msg and f"{38 - pool} too many" in msg, msg


def test_kv_wait_and_host_pages_flags_are_checked(capsys):
    from symphony.kernel_cli import kernel_main
    for argv, want in ((["--kv-wait", "0"], "--kv-wait must be in"), (["--host-pages", "-3"], "expected an int"),
                       (["--host-pages", "lots"], "expected an int")):
        with pytest.raises(SystemExit):
            kernel_main(argv)
        assert want in capsys.readouterr().err


# ---------------------------------------------------------------- one user's KV quota
USER_QUOTA = 12             # pages; each LIP below needs 5 (80 tokens), so two fit at a time


@pytest.fixture(scope="module")
def quota_kernel(kernels):
    """A kernel whose users may hold 12 KV pages each (the pool has 32), and which expects
    a LIP with no history to need 80 tokens (5 pages)."""
    return kernels["quota"]


GATED = GREEDY.replace("    rnd = random.Random(int(seed))", "    recv()                                      # wait for 'go'\n"
                       "    rnd = random.Random(int(seed))").replace("from symphony.lip import kv, pred, send",
                                                               "from symphony.lip import kv, pred, recv, send")


def test_a_users_lips_past_their_kv_quota_wait_for_each_other_not_fail(quota_kernel, reference):
    """Alice starts 6 LIPs expected to need 5 pages each under a 12-page user quota: two
    start, four wait in the queue saying why (before, admission ignored the quota: the third
    and later ones started and failed with QuotaExceeded).  Bob, who comes after them, starts
    at once: he is not held behind Alice's queue.  Told to go, all finish with their own
    output, never more than two of Alice's at a time.  (The LIPs wait for "go" before their
    first pred, so what starts and what waits does not depend on how fast they run.)"""
    from conftest import ALICE_UID, BOB_UID
    k = quota_kernel
    base = k.client().stats()
    jobs = [(5000 + i, 64, 16) for i in range(6)]
    seen_running, done = [], threading.Event()

    def watch():
        with k.client() as c:
            while not done.is_set():
                lips = c.ps()["lips"]
                seen_running.append(sum(1 for l in lips if l["user"] != "root" and l["state"] == "running"
                                        and l["file"] == "alice.py"))
                time.sleep(0.01)
    w = threading.Thread(target=watch)
    w.start()
    results, clients = {}, []
    try:
        replies = []
        for seed, n_prompt, n_gen in jobs:
            c = k.client_as(ALICE_UID, timeout=240)
            replies.append(c.launch(GATED, [str(seed), str(n_prompt), str(n_gen)], filename="alice.py"))
            clients.append((seed, c))
        bob = k.client_as(BOB_UID, timeout=240)
        bob_reply = bob.launch(GATED, ["6000", "64", "16"], filename="bob.py")
        clients.append((6000, bob))
        assert [r["event"] for r in replies] == ["started"] * 2 + ["queued"] * 4, replies
        assert all("'s KV quota" in r["waiting_for"] and "room for 2 more pages" in r["waiting_for"]
                   and "expected to need 5" in r["waiting_for"] for r in replies[2:]), replies
        assert bob_reply["event"] == "started", bob_reply
        rows = {l["lip"]: l for l in k.client().ps()["lips"]}
        assert "KV quota" in rows[replies[2]["lip"]]["waiting_for"]
        with k.client_as(BOB_UID) as other:            # another user: not why (it names Alice's KV use)
            seen = {l["lip"]: l for l in other.ps()["lips"]}[replies[2]["lip"]]
        assert seen["state"] == "queued" and "waiting_for" not in seen, seen
        for (_, c), r in zip(clients, replies + [bob_reply]):
            c.send_input(r["lip"], "go")                # kept for the queued ones until they start
        _collect(clients, results, 240)
    finally:
        done.set()
        w.join()
    _check(results, reference, [((s, p, g), "normal") for s, p, g in jobs + [(6000, 64, 16)]])
    assert max(seen_running) <= USER_QUOTA // 5, f"Alice ran {max(seen_running)} LIPs at once"
    after = _settled(k, base["kv_pages_used"])
    assert after["admission_waits"] - base["admission_waits"] == len(jobs) - USER_QUOTA // 5, after
