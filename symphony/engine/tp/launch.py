"""Rank 0's side of tensor parallelism: start the other ranks, join the group, watch them.

    tp = TensorParallel.start(model_path, engine_config, size=3)   # spawns ranks 1, 2
    engine = Engine.load(model_path, engine_config, tp=tp)         # rank 0's shard; KV on every rank
    ...
    tp.dead()        # why a rank is gone, or None (the kernel's watchdog asks every second)
    engine.close()   # STOP to every rank, then wait for them (killed after a grace period)

On one machine the ranks meet through a file in a private directory
(``file://``); across machines through torch.distributed's TCP rendezvous
(``--master-addr``/``--master-port``, ``--nnodes``/``--node-rank``, as
torchrun names them), the other hosts running ``symphony-kernel --worker``.
Each rank computes with ``threads`` CPU threads (default: the cores divided
by the local ranks), or on its own GPU.
"""
from __future__ import annotations

import dataclasses
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

import torch

from ..config import ConfigError, EngineConfig, ModelConfig
from .group import TPFailure, TPGroup
from .shard import Shard

log = logging.getLogger("symphony.tp")

START_TIMEOUT_S = 300.0


def config_json(cfg: EngineConfig, num_pages: int) -> str:
    """The engine config every rank runs, as JSON (dtype by name, the pool's page count fixed)."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    d["dtype"] = None if cfg.dtype is None else str(cfg.dtype).replace("torch.", "")
    d["num_pages"] = num_pages
    return json.dumps(d)


def config_from_json(text: str, device: str) -> EngineConfig:
    d = json.loads(text)
    if d.get("dtype") is not None:
        d["dtype"] = getattr(torch, d["dtype"])
    d["device"] = device
    return EngineConfig(**d)


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
              activations: str = "auto", master: Optional[str] = None, nnodes: int = 1) -> "TensorParallel":
        """Spawn ranks 1..size-1 of this node (all of them on one machine; with
        ``master`` "host:port" and ``nnodes`` > 1, the ranks of the other nodes
        join from their own ``symphony-kernel --worker``) and join the group as
        rank 0.  ``model``: the whole model's config, read from the file."""
        num_pages = _checked_pages(path, config, size, model, nnodes)
        local_ranks = size // nnodes
        tmp = None
        if master:
            init = f"tcp://{master}"
        else:
            tmp = tempfile.mkdtemp(prefix="symphony-tp-")
            init = f"file://{Path(tmp) / 'rendezvous'}"
        cfg_text = config_json(config, num_pages)
        threads = threads or max(1, (os.cpu_count() or 1) // local_ranks)
        procs = [_spawn(path, r, size, init, cfg_text, devices[r] if devices else "cpu", threads, timeout_s,
                        activations) for r in range(1, local_ranks)]
        backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
        try:
            group = _join(0, size, init, backend, timeout_s, config.torch_device, procs)
        except BaseException:
            for p in procs:
                p.kill()
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("tensor parallelism: %d ranks (%s), %d KV pages on every rank, %d CPU threads a rank",
                 size, backend, num_pages, threads)
        tp = cls(group, model, procs, tmp)
        tp.threads = threads
        return tp

    def dead(self) -> Optional[str]:
        """Why a rank is gone (exited, or the group broke), or None while all run."""
        if self.group.broken:
            return self.group.broken
        for r, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                return f"tensor-parallel rank {r} (pid {p.pid}) exited with status {code}"
        return None

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
           timeout_s: float, activations: str) -> subprocess.Popen:
    """Start the worker process of rank ``rank`` (worker.py)."""
    argv = [sys.executable, "-m", "symphony.engine.tp.worker", "--rank", str(rank), "--size", str(size),
            "--init", init, "--config", cfg_text, "--device", device, "--threads", str(threads),
            "--timeout", str(timeout_s), "--activations", activations]
    if path is not None:
        argv += ["--model", str(path)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    log.info("tensor-parallel rank %d of %d: pid %d on %s", rank, size, proc.pid, device)
    return proc


def _join(rank: int, size: int, init: str, backend: str, timeout_s: float, device, procs) -> TPGroup:
    """Join the group, failing clearly if a local rank exits before it joins."""
    import threading
    out: dict = {}

    def go():
        try:
            out["group"] = TPGroup(rank, size, init, backend, timeout_s, device)
        except BaseException as e:
            out["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while t.is_alive():
        t.join(0.2)
        for r, p in enumerate(procs, start=1):
            if p.poll() is not None:
                raise TPFailure(f"tensor-parallel rank {r} exited with status {p.returncode} before it "
                                f"joined (see its log above)")
        if time.monotonic() > deadline:
            raise TPFailure(f"the tensor-parallel ranks did not meet within {START_TIMEOUT_S:.0f} s")
    if "error" in out:
        raise TPFailure(f"joining the tensor-parallel group failed: {out['error']}")
    return out["group"]


def run_node(path, config: EngineConfig, size: int, nnodes: int, node_rank: int, master: str,
             timeout_s: float, devices: Optional[list[str]], activations: str) -> int:
    """Run the ranks of machine ``node_rank`` (``symphony-kernel --worker``): each a worker
    process, until node 0's kernel stops them.  The first non-zero exit status, else 0."""
    if node_rank < 1:
        raise ConfigError("--worker runs the ranks of another machine: --node-rank must be 1 or more")
    from ..loader import read_model_config
    cfg_text = config_json(config, _checked_pages(path, config, size, read_model_config(path), nnodes))
    local = size // nnodes
    threads = max(1, (os.cpu_count() or 1) // local)
    procs = [_spawn(path, node_rank * local + i, size, f"tcp://{master}", cfg_text,
                    devices[i] if devices else "cpu", threads, timeout_s, activations) for i in range(local)]
    status = 0
    for p in procs:
        code = p.wait()
        status = status or code
    return status
