"""Where the ranks run: the launch plan the engine's flags (and a launcher's environment) describe.

    plan = launch_plan(gpus="0,1", tp=None, nnodes=1, node_rank=0, ...)   # ConfigError if inconsistent
    plan.size, plan.local, plan.devices        # 2 ranks, both here, on cuda:0 and cuda:1

Three ways to start a group of ``size`` ranks, each one rank per GPU (NCCL) or
per CPU process (gloo):

    one machine   rank 0 (the kernel) spawns the others; they meet in a file
                  in a private directory (``file://``)
    --nnodes M    node 0 runs the kernel and its ranks, each other node
                  ``symphony-kernel --worker --node-rank k``; they meet at
                  ``tcp://--master-addr:--master-port``
    --rendezvous env
                  a launcher (torchrun, a scheduler) starts every rank itself
                  and says where it is in MASTER_ADDR, MASTER_PORT, RANK,
                  WORLD_SIZE and LOCAL_RANK (``env://``); RANK 0 is the kernel

With ``--gpus``, a kernel is **one tensor-parallel group, one rank per GPU
named**: ``--gpus 0,1`` is two ranks on one machine, ``--gpus 0,1 --nnodes 2``
four over two.  So ``--tp`` may be left out, and if given must equal that
count: ``--gpus 0 --tp 2`` names one GPU for two ranks and is refused, and
``--gpus 0,1,2,3 --tp 2`` (two replicas of two ranks) is refused with the
commands that start them: one kernel per replica, behind the gateway
(docs/design/scaling.md says why).  Every index must be a CUDA device this
machine has.  Nothing here imports torch: the caller passes the device count.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ..config import ConfigError

MAX_RANKS = 64
MAX_NODES = 64
DEFAULT_MASTER_PORT = 29500
ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class LaunchPlan:
    """Where every rank of one group runs, as seen from this process."""

    size: int                        # ranks in all (1: no tensor parallelism)
    nnodes: int                      # machines
    node_rank: int                   # this machine's index (env://: GROUP_RANK, else RANK // LOCAL_WORLD_SIZE)
    local: int                       # ranks this machine runs
    devices: tuple                   # torch device of each local rank ("cpu" or "cuda:i")
    init: str                        # "file" (a private file, made at start), "tcp://HOST:PORT" or "env://"
    rank: Optional[int] = None       # env://: this process's rank; otherwise rank 0 starts its machine's others
    local_rank: int = 0              # env://: this process's index on its machine

    @property
    def spawns(self) -> bool:
        """Whether rank 0 (or ``--worker``) starts this machine's ranks itself (not a launcher)."""
        return self.init != "env://"

    @property
    def first_rank(self) -> int:
        """The global rank of this machine's first local rank (file:// and tcp://)."""
        return self.node_rank * self.local

    @property
    def device(self) -> str:
        """This process's device: rank 0's, or (env://) its own rank's."""
        return self.devices[self.local_rank if self.init == "env://" else 0]


def parse_gpus(gpus: Optional[str]) -> list[int]:
    """``--gpus`` as distinct indexes ([] without it); ConfigError if malformed."""
    if not gpus:
        return []
    ids = [g.strip() for g in gpus.split(",")]
    if not all(i.isdigit() for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus: a GPU index or distinct indexes separated by commas, got {gpus!r}")
    return [int(i) for i in ids]


def launch_plan(*, gpus: Optional[str], tp: Optional[int], nnodes: int = 1, node_rank: int = 0,
                master_addr: Optional[str] = None, master_port: Optional[int] = None,
                rendezvous: str = "auto", worker: bool = False, cuda_count: Optional[int] = None,
                env: Optional[Mapping[str, str]] = None) -> LaunchPlan:
    """The checked plan of the flags.  ``cuda_count``: CUDA devices this machine has (None:
    not checked here; `EngineConfig` still refuses CUDA where torch has none); ``env``: the
    launcher's environment (default os.environ), read only with ``rendezvous="env"``.
    ConfigError names the flag or variable that is wrong and, where one exists, the fix."""
    ids = parse_gpus(gpus)
    if tp is not None and not 1 <= tp <= MAX_RANKS:
        raise ConfigError(f"--tp must be in 1..{MAX_RANKS}, got {tp}")
    if rendezvous not in ("auto", "env"):
        raise ConfigError(f"--rendezvous must be auto or env, got {rendezvous!r}")
    _check_devices(ids, cuda_count)
    if rendezvous == "env":
        return _env_plan(ids, tp, nnodes, node_rank, master_addr, master_port, worker,
                         os.environ if env is None else env)
    if not 1 <= nnodes <= MAX_NODES or not 0 <= node_rank < nnodes:
        raise ConfigError(f"--nnodes {nnodes} / --node-rank {node_rank} out of range (1 <= --nnodes <= "
                          f"{MAX_NODES}, 0 <= --node-rank < --nnodes)")
    if nnodes > 1 and not master_addr:
        raise ConfigError("--nnodes > 1 needs --master-addr (node 0's address) and --master-port")
    if worker and nnodes < 2:
        raise ConfigError("--worker runs the ranks of another machine: it needs --nnodes 2 or more")
    if worker and node_rank < 1:
        raise ConfigError("--worker runs the ranks of another machine: --node-rank must be 1 or more")
    if ids:
        size = len(ids) * nnodes
        if tp is not None and tp != size:
            raise ConfigError(_gpu_mismatch(gpus, ids, tp, nnodes))
        devices = tuple(f"cuda:{i}" for i in ids)
    else:
        size = tp or nnodes
        if size % nnodes:
            raise ConfigError(f"--tp {size} does not split over --nnodes {nnodes}: each machine runs "
                              f"the same number of ranks")
        devices = ("cpu",) * (size // nnodes)
    port = master_port or DEFAULT_MASTER_PORT
    if not 1 <= port <= 65535:
        raise ConfigError(f"--master-port must be in 1..65535, got {port}")
    init = f"tcp://{_host(master_addr)}:{port}" if nnodes > 1 else "file"
    return LaunchPlan(size, nnodes, node_rank, len(devices), devices, init)


# ---------------------------------------------------------------- helpers
def _check_devices(ids: list[int], cuda_count: Optional[int]) -> None:
    if not ids or cuda_count is None:
        return
    if cuda_count == 0:
        raise ConfigError(f"--gpus {','.join(map(str, ids))}: torch sees no CUDA device on this machine "
                          f"(a CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES empty); leave --gpus out "
                          f"to run on the CPU")
    missing = [i for i in ids if i >= cuda_count]
    if missing:
        have = ", ".join(map(str, range(cuda_count)))
        raise ConfigError(f"--gpus: no GPU {', '.join(map(str, missing))} on this machine: torch sees "
                          f"{cuda_count} CUDA device{'s' if cuda_count > 1 else ''} ({have})")


def _gpu_mismatch(gpus: str, ids: list[int], tp: int, nnodes: int) -> str:
    count = len(ids) * nnodes
    where = "" if nnodes == 1 else f" on each of --nnodes {nnodes} machines"
    head = f"--tp {tp} with --gpus {gpus}{where}: a kernel runs one rank per GPU named, so --tp must be {count}"
    if tp < count and count % tp == 0 and len(ids) % tp == 0:
        groups = [ids[i:i + tp] for i in range(0, len(ids), tp)]
        cmds = "; ".join(f"symphony-kernel --gpus {','.join(map(str, g))} --socket /run/symphony-{n}.sock"
                         for n, g in enumerate(groups))
        socks = " ".join(f"--kernel /run/symphony-{n}.sock" for n in range(len(groups)))
        return (f"{head} (or left out). For {len(groups)} replicas of {tp} ranks, start one kernel per "
                f"replica and put the gateway in front of them: {cmds}; symphony-gateway {socks}")
    return f"{head} (or left out), e.g. --gpus {','.join(map(str, range(tp)))} for --tp {tp}"


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def _env_int(env: Mapping[str, str], name: str, lo: int, hi: int, default: Optional[int] = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise ConfigError(f"--rendezvous env: ${name} is not set (a launcher such as torchrun sets "
                          f"{', '.join(ENV_VARS)})")
    try:
        v = int(raw)
    except ValueError:
        v = lo - 1
    if not lo <= v <= hi:
        raise ConfigError(f"--rendezvous env: ${name} must be an int in [{lo}, {hi}], got {raw!r}")
    return v


def _env_plan(ids, tp, nnodes, node_rank, master_addr, master_port, worker, env) -> LaunchPlan:
    """``env://``: the launcher started this process as rank $RANK of $WORLD_SIZE."""
    given = [f for f, v in (("--nnodes", nnodes != 1), ("--node-rank", node_rank != 0),
                            ("--master-addr", master_addr), ("--master-port", master_port),
                            ("--worker", worker)) if v]
    if given:
        raise ConfigError(f"--rendezvous env takes the group's shape from the launcher's environment "
                          f"({', '.join(ENV_VARS)}): leave out {', '.join(given)}")
    size = _env_int(env, "WORLD_SIZE", 1, MAX_RANKS)
    rank = _env_int(env, "RANK", 0, size - 1)
    if not env.get("MASTER_ADDR"):
        raise ConfigError("--rendezvous env: $MASTER_ADDR is not set (rank 0's address)")
    _env_int(env, "MASTER_PORT", 1, 65535)
    local_size = _env_int(env, "LOCAL_WORLD_SIZE", 1, size, default=len(ids) or 1)
    local_rank = _env_int(env, "LOCAL_RANK", 0, local_size - 1, default=0 if len(ids) <= 1 else None)
    if tp is not None and tp != size:
        raise ConfigError(f"--tp {tp} disagrees with the launcher's $WORLD_SIZE {size} (leave --tp out)")
    if ids and local_rank >= len(ids):
        raise ConfigError(f"--rendezvous env: $LOCAL_RANK {local_rank} has no GPU in --gpus "
                          f"{','.join(map(str, ids))} (give one GPU index per rank this machine runs)")
    devices = tuple(f"cuda:{i}" for i in ids) if ids else ("cpu",) * local_size
    node = _env_int(env, "GROUP_RANK", 0, MAX_NODES - 1, default=rank // local_size)
    return LaunchPlan(size, max(1, size // local_size), node, local_size, devices, "env://", rank, local_rank)
