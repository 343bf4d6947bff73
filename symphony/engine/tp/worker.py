"""A tensor-parallel rank other than 0: ``python -m symphony.engine.tp.worker ...``
(started by rank 0 on its machine, or by ``symphony-kernel --worker`` on another),
or `serve_rank` in a process a launcher started (``--rendezvous env``).

It binds its GPU (if any) first, loads its shard of the model (reading only
its part of the file), makes its part of the KV pool, joins the group (its
settings checked against rank 0's) and then does what rank 0 sends
(group.py) until STOP.  Any error ends the process with a message on stderr
and a non-zero status; rank 0 sees the group fail and shuts the kernel down.
A group that breaks while this rank waits (rank 0 hung or gone, a heartbeat
lost) ends the process after `EXIT_GRACE_S`, unless a STOP comes first.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import torch

log = logging.getLogger("symphony.tp")

EXIT_GRACE_S = 3.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="symphony.engine.tp.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init", required=True, help="torch.distributed init method (file://, tcp:// or env://)")
    p.add_argument("--config", required=True, help="the engine config as JSON (tp.engine_json.config_json)")
    p.add_argument("--model", default=None)
    p.add_argument("--model-digest", default=None, help="the model file's digest (agree.model_digest)")
    p.add_argument("--node", type=int, default=0, help="this machine's node rank")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--activations", default="auto")
    return p


def _hang_after(rank: int):
    """Test hook: SYMPHONY_TP_TEST_HANG=RANK:STEPS makes that rank hang at step STEPS + 1."""
    spec = os.environ.get("SYMPHONY_TP_TEST_HANG", "")
    r, _, n = spec.partition(":")
    return int(n) if spec and r.isdigit() and int(r) == rank and n.isdigit() else None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    from .engine_json import config_from_json
    try:
        cfg = config_from_json(args.config, args.device)
    except Exception as e:
        print(f"symphony tp rank {args.rank}: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from ..hostmem import retain_freed_memory
    retain_freed_memory()                           # as rank 0's kernel does
    return serve_rank(args.model, cfg, rank=args.rank, size=args.size, init=args.init, threads=args.threads,
                      timeout_s=args.timeout, activations=args.activations, digest=args.model_digest,
                      node=args.node)


def serve_rank(path, cfg, *, rank: int, size: int, init: str, threads: int, timeout_s: float,
               activations: str, digest=None, node: int = 0) -> int:
    """Load rank ``rank``'s shard, join the group and serve rank 0's commands until STOP;
    the exit status (0 after STOP, 1 after a failure, 2 if it could not start)."""
    torch.set_num_threads(max(1, threads))
    from ..kv_cache import KVPool
    from ..loader import load_model
    from ..model import PagedLlama
    from ..quant import prepare_weights, set_int8_activations
    from .agree import model_digest, record
    from .group import TPGroup, bind_device
    from .engine_json import config_json
    from .shard import Shard
    try:
        bind_device("nccl", cfg.torch_device)              # before anything touches the GPU
        set_int8_activations(activations == "int8")
        weights, _ = load_model(path, progress=False, keep_quantized=cfg.keep_quantized, shard=Shard(rank, size))
        weights = prepare_weights(weights, cfg.keep_quantized, cfg.quantize)
        import json
        mine = record(node=node, rank=rank, model=digest or model_digest(path),
                      engine=json.loads(config_json(cfg, cfg.num_pages)), activations=activations,
                      size=size, timeout_s=timeout_s)
        group = TPGroup(rank, size, init, "nccl" if cfg.torch_device.type == "cuda" else "gloo", timeout_s,
                        cfg.torch_device, record=mine, on_broken=lambda why: _exit_soon(rank, why))
        model = PagedLlama(weights, cfg.torch_device, cfg.torch_dtype, cfg.use_float32_head, tp=group)
        kv = KVPool(weights.config, cfg)
        from ..ops import calibrate
        calibrate.ensure_for(cfg.torch_device, weights.is_quantized())   # timed here: this thread computes
        kv.start_commit()
    except Exception as e:
        print(f"symphony tp rank {rank}: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    log.info("rank %d of %d ready: %d KV pages of %d heads", rank, size, kv.num_pages, weights.config.n_kv_heads)
    try:
        return _serve(group, model, kv, cfg, rank)
    except Exception as e:
        print(f"symphony tp rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _serve(group, model, kv, cfg, rank: int) -> int:
    from ..model import BatchMeta
    from .group import COPY_PAGE, COPY_SLOTS, GATHER, SCATTER, STEP, STOP
    from .kv import local_pages, write_local
    steps, hang_after = 0, _hang_after(rank)
    while True:
        op, a, payload = group.receive()
        if op == STEP:
            steps += 1
            if hang_after is not None and steps > hang_after:
                log.warning("test hook: rank %d hangs", rank)
                while True:
                    time.sleep(3600)
            model.forward(BatchMeta.unpack(a, payload, cfg.torch_device), kv, head=False)
        elif op == COPY_PAGE:
            kv.copy_page(a[0], a[1], a[2])
        elif op == COPY_SLOTS:
            n = a[0]
            v = payload.tolist()
            kv.copy_slots(v[:n], v[n:2 * n], v[2 * n:3 * n], v[3 * n:])
        elif op == GATHER:
            group.gather(local_pages(kv.pool, payload.tolist()))
        elif op == SCATTER:
            pages = payload.tolist()
            shape = list(kv.pool.shape)
            like = torch.empty(shape[0], 2, len(pages), a[0], shape[4], shape[5], dtype=kv.pool.dtype)
            write_local(kv.pool, pages, a[0], group.scatter(None, like))
        elif op == STOP:
            log.info("rank %d stops after %d steps", rank, steps)
            group.close()
            return 0
        else:
            raise RuntimeError(f"unknown command {op}")


def _exit_soon(rank: int, why: str) -> None:
    """The group broke while this rank may be blocked in it: end the process after a
    grace period (a STOP already on its way ends it cleanly first)."""
    def go():
        time.sleep(EXIT_GRACE_S)
        print(f"symphony tp rank {rank}: {why}; exiting", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=go, name="symphony-tp-exit", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
