"""Where tensor-parallel ranks run (engine/tp/plan.py): the device each rank gets, the
three rendezvous, and every inconsistent combination of flags refused with the fix."""
from __future__ import annotations

import argparse

import pytest

from symphony.engine.args import EngineArgs
from symphony.engine.config import ConfigError
from symphony.engine.tp.plan import LaunchPlan, launch_plan

TORCHRUN = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511", "WORLD_SIZE": "4", "RANK": "3",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}


def plan(**kw) -> LaunchPlan:
    kw.setdefault("gpus", None)
    kw.setdefault("tp", None)
    return launch_plan(**kw)


def refused(match: str, **kw):
    with pytest.raises(ConfigError, match=match) as e:
        plan(**kw)
    return str(e.value)


def test_one_rank_per_gpu_named_on_one_machine():
    p = plan(gpus="0,1", cuda_count=2)
    assert (p.size, p.local, p.devices, p.init, p.device, p.spawns) == (2, 2, ("cuda:0", "cuda:1"), "file",
                                                                         "cuda:0", True)
    assert plan(gpus="3", cuda_count=4).devices == ("cuda:3",) and plan(gpus="3", cuda_count=4).size == 1
    assert plan(gpus="1,0", tp=2, cuda_count=2).devices == ("cuda:1", "cuda:0")   # --tp may repeat the count


def test_cpu_ranks_and_machines():
    assert plan().size == 1 and plan().devices == ("cpu",)
    p = plan(tp=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600)
    assert (p.size, p.local, p.first_rank, p.init) == (4, 2, 2, "tcp://10.0.0.1:29600")
    assert plan(tp=2, nnodes=2, master_addr="fe80::1").init == "tcp://[fe80::1]:29500"
    g = plan(gpus="0,1", nnodes=2, node_rank=1, master_addr="h", worker=True, cuda_count=2)
    assert (g.size, g.local, g.first_rank, g.devices) == (4, 2, 2, ("cuda:0", "cuda:1"))


def test_one_gpu_for_two_ranks_is_refused_not_an_index_error():
    msg = refused(r"--tp 2 with --gpus 0: a kernel runs one rank per GPU named, so --tp must be 1", gpus="0", tp=2)
    assert "e.g. --gpus 0,1 for --tp 2" in msg
    refused(r"so --tp must be 4", gpus="0,1", tp=2, nnodes=2, master_addr="h")


def test_more_gpus_than_ranks_is_refused_with_one_kernel_per_replica():
    msg = refused(r"--tp 2 with --gpus 0,1,2,3", gpus="0,1,2,3", tp=2)
    assert "For 2 replicas of 2 ranks, start one kernel per replica" in msg
    assert "symphony-kernel --gpus 0,1 --socket /run/symphony-0.sock" in msg
    assert "symphony-kernel --gpus 2,3 --socket /run/symphony-1.sock" in msg
    assert "symphony-gateway --kernel /run/symphony-0.sock --kernel /run/symphony-1.sock" in msg


def test_gpus_this_machine_does_not_have_are_refused():
    refused(r"--gpus 0: torch sees no CUDA device on this machine .* leave --gpus out", gpus="0", cuda_count=0)
    refused(r"--gpus: no GPU 2, 5 on this machine: torch sees 2 CUDA devices \(0, 1\)", gpus="0,2,5", cuda_count=2)
    refused(r"no GPU 1 on this machine: torch sees 1 CUDA device \(0\)", gpus="1", cuda_count=1)


@pytest.mark.parametrize("kw, match", [
    (dict(gpus="0,0"), "distinct indexes"), (dict(gpus="a"), "distinct indexes"),
    (dict(tp=0), r"--tp must be in 1..64"), (dict(tp=65), r"--tp must be in 1..64"),
    (dict(tp=3, nnodes=2, master_addr="h"), "does not split over --nnodes 2"),
    (dict(tp=2, nnodes=2), "needs --master-addr"), (dict(nnodes=2, node_rank=2, master_addr="h"), "out of range"),
    (dict(tp=2, worker=True), "--worker .* needs --nnodes 2"),
    (dict(tp=2, nnodes=2, master_addr="h", worker=True), "--node-rank must be 1 or more"),
    (dict(tp=2, nnodes=2, master_addr="h", master_port=70000), "--master-port must be in 1..65535"),
    (dict(rendezvous="slurm"), "--rendezvous must be auto or env"),
])
def test_inconsistent_flags_are_refused(kw, match):
    refused(match, **kw)


def test_a_launchers_environment_places_this_rank():
    p = plan(rendezvous="env", gpus="0,1", env=TORCHRUN, cuda_count=2)
    assert (p.size, p.rank, p.local_rank, p.local, p.node_rank, p.device, p.init, p.spawns) == \
        (4, 3, 1, 2, 1, "cuda:1", "env://", False)
    cpu = plan(rendezvous="env", env=dict(TORCHRUN, RANK="0", LOCAL_RANK="0", GROUP_RANK="0"))
    assert (cpu.rank, cpu.device, cpu.local) == (0, "cpu", 2)
    bare = {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "1"}   # a scheduler's minimum
    b = plan(rendezvous="env", env=bare)
    assert (b.rank, b.local_rank, b.node_rank) == (1, 0, 1)


@pytest.mark.parametrize("change, kw, match", [
    ({"RANK": None}, {}, r"\$RANK is not set"), ({"WORLD_SIZE": "x"}, {}, r"\$WORLD_SIZE must be an int"),
    ({"RANK": "4"}, {}, r"\$RANK must be an int in \[0, 3\]"), ({"MASTER_ADDR": ""}, {}, r"\$MASTER_ADDR"),
    ({"MASTER_PORT": "0"}, {}, r"\$MASTER_PORT must be"), ({"LOCAL_RANK": None}, {"gpus": "0,1"},
                                                           r"\$LOCAL_RANK is not set"),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, {"gpus": "0"}, r"\$LOCAL_RANK 1 has no GPU in --gpus 0"),
    ({}, {"tp": 2}, r"--tp 2 disagrees with the launcher's \$WORLD_SIZE 4"),
    ({}, {"nnodes": 2, "master_addr": "h"}, r"leave out --nnodes, --master-addr"),
    ({}, {"worker": True}, r"leave out --worker"),
])
def test_a_bad_launcher_environment_is_refused_naming_the_variable(change, kw, match):
    env = {k: v for k, v in dict(TORCHRUN, **change).items() if v is not None}
    refused(match, rendezvous="env", env=env, **kw)


def test_the_kernel_flags_reach_the_plan(monkeypatch):
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    a = EngineArgs.from_cli_args(p.parse_args(["--rendezvous", "env", "--gpus", "0,1"]))
    monkeypatch.setattr("os.environ", dict(TORCHRUN))
    assert a.launch_plan(2).rank == 3 and a.is_other_rank() and a.device() == "cuda:1"
    with pytest.raises(ConfigError, match="runs tensor-parallel ranks for another kernel"):
        a.load()
