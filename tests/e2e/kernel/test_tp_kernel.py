"""symphony-kernel --tp N: the kernel is rank 0, the other ranks its worker processes.

  * the embedded model at --tp 3 writes the same greedy text as --tp 1;
  * two "nodes" over loopback (--nnodes 2, the second running
    ``symphony-kernel --worker``) write the same text as one rank; a node
    started with another KV pool is refused, naming the node and the field;
  * ranks a launcher starts (``--rendezvous env``: torchrun itself, and a
    scheduler's bare environment) write the same text; a rank killed while
    the kernel is idle is found by the heartbeat and the kernel shuts down;
  * a size that cannot split the model is refused before any loading, with
    the sizes that work;
  * a rank killed, and a rank hung (the collective times out), each shut the
    kernel down loudly within a bounded time: the LIP is told why, its
    shared memory is unlinked, no rank is left behind.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, KernelProc, cpu_kernel_only

pytestmark = cpu_kernel_only


def generate(k: KernelProc, prompt: str, n: int = 16) -> str:
    r = k.run("generate", prompt, str(n), timeout=240)
    assert r.returncode == 0, r.stderr
    return r.stdout


def rank_pids(k: KernelProc) -> list[int]:
    return [int(line.split("pid ")[1].split()[0]) for line in k.read_log().splitlines()
            if "tensor-parallel rank" in line and " pid " in line]


def gone(pids) -> bool:
    for p in pids:
        try:
            os.kill(p, 0)
            return False
        except ProcessLookupError:
            pass
    return True


def test_three_ranks_write_the_text_of_one(tmp_path, kernel):
    want = generate(kernel, "The capital of France is")
    k = KernelProc(tmp_path, "--tp", "3")
    try:
        assert "tensor parallelism: 3 ranks (gloo)" in k.read_log()
        pids = rank_pids(k)
        assert len(pids) == 2
        assert generate(k, "The capital of France is") == want
    finally:
        assert k.stop() == 0
    deadline = time.time() + 15
    while not gone(pids) and time.time() < deadline:
        time.sleep(0.2)
    assert gone(pids)


def test_a_size_that_does_not_split_is_refused_with_those_that_do(tmp_path):
    r = subprocess.run([sys.executable, "-m", "symphony.kernel", "--tp", "2", "--socket", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2
    assert "9 query heads do not split into 2; sizes that work: 1, 3" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a tiny GGUF model, the text one rank writes with it)."""
    from modelfiles import write_tiny_gguf
    tmp = tmp_path_factory.mktemp("tiny")
    model = str(write_tiny_gguf(tmp, seed=2))
    one = KernelProc(tmp, "--model", model)
    try:
        return model, generate(one, "hello", 12)
    finally:
        one.stop()


def _node1(tmp_path, flags, *extra):
    return subprocess.Popen([sys.executable, "-m", "symphony.kernel", "--worker", "--node-rank", "1", *flags, *extra],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "node1.log", "w"), cwd=REPO)


def test_two_nodes_over_loopback_write_the_text_of_one(tmp_path, tiny):
    model, want = tiny
    flags = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             "--model", model, "--tp-timeout", "30"]
    node1 = _node1(tmp_path, flags, "--kv-memory-mb", "192")        # node 0's pool (KernelProc gives 192)
    (tmp_path / "n0").mkdir()
    k = KernelProc(tmp_path / "n0", "--node-rank", "0", *flags)
    try:
        assert "tensor parallelism: 2 ranks (gloo)" in k.read_log()
        assert generate(k, "hello", 12) == want
    finally:
        assert k.stop() == 0
    assert node1.wait(20) == 0                  # node 0 told its ranks to stop


def test_a_node_started_with_another_pool_is_refused_naming_node_and_field(tmp_path, tiny):
    model, _ = tiny
    flags = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
             "--model", model, "--tp-timeout", "30"]
    node1 = _node1(tmp_path, flags, "--kv-memory-mb", "64")
    (tmp_path / "n0").mkdir()
    with pytest.raises(RuntimeError, match="kernel died at start") as e:
        KernelProc(tmp_path / "n0", "--node-rank", "0", *flags)
    assert "the nodes disagree on the KV pool's memory: node 1 (host " in str(e.value)
    assert "rank 1) has 64 MiB, node 0 (host" in str(e.value) and "has 192 MiB" in str(e.value)
    assert node1.wait(30) == 2
    assert "the nodes disagree on the KV pool's memory" in (tmp_path / "node1.log").read_text()


def _launcher_env(port: int, rank: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}


def test_ranks_a_scheduler_starts_serve_and_an_idle_rank_lost_stops_the_kernel(tmp_path, tiny):
    """A scheduler's environment alone (no torchrun): RANK 1 is a plain process; killed while
    the kernel is idle, the heartbeat finds it and the kernel shuts down loudly."""
    model, want = tiny
    port = _free_port()
    flags = ["--rendezvous", "env", "--model", model, "--tp-timeout", "5"]
    r1 = subprocess.Popen([sys.executable, "-m", "symphony.kernel", *flags, "--kv-memory-mb", "192"],
                          env=dict(os.environ, PYTHONPATH=str(REPO), **_launcher_env(port, 1)),
                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / "rank1.log", "w"), cwd=REPO)
    try:
        k = KernelProc(tmp_path, *flags, env=_launcher_env(port, 0))
        assert "tensor parallelism: 2 ranks (gloo)" in k.read_log() and rank_pids(k) == []   # it spawned none
        assert generate(k, "hello", 12) == want
        t0 = time.time()
        os.kill(r1.pid, signal.SIGKILL)
        code = k.proc.wait(30)
        took = time.time() - t0
        log = k.read_log()
        k.stop()
    finally:
        if r1.poll() is None:
            r1.kill()
    assert code != 0 and "FATAL" in log and "heartbeat" in log, log[-3000:]
    assert took < 20, took


def test_torchrun_starts_the_kernel_and_its_rank(tmp_path, tiny):
    model, want = tiny
    sock_dir = tmp_path / "s"
    sock_dir.mkdir()
    sock = str(sock_dir / "k.sock")
    env = dict(os.environ, PYTHONPATH=str(REPO), SYMPHONY_SOCKET=sock)
    logf = open(tmp_path / "torchrun.log", "w+")
    run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "symphony.kernel",
                            "--rendezvous", "env", "--model", model, "--kv-memory-mb", "192", "--socket", sock],
                           env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.time() + 180
        while "ready on" not in (tmp_path / "torchrun.log").read_text():
            assert run.poll() is None and time.time() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.3)
        r = subprocess.run([sys.executable, "-m", "symphony.cli", "run", "generate", "hello", "12"],
                           capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
        assert r.returncode == 0 and r.stdout == want, r.stderr
        from symphony.client import Client
        with Client(sock) as c:
            c.shutdown()                        # the kernel stops; it tells its rank to stop
        assert run.wait(60) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    assert "tensor parallelism: 2 ranks (gloo)" in (tmp_path / "torchrun.log").read_text()


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_rank_shuts_the_kernel_down_loudly(tmp_path, fault):
    from modelfiles import write_tiny_gguf
    model = str(write_tiny_gguf(tmp_path, seed=2))
    env = {"SYMPHONY_TP_TEST_HANG": "1:3"} if fault == "hung" else {}
    k = KernelProc(tmp_path, "--model", model, "--tp", "2", "--tp-timeout", "5", env=env)
    pids = rank_pids(k)
    shm = k.shm_names
    lip = subprocess.Popen([sys.executable, "-m", "symphony.cli", "run", "generate", "hello", "2000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=k.env, cwd=REPO)
    try:
        time.sleep(1.0)
        t0 = time.time()
        if fault == "killed":
            os.kill(pids[0], signal.SIGKILL)
        code = k.proc.wait(60)                  # bounded: the watchdog, or the 5 s collective timeout
        took = time.time() - t0
        out, err = lip.communicate(timeout=30)
    finally:
        if lip.poll() is None:
            lip.kill()
        log = k.read_log()
        k.stop()
    assert code != 0 and "FATAL" in log and "tensor parallel" in log.replace("-", " "), log[-3000:]
    if fault == "hung":                         # the collective watch found it, not only gloo's timeout
        assert "did not finish within 5 s (--tp-timeout" in log, log[-3000:]
    else:
        assert "tensor-parallel rank 1 (pid" in log and "exited with status -9" in log, log[-3000:]
    assert took < 30, took
    assert "the model cannot run: tensor parallelism failed" in err or "the kernel failed" in err, err[-2000:]
    assert shm() == []
    assert gone(pids)
