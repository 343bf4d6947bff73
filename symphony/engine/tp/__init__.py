"""Tensor parallelism: one model across several processes (ranks), as vLLM shards it.

    shard.py    which heads and columns each rank holds; the checks of a --tp size
    group.py    the process group (gloo on CPUs, NCCL on GPUs) and the step protocol
    kv.py       rank 0's KV pool, whose page operations run on every rank
    worker.py   the worker process of a rank other than 0

The kernel process is rank 0: it keeps KVFS, the schedulers and the LIPs, and
broadcasts each step; every rank runs its shard of every layer.  See
docs/design/tensor-parallel.md.
"""
from .shard import Shard, TPConfigError, check_tp, local_config, shard_weights, valid_sizes

__all__ = ["Shard", "TPConfigError", "check_tp", "local_config", "shard_weights", "valid_sizes"]
