"""The tensor-parallel group's failure handling (engine/tp/group.py, agree.py), on the CPU.

Real two-rank gloo groups in subprocesses (tp_ranks.py): settings that disagree are refused
on both ranks naming the node and the field; a rank killed while the kernel is idle is found
by the heartbeat; an all-reduce a rank never joins is found by the collective watch before
gloo's own timeout.  Without GPUs: the order in which a GPU rank binds its device and sets
NCCL's error handling before the process group starts (torch.cuda and init_process_group
recorded, not run), and the watch alone on a call that never returns."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from symphony.engine.tp import agree, group
from symphony.engine.tp.group import CollectiveWatch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def ranks(tmp_path, scenario: str):
    init = f"file://{tmp_path / 'rdv'}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return [subprocess.Popen([sys.executable, str(HERE / "tp_ranks.py"), scenario, str(r), init], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]


def lines(p) -> list[dict]:
    out, err = p.communicate(timeout=60)
    got = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert got, err[-2000:]
    return got


def test_a_node_started_with_another_pool_is_refused_on_every_rank_naming_node_and_field(tmp_path):
    ps = ranks(tmp_path, "mismatch")
    msgs = [lines(p)[0]["mismatch"] for p in ps]
    assert msgs[0] == msgs[1]
    assert "the nodes disagree on the KV pool's memory: node 1 (host " in msgs[0]
    assert "rank 1) has 32 MiB, node 0 (host" in msgs[0] and "has 64 MiB" in msgs[0]
    assert "start every node with the same --kv-memory-mb" in msgs[0]
    assert [p.returncode for p in ps] == [2, 2]


def test_ranks_leaving_at_different_times_end_the_heartbeat_together_and_exit_cleanly(tmp_path):
    # A rank that stopped beating on its own would leave the other blocked in a heartbeat
    # round; tearing the group down under it aborts that process (SIGABRT from gloo).
    r0, r1 = ranks(tmp_path, "close")
    out = lines(r0)[-1]
    assert out["broken"] is None and out["heart_alive"] is False, out
    r1.communicate(timeout=30)
    assert (r0.returncode, r1.returncode) == (0, 0), r0.stderr.read() if r0.stderr else ""


def test_a_rank_killed_while_idle_is_found_by_the_heartbeat(tmp_path):
    r0, r1 = ranks(tmp_path, "idle_kill")
    assert json.loads(r1.stdout.readline())["joined"]
    os.kill(r1.pid, signal.SIGKILL)
    r1.wait(10)
    out = lines(r0)[-1]
    assert "the heartbeat of rank 0 of 2 failed" in out["broken"], out
    assert out["after_s"] < 2 + 2 * group.HEARTBEAT_S + 10, out      # within the timeout, not at gloo's leisure


def test_a_collective_a_rank_never_joins_is_found_by_the_watch_first(tmp_path):
    r0, r1 = ranks(tmp_path, "hang")
    try:
        out = lines(r0)[-1]
    finally:
        r1.kill()
        r1.wait(10)
    assert out["first"].startswith("tensor parallelism failed: an all-reduce on rank 0 of 2 did not finish within 2 s")
    assert out["broken"] == out["first"]                 # the watch's reason stands
    assert out["raised"] is not None                     # and the call itself was freed by gloo's timeout
    assert 2 <= out["after_s"] < 2 + group.BACKEND_MARGIN_S + 8, out


def test_the_watch_fires_once_on_a_call_that_never_returns():
    fired, release = [], threading.Event()
    w = CollectiveWatch(0.3, lambda what, s: fired.append((what, s)), tick_s=0.05)

    def stuck():
        with w.busy("a stuck call"):
            release.wait(5)
    t = threading.Thread(target=stuck)
    t.start()
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    release.set()
    t.join(5)
    w.stop()
    assert len(fired) == 1 and fired[0][0] == "a stuck call" and fired[0][1] >= 0.3
    quiet = []
    w2 = CollectiveWatch(0.3, lambda *a: quiet.append(a), tick_s=0.05)
    for _ in range(5):
        with w2.busy("quick"):
            time.sleep(0.1)
    time.sleep(0.4)
    w2.stop()
    assert quiet == []                                   # calls that finish in time never fire it


def test_a_gpu_rank_binds_its_device_and_nccl_error_handling_before_the_group(monkeypatch):
    """No GPU here: record what TPGroup asks of torch.cuda and torch.distributed, in order."""
    calls = []
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))

    def init(backend, **kw):
        calls.append(("init", backend, str(kw.get("device_id")), os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                      kw["timeout"].total_seconds()))
        raise RuntimeError("stop here")
    monkeypatch.setattr(group.dist, "init_process_group", init)
    with pytest.raises(RuntimeError, match="stop here"):
        group.TPGroup(1, 2, "file:///nonexistent", "nccl", 30.0, torch.device("cuda:3"))
    assert calls == [("set_device", "cuda:3"), ("init", "nccl", "cuda:3", "2", 30.0 + group.BACKEND_MARGIN_S)]
    with pytest.raises(ValueError, match="needs an indexed GPU"):
        group.bind_device("nccl", torch.device("cuda"))
    assert group.bind_device("gloo", torch.device("cpu")) == {}


def test_disagreements_are_reported_in_field_order_and_the_same_everywhere():
    base = agree.record(node=0, rank=0, model="aa" * 32, engine={"dtype": "float32", "page_size": 16},
                        activations="auto", size=2, timeout_s=60)
    other = dict(base, node=1, rank=1, model="bb" * 32, engine={"dtype": "bfloat16", "page_size": 8})
    assert agree.disagreement([base, dict(base, node=1, rank=1)]) is None
    why = agree.disagreement([base, other])
    assert "on the model file's content (SHA-256): node 1" in why and "--model: the same file" in why
    assert "has sha256 bbbbbbbbbbbbbbbb..." in why
    assert "the dtype" in agree.disagreement([base, dict(other, model=base["model"])])
    assert "rank 1's settings record cannot be read" in agree.disagreement([base, None])


def test_the_model_digest_is_the_files_sha256_tree_and_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMPHONY_BUILD_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(agree, "PIECE", 1000)
    f = tmp_path / "m.gguf"
    f.write_bytes(bytes(range(256)) * 20)                # 5,120 bytes: 6 pieces
    d1 = agree.model_digest(f)
    assert agree.model_digest(f) == d1 and (tmp_path / "cache" / "model-digests.json").exists()
    f.write_bytes(bytes(range(256)) * 19 + bytes(255 - i for i in range(256)))
    assert agree.model_digest(f) != d1                   # new content (and mtime): hashed again
    d = tmp_path / "hf"
    d.mkdir()
    (d / "a.safetensors").write_bytes(b"x" * 10)
    (d / "config.json").write_text("{}")
    dd = agree.model_digest(d)
    (d / "config.json").write_text('{"a": 1}')
    assert agree.model_digest(d) != dd
