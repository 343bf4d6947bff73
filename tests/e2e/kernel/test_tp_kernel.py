"""symphony-kernel --tp N: the kernel is rank 0, the other ranks its worker processes.

  * the embedded model at --tp 3 writes the same greedy text as --tp 1;
  * two "nodes" over loopback (--nnodes 2, the second running
    ``symphony-kernel --worker``) write the same text as one rank;
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


def test_two_nodes_over_loopback_write_the_text_of_one(tmp_path):
    from modelfiles import write_tiny_gguf
    model = str(write_tiny_gguf(tmp_path, seed=2))
    one = KernelProc(tmp_path, "--model", model)
    try:
        want = generate(one, "hello", 12)
    finally:
        one.stop()
    port = str(_free_port())
    flags = ["--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
             "--model", model, "--tp-timeout", "30"]
    node1 = subprocess.Popen([sys.executable, "-m", "symphony.kernel", "--worker", "--node-rank", "1", *flags],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "node1.log", "w"), cwd=REPO)
    (tmp_path / "n0").mkdir()
    k = KernelProc(tmp_path / "n0", "--node-rank", "0", *flags)
    try:
        assert "tensor parallelism: 2 ranks (gloo)" in k.read_log()
        assert generate(k, "hello", 12) == want
    finally:
        assert k.stop() == 0
    assert node1.wait(20) == 0                  # node 0 told its ranks to stop


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
    assert took < 30, took
    assert "the model cannot run: tensor parallelism failed" in err or "the kernel failed" in err, err[-2000:]
    assert shm() == []
    assert gone(pids)
