"""Rank 0's side of tensor parallelism: start the other ranks, join the group, watch them.

    tp = TensorParallel.start(model_path, engine_config, size=3)   # spawns ranks 1, 2
    engine = Engine.load(model_path, engine_config, tp=tp)         # rank 0's shard; KV on every rank
    ...
    tp.dead()        # why a rank is gone, or None (the kernel's watchdog asks twice a second)
    engine.close()   # STOP to every rank, then wait for them (killed after a grace period)

Where the ranks run is a `plan.LaunchPlan`: on one machine rank 0 spawns the
others and they meet through a file in a private directory (``file://``);
across machines through torch.distributed's TCP rendezvous
(``--master-addr``/``--master-port``, ``--nnodes``/``--node-rank``, as
torchrun names them), the other hosts running ``symphony-kernel --worker``
(`run_node`); or a launcher (torchrun, a scheduler) starts every rank and
says where it is in the environment (``env://``; `serve_env_rank` runs a rank
other than 0 in the launched process itself).  Each rank computes with
``threads`` CPU threads (default: the cores divided by the local ranks), or
on its own GPU.  Before the first step every rank's settings are checked
against rank 0's (agree.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional


from ..config import ConfigError, EngineConfig, ModelConfig
from .engine_json import config_from_json, config_json
from .group import TPFailure, TPGroup
from .plan import LaunchPlan
from .shard import Shard

log = logging.getLogger("symphony.tp")

START_TIMEOUT_S = 300.0


class TensorParallel:
    """The group as rank 0 holds it: ``group``, this rank's ``shard``, the whole
    model's ``model`` config, and the local worker processes."""

    def __init__(self, group: TPGroup, model: ModelConfig, procs: list, tmp: Optional[str]):
        self.group, self.model, self.procs, self._tmp = group, model, procs, tmp
        self.shard = Shard(0, group.size)
        self.threads = 1                     # CPU threads each rank computes with (rank 0: its syscall thread)

    @property
    def size(self) -> int:
        return self.group.size

    @classmethod
    def start(cls, path, config: EngineConfig, size: int, model: ModelConfig, *,
              threads: Optional[int] = None, timeout_s: float = 60.0, devices: Optional[list[str]] = None,
              activations: str = "auto", master: Optional[str] = None, nnodes: int = 1,
              plan: Optional[LaunchPlan] = None) -> "TensorParallel":
        """Join the group as rank 0, first spawning this machine's other ranks unless a
        launcher started them (``plan``, default: ``size`` ranks over ``nnodes``
        machines on ``devices``, meeting at ``master`` "host:port" when ``nnodes`` > 1;
        the other machines' ranks join from their own ``symphony-kernel --worker``).
        ``model``: the whole model's config, read from the file.  TPFailure if a rank
        cannot start; agree.TPMismatch if the ranks' settings disagree."""
        from .agree import model_digest, record
        if plan is None:
            local = size // max(1, nnodes)
            plan = LaunchPlan(size, nnodes, 0, local, tuple(devices or ["cpu"] * local),
                              f"tcp://{master}" if master else "file")
        num_pages = _checked_pages(path, config, plan.size, model, plan.nnodes)
        digest = model_digest(path)
        tmp = None
        init = plan.init
        if init == "file":
            tmp = tempfile.mkdtemp(prefix="symphony-tp-")
            init = f"file://{Path(tmp) / 'rendezvous'}"
        cfg_text = config_json(config, num_pages)
        threads = threads or max(1, (os.cpu_count() or 1) // plan.local)
        rank0 = record(node=plan.node_rank, rank=0, model=digest, engine=json.loads(cfg_text),
                       activations=activations, size=plan.size, timeout_s=timeout_s)
        procs = []
        try:
            if plan.spawns:
                procs = [_spawn(path, r, plan.size, init, cfg_text, plan.devices[r], threads, timeout_s,
                                activations, digest, plan.node_rank) for r in range(1, plan.local)]
            group = _join(0, plan.size, init, _backend(config), timeout_s, config.torch_device, procs, rank0)
        except BaseException:
            for p in procs:
                p.kill()
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("tensor parallelism: %d ranks (%s), %d KV pages on every rank, %d CPU threads a rank",
                 plan.size, group.backend, num_pages, threads)
        tp = cls(group, model, procs, tmp)
        tp.threads = threads
        return tp

    def dead(self) -> Optional[str]:
        """Why a rank is gone (a local one exited, or the group broke: a collective
        failed or hung, the heartbeat stopped), or None while all run."""
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                return f"tensor-parallel rank {r} (pid {p.pid}) exited with status {code}"
        return self.group.broken

    def close(self, grace_s: float = 10.0) -> None:
        """Wait for the ranks (told STOP by the pool's close), killing any still there after
        ``grace_s`` (at once when the group is broken: a hung rank never stops)."""
        deadline = time.monotonic() + (0.0 if self.group.broken else grace_s)
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank (pid %d) did not stop: killed", p.pid)
                p.kill()
                p.wait()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


def run_node(path, config: EngineConfig, plan: LaunchPlan, timeout_s: float, activations: str) -> int:
    """Run the ranks of machine ``plan.node_rank`` (``symphony-kernel --worker``): each a
    worker process, until node 0's kernel stops them.  The first non-zero exit status, else 0."""
    from ..loader import read_model_config
    from .agree import model_digest
    cfg_text = config_json(config, _checked_pages(path, config, plan.size, read_model_config(path), plan.nnodes))
    digest = model_digest(path)
    threads = max(1, (os.cpu_count() or 1) // plan.local)
    procs = [_spawn(path, plan.first_rank + i, plan.size, plan.init, cfg_text, plan.devices[i], threads,
                    timeout_s, activations, digest, plan.node_rank) for i in range(plan.local)]
    status = 0
    for p in procs:
        code = p.wait()
        status = status or code
    return status


def serve_env_rank(path, config: EngineConfig, plan: LaunchPlan, timeout_s: float, activations: str) -> int:
    """A rank other than 0 that a launcher started (``--rendezvous env``): serve it in this
    process until rank 0's kernel stops it; its exit status."""
    from ..loader import read_model_config
    from .agree import model_digest
    from .worker import serve_rank
    cfg_text = config_json(config, _checked_pages(path, config, plan.size, read_model_config(path), plan.nnodes))
    threads = max(1, (os.cpu_count() or 1) // plan.local)
    return serve_rank(path, config_from_json(cfg_text, plan.device), rank=plan.rank, size=plan.size,
                      init="env://", threads=threads, timeout_s=timeout_s, activations=activations,
                      digest=model_digest(path), node=plan.node_rank)


def exit_if_broken(engine, log_to: logging.Logger) -> None:
    """After a tensor-parallel failure the kernel has shut down (LIPs told, memory
    unlinked, local ranks killed), but a thread may still be blocked in the broken
    group's collective, which the interpreter's exit could wait on: end the process
    now, with status 1.  Nothing happens when ``engine`` has no broken group."""
    tp = getattr(engine, "tp", None)
    if tp is not None and tp.group.broken:
        log_to.error("exiting: %s", tp.group.broken)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)


# ---------------------------------------------------------------- helpers
def _backend(config: EngineConfig) -> str:
    return "nccl" if config.torch_device.type == "cuda" else "gloo"


def _checked_pages(path, config: EngineConfig, size: int, model: ModelConfig, nnodes: int) -> int:
    """The KV pages every rank's pool holds, once ``size`` ranks over ``nnodes`` machines are
    checked to split ``model`` as ``config`` keeps the file's weights (ConfigError otherwise)."""
    from ..loader import has_quantized_tensors
    from .shard import check_tp, local_config
    if size % nnodes:
        raise ConfigError(f"--tp {size} does not split over --nnodes {nnodes}")
    check_tp(model, size, config.quantize is not None or (config.keep_quantized and has_quantized_tensors(path)))
    return config.resolve_num_pages(local_config(model, Shard(0, size)))


def _spawn(path, rank: int, size: int, init: str, cfg_text: str, device: str, threads: int,
           timeout_s: float, activations: str, digest: str, node: int) -> subprocess.Popen:
    """Start the worker process of rank ``rank`` (worker.py)."""
    argv = [sys.executable, "-m", "symphony.engine.tp.worker", "--rank", str(rank), "--size", str(size),
            "--init", init, "--config", cfg_text, "--device", device, "--threads", str(threads),
            "--timeout", str(timeout_s), "--activations", activations, "--model-digest", digest,
            "--node", str(node)]
    if path is not None:
        argv += ["--model", str(path)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    log.info("tensor-parallel rank %d of %d: pid %d on %s", rank, size, proc.pid, device)
    return proc


def _join(rank: int, size: int, init: str, backend: str, timeout_s: float, device, procs,
          rec: dict) -> TPGroup:
    """Join the group and check the ranks agree, failing clearly if a local rank exits first."""
    import threading
    from .agree import TPMismatch
    out: dict = {}

    def go():
        try:
            out["group"] = TPGroup(rank, size, init, backend, timeout_s, device, record=rec)
        except BaseException as e:
            out["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while t.is_alive():
        t.join(0.2)
        for r, p in enumerate(procs, start=1):
            if p.poll() is not None and t.is_alive():
                raise TPFailure(f"tensor-parallel rank {r} exited with status {p.returncode} before it "
                                f"joined (see its log above)")
        if time.monotonic() > deadline:
            raise TPFailure(f"the tensor-parallel ranks did not meet within {START_TIMEOUT_S:.0f} s")
    if isinstance(out.get("error"), TPMismatch):
        raise out["error"]
    if "error" in out:
        raise TPFailure(f"joining the tensor-parallel group failed: {out['error']}")
    return out["group"]
