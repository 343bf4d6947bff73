"""The kernel with its forward pass on a device thread (kernel/syscall/device.py), on a simulated
device (engine/sim.py) whose steps take a set time: the same greedy tokens as the serial kernel
and the in-process engine; calls that need no forward pass answered during a long step; calls
that change KV files held until the step is back; a bad call, a killed LIP, a failing step and a
shutdown in the middle of a step lose nothing and leak no page."""
import signal
import threading
import time

import pytest
import torch

from conftest import KernelProc

FAST = "sim:step_ms=1,call_us=0,token_us=0,kv_ns=0"

DECODE = r'''
import json
from symphony.lip import kv, pred, send

def main(ids_json, steps):
    with kv.create() as f:
        t = pred(f, json.loads(ids_json), output="argmax")
        toks = [t]
        for _ in range(int(steps)):
            t = pred(f, [t], output="argmax")
            toks.append(t)
    send({"tokens": toks})
'''

NOPS = r'''
import time
from symphony.ipc import abi
from symphony.lip import recv, send
from symphony.lip.runtime import _sys

def main(n):
    send("ready")
    recv()
    ns = []
    for _ in range(int(n)):
        t0 = time.perf_counter()
        _sys(abi.NOP)
        ns.append(time.perf_counter() - t0)
    send({"max_s": max(ns), "n": len(ns)})
'''

SLOW_DECODER = r'''
from symphony.lip import kv, pred, send

def main(steps):
    with kv.create() as f:
        t = pred(f, [11, 12, 13], output="argmax")
        send("ready")
        for _ in range(int(steps)):
            t = pred(f, [t], output="argmax")
    send("done")
'''

FORK_DURING_STEP = r'''
import threading, time
from symphony.lip import kv, pred, send

def main():
    f = kv.create()
    pred(f, [11, 12, 13], output="argmax")            # length 3
    got = {}

    def step():
        got["pred"] = (time.perf_counter(), pred(f, [14], output="argmax"))
    t = threading.Thread(target=step)
    t.start()
    time.sleep(0.1)                                     # the pred's step is on the device now
    g = f.fork()                                        # waits for it: the device writes f's page
    got["fork"] = (time.perf_counter(), len(g))
    t.join()
    send({"fork_len": got["fork"][1], "fork_after_pred": got["fork"][0] >= got["pred"][0]})
'''


def run_lip(k, source, args, timeout=60, user=None):
    with k.client(user=user, timeout=timeout) as c:
        lip = c.spawn(source, list(args), filename="t.py")
        out, last = [], None
        for ev in c.events(timeout=timeout):
            if ev["event"] == "out":
                out.append(ev["data"])
            last = ev
    assert last and last["event"] == "exit" and last["status"] == 0, (last, out)
    return lip, out


def run_many(k, source, arg_lists, timeout=120):
    results = [None] * len(arg_lists)

    def one(i):
        results[i] = run_lip(k, source, arg_lists[i], timeout)[1]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(arg_lists))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert all(r is not None for r in results)
    return results


def settle(k, pages: int, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = k.client().stats()
        if st["lips"] == 0 and st["kv_pages_used"] == pages:
            return st
        time.sleep(0.1)
    raise AssertionError(f"not settled: {k.client().stats()}")


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    """A simulated-device kernel overlapped (the default) and one with --serial-steps."""
    ks = [KernelProc(tmp_path_factory.mktemp("simk"), "--device", FAST, "--test-hooks"),
          KernelProc(tmp_path_factory.mktemp("simserial"), "--device", FAST, "--serial-steps")]
    yield ks
    for k in ks:
        k.stop()
        assert k.proc.returncode == 0, k.read_log()[-3000:]
        assert k.shm_names() == []


def test_greedy_tokens_equal_the_serial_kernel_and_the_in_process_engine(sims):
    import json
    from symphony.engine.config import EngineConfig
    from symphony.engine.engine import PredRequest
    from symphony.engine.runner import Want
    from symphony.engine.sim import SimEngine, SimProfile
    prompts = [[11 + i, 12, 13 + 2 * i, 14] for i in range(6)]
    args = [[json.dumps(p), "12"] for p in prompts]
    overlapped, serial = (run_many(k, DECODE, args) for k in sims)
    eng = SimEngine.load(config=EngineConfig(num_pages=64, dtype=torch.bfloat16), profile=SimProfile("f", 0., 0., 0., 0.))
    seqs = [eng.new_sequence() for _ in prompts]
    argmax = Want("argmax")
    toks = [[int(o)] for o in eng.pred_batch([PredRequest(s, p, want=argmax) for s, p in zip(seqs, prompts)])]
    for _ in range(12):
        outs = eng.pred_batch([PredRequest(s, [t[-1]], want=argmax) for s, t in zip(seqs, toks)])
        for t, o in zip(toks, outs):
            t.append(int(o))
    assert [o[0]["tokens"] for o in overlapped] == [o[0]["tokens"] for o in serial] == toks


def test_a_bad_call_fails_alone(sims):
    k = sims[0]
    bad = r'''
from symphony.lip import errors, kv, pred, send
def main():
    f = kv.create()
    pred(f, [3, 4], output="argmax")
    try:
        pred(f, [10 ** 6], output="argmax")
    except errors.SyscallError as e:
        send(type(e).__name__)
    send(len(f))
'''
    box = {}
    t = threading.Thread(target=lambda: box.update(out=run_lip(k, bad, [])[1]))
    t.start()                                       # beside three decoders: its calls share their steps
    results = run_many(k, DECODE, [["[11, 12, 13]", "30"]] * 3)
    t.join(60)
    assert all(len(r[0]["tokens"]) == 31 for r in results)
    assert box["out"][0] in ("PredError", "InvalidArgument") and box["out"][1] == 2   # its file as it was


def test_a_failing_step_answers_its_calls_with_the_error_and_leaks_nothing(sims):
    k = sims[0]
    base = k.client().stats()["kv_pages_used"]
    lip_src = r'''
from symphony.lip import errors, kv, pred, recv, send
def main():
    f = kv.create()
    pred(f, [3, 4], output="argmax")
    send("ready")
    recv()
    try:
        pred(f, [5], output="argmax")
        send("no error")
    except errors.SyscallError as e:
        send(f"{type(e).__name__}: {e}")
    send(len(f))
    send(pred(f, [5], output="argmax") >= 0)
'''
    with k.client(timeout=60) as c:
        lip = c.spawn(lip_src, [], filename="t.py")
        events = c.events(timeout=60)
        assert next(e for e in events if e["event"] == "out")["data"] == "ready"
        k.client().request({"op": "test_hook", "hook": "step_fault"})
        time.sleep(0.2)
        c.send_input(lip, "go")
        outs = [e["data"] for e in events if e["event"] == "out"]
    assert "injected step fault" in outs[0] and outs[1] == 2 and outs[2] is True, outs
    settle(k, base)


def test_a_call_that_needs_no_forward_pass_is_answered_during_a_long_step(tmp_path):
    k = KernelProc(tmp_path, "--device", "sim:step_ms=500,call_us=0,token_us=0,kv_ns=0")
    try:
        with k.client(timeout=60) as dc, k.client(timeout=60) as pc:
            dec = dc.spawn(SLOW_DECODER, ["20"], filename="slow.py")
            dev = dc.events(timeout=60)
            assert next(e for e in dev if e["event"] == "out")["data"] == "ready"
            probe = pc.spawn(NOPS, ["50"], filename="nops.py")
            pev = pc.events(timeout=60)
            assert next(e for e in pev if e["event"] == "out")["data"] == "ready"
            pc.send_input(probe, "go")
            res = next(e for e in pev if e["event"] == "out")["data"]
            dc.kill(dec)
        assert res["n"] == 50
        assert res["max_s"] < 0.25, res           # a step takes 500 ms; no NOP waited for one
        st = k.client().stats()
        assert st["max_batch"] >= 1 and st["host"]["handle"] >= 50
    finally:
        k.stop()
    assert k.proc.returncode == 0


def test_a_call_that_changes_a_file_waits_for_the_step_in_flight(tmp_path):
    k = KernelProc(tmp_path, "--device", "sim:step_ms=400,call_us=0,token_us=0,kv_ns=0")
    try:
        _, out = run_lip(k, FORK_DURING_STEP, [])
        assert out[0] == {"fork_len": 4, "fork_after_pred": True}   # the fork has the pred's token
        assert k.client().stats()["host"]["deferred"] >= 1
    finally:
        k.stop()
    assert k.proc.returncode == 0


def test_a_lip_killed_mid_step_and_a_shutdown_mid_step_lose_nothing(tmp_path):
    k = KernelProc(tmp_path, "--device", "sim:step_ms=300,call_us=0,token_us=0,kv_ns=0")
    try:
        base = k.client().stats()["kv_pages_used"]
        with k.client(timeout=60) as c:
            lip = c.spawn(SLOW_DECODER, ["50"], filename="slow.py")
            events = c.events(timeout=60)
            assert next(e for e in events if e["event"] == "out")["data"] == "ready"
            time.sleep(0.45)                       # the middle of its second decode step
            c.kill(lip)
            assert [e for e in events if e["event"] == "exit"][0]["reason"].startswith("killed")
        settle(k, base)
        _, out = run_lip(k, DECODE, ["[5, 6]", "2"])        # the kernel goes on
        assert len(out[0]["tokens"]) == 3
        # a shutdown while a step is on the device: the step comes back, the kernel stops cleanly
        c = k.client(timeout=60)
        c.spawn(SLOW_DECODER, ["50"], filename="slow.py")
        events = c.events(timeout=60)
        assert next(e for e in events if e["event"] == "out")["data"] == "ready"
        time.sleep(0.15)
        t0 = time.monotonic()
        k.proc.send_signal(signal.SIGTERM)
        assert k.proc.wait(20) == 0
        assert time.monotonic() - t0 < 10
        c.close()
    finally:
        k.stop()
    assert k.shm_names() == [], "shared memory left behind"
