"""Helpers of the isolation tests (tests/security/test_isolation_*.py): one user attacks,
another (the neighbour) runs a well-behaved LIP, timed alone and during the attack.

The model is a tiny random Llama (the output text does not matter, only that
the neighbour's tokens are those it gets alone): 4 layers x 4 KV heads x 16
dims in float32, 2 KiB of KV a token, 32 KiB a 16-token page.  The rule each
test checks: the neighbour answers the same tokens, within 3x its time alone
plus a second, nothing is refused to it, and the kernel's RSS stays bounded.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from conftest import BOB_UID, KernelProc

# the well-behaved LIP: greedy decoding of a fixed prompt, one pred a token
NEIGHBOUR = '''
from symphony.lip import kv, pred, send

def main(n):
    t, out = [5, 17, 42, 7, 99, 3, 250, 11], []
    with kv.create() as f:
        for _ in range(int(n)):
            t = pred(f, t, output="argmax")
            out.append(t)
            t = [t]
    send({"tokens": out})
'''
NEIGHBOUR_PREDS = 150
SLEEPER = "import time\n\ndef main(*args):\n    time.sleep(120)\n"
SLOWDOWN, SLACK_S = 3.0, 1.0            # the neighbour may take 3x its time alone, plus a second


def tiny_model(tmp_path_factory) -> Path:
    from modelfiles import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("isomodel"), seed=7, num_hidden_layers=4,
                           num_key_value_heads=4, max_position_embeddings=4096)


def start_kernel(tmp_path_factory, name: str, *flags: str, **kw) -> KernelProc:
    """A root kernel on the tiny model (16 MiB of device KV: 512 pages), in a
    session of its own as a service would be: the test's client threads (the
    attackers' clients) are then not in its CPU scheduling group (autogroup)."""
    model = tiny_model(tmp_path_factory)
    return KernelProc(tmp_path_factory.mktemp(name), "--model", str(model), "--kv-memory-mb", "16",
                      "--token-budget", "64", *flags, session=True, **kw)


def neighbour(k: KernelProc, uid: int = BOB_UID, n: int = NEIGHBOUR_PREDS, timeout: float = 120):
    """Run the neighbour as ``uid``: (seconds from its spawn request to its exit, its tokens)."""
    t0 = time.monotonic()
    with k.client_as(uid, timeout=timeout) as c:
        c.spawn(NEIGHBOUR, [str(n)], filename="neighbour.py")
        out, last = None, None
        for ev in c.events(timeout=timeout):
            if ev["event"] == "out":
                out = ev["data"]["tokens"]
            last = ev
    assert last and last["event"] == "exit" and last["status"] == 0, last
    return time.monotonic() - t0, out


def check_neighbour(k: KernelProc, alone: tuple, label: str, uid: int = BOB_UID, n: int = NEIGHBOUR_PREDS) -> float:
    """Time the neighbour now (during an attack): same tokens as ``alone`` (its
    (seconds, tokens) alone, of ``n`` preds), within SLOWDOWN x + SLACK_S.  Returns its time."""
    t, out = neighbour(k, uid, n)
    print(f"{label}: neighbour {alone[0]:.2f} s alone, {t:.2f} s during the attack ({t / alone[0]:.1f}x)")
    assert out == alone[1], f"{label}: the neighbour's answer changed"
    assert t <= SLOWDOWN * alone[0] + SLACK_S, \
        f"{label}: the neighbour took {t:.2f} s, {t / alone[0]:.1f}x its {alone[0]:.2f} s alone"
    return t


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def in_thread(fn, *args) -> threading.Thread:
    """Run ``fn(*args)`` in a daemon thread (an attack that may block for good)."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def end_all(k: KernelProc) -> None:
    """Kill every LIP left (root may) and wait until none is live."""
    from symphony.client import KernelError
    with k.client() as root:
        for l in root.ps()["lips"]:
            try:
                root.kill(l["lip"])
            except KernelError:                                 # it ended meanwhile
                pass
        assert wait_until(lambda: root.ps()["lips"] == [], 30), root.ps()


def wait_until(cond, timeout: float = 30, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def fork_as(uid: int, fn) -> int:
    """Fork a child that runs ``fn()`` as Unix user ``uid`` and then sleeps until
    killed (it keeps whatever ``fn`` opened); returns its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            fn()
            while True:
                time.sleep(60)
        finally:
            os._exit(0)
    return pid
