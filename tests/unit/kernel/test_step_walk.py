"""The walk of one step, traced: `Stepper.step` on a syscall server built in
process (its thread not started, the step run inline), one plain step and one
under memory pressure (a LIP suspended for a more important one).

  * the step's own calls, in order, are the walk docs/design/pred-walk.md
    shows: schedule (residency, then the scheduler), KVFS prepares, the device
    runs (launch, take), KVFS commits, the replies;
  * no file calls back into a file that is still on the stack above it (the
    memory planner yields its moves; KVFS's parts do not call their facade);
  * calls go down the layers: the engine never calls KVFS, the scheduler or
    the kernel; the scheduler never calls the kernel; KVFS calls the kernel
    only through the two policies it is given in its constructor
    (``evict_first``, ``pinned``).
"""
from __future__ import annotations

import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.weights import random_weights
from symphony.ipc import schema
from symphony.ipc.kernel_side import KernelSide
from symphony.ipc.wait import WaitSet
from symphony.kernel.syscall.proc import LipProc, ServedLips
from symphony.kernel.syscall.server import SyscallServer
from symphony.kvfs import KVFS, KVFSConfig

from conftest import tiny_config

ROOT = str(Path(__import__("symphony").__file__).parent) + "/"
LAYER = {"kernel": 3, "kvfs": 2, "sched": 2, "engine": 1, "ipc": 0}
POLICIES = {"running_ids", "swap_out_first"}          # KVFS's constructor callbacks (kernel/syscall/proc.py)


def trace(fn) -> list:
    """Cross-file calls inside symphony/ while ``fn`` runs: (caller file,
    callee file, callee name, files on the stack)."""
    moves, stack = [], []

    def prof(frame, event, arg):
        if event not in ("call", "return"):
            return
        f = frame.f_code.co_filename
        if not f.startswith(ROOT):
            return
        f = f[len(ROOT):]
        if event == "call":
            if stack and stack[-1] != f:
                moves.append((stack[-1], f, frame.f_code.co_name, tuple(stack)))
            stack.append(f)
        elif stack:
            stack.pop()
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return moves


@pytest.fixture
def server():
    eng = Engine(random_weights(tiny_config(), seed=0), None, EngineConfig(page_size=4, num_pages=24))
    served = ServedLips()
    fs = KVFS(eng, KVFSConfig(host_pages=64), evict_first=served.swap_out_first, pinned=served.running_ids)
    door = WaitSet()
    srv = SyscallServer(eng, fs, door, lambda *a: None, lambda *a: None, lips=served, overlap=False)
    srv.device.start()
    lips = []
    for i in range(2):
        ring = KernelSide.create(f"symwalk{secrets.token_hex(3)}", n_slots=4, slot_bytes=4096,
                                 arena_bytes=1 << 16, waitset=door)
        lip = LipProc(id=i + 1, user=f"u{i}", filename="walk.py", args=[], ring=ring, grants={}, limits={},
                      priority=i)
        srv.add(lip)
        lips.append(lip)
    yield srv, fs, lips
    for lip in lips:
        lip.ring.unlink()
        lip.ring.close()
    door.close()


def submit(srv, lip, h, n):
    req = schema.Pred(kv=h, n_tokens=n, output="sample", temperature=0.0)
    srv.preds.pred(lip, 0, 1, req, np.arange(1, n + 1, dtype=np.int32))


def step_calls(moves) -> list:
    """The step's own calls into other files, consecutive repeats folded."""
    out = []
    for src, dst, name, _ in moves:
        if src == "kernel/syscall/step.py" and (not out or out[-1] != (dst, name)):
            out.append((dst, name))
    return out


def check_layers(moves) -> None:
    back = [(s, d, n) for s, d, n, stack in moves if d in stack]
    assert not back, f"calls back into a file on the stack: {back}"
    up = [(s, d, n) for s, d, n, _ in moves
          if LAYER[d.split("/")[0]] > LAYER[s.split("/")[0]]
          and not (s.startswith("kvfs/") and d == "kernel/syscall/proc.py" and n in POLICIES)]
    assert not up, f"calls up the layers: {up}"


def test_a_step_is_one_walk_down_the_layers(server):
    srv, fs, lips = server
    for lip in lips:
        submit(srv, lip, fs.create(lip.principal), 9)
    moves = trace(srv.stepper.step)
    check_layers(moves)
    walk = [f"{d.split('/')[-1]}:{n}" for d, n in step_calls(moves) if d != "kernel/syscall/proc.py"
            and not d.endswith("namespace.py")]
    walk = [w for i, w in enumerate(walk) if i == 0 or walk[i - 1] != w]     # a reply per call: one
    assert walk == ["residency.py:schedule", "pred.py:chunk", "fs.py:prepare", "device.py:launch",
                    "device.py:take", "batch.py:took", "fs.py:commit", "answers.py:reply"], walk
    assert all(not d.startswith(("engine/runner", "engine/model")) for s, d, _, _ in moves if s.startswith("kvfs/"))


def test_under_pressure_the_planner_yields_and_residency_makes_the_moves(server):
    srv, fs, (low, high) = server
    submit(srv, low, fs.create(low.principal), 60)        # 15 of the 23 pages
    while srv.sched.queue:
        srv.stepper.step()
    submit(srv, high, fs.create(high.principal), 40)      # 10 more: the less important LIP goes out
    moves = trace(srv.stepper.step)
    assert low.suspended and srv.residency.overload["suspensions"] == 1
    check_layers(moves)
    assert not [m for m in moves if m[0] == "sched/memory.py" and m[1].startswith("kernel/")]
    assert ("kvfs/fs.py", "suspend") in {(d, n) for s, d, n, _ in moves if s == "kernel/syscall/residency.py"}
