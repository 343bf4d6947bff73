"""What every rank must agree on before the first step, and the check that they do.

Ranks on one machine are started by rank 0 with its own settings; ranks on
other machines (``--worker``, or a launcher's ``env://``) take their own
flags, and a node started with another model file, dtype or KV pool size would
otherwise run steps on page ids or weights that do not match rank 0's.  So,
once the group has met, each rank contributes a record

    {"node", "host", "rank",                      who it is (named in an error)
     "protocol", "symphony", "torch",             the code it runs
     "model",                                     the model file's content digest
     "engine": {dtype, page_size, num_pages, kv_memory_bytes, weights, quantize, ...},
     "activations", "size", "timeout_s"}          the flags it was started with

all records are gathered on every rank (`exchange`: JSON bytes in a fixed-size
uint8 tensor, never pickle), and every rank reaches the same verdict
(`disagreement`): the first field, in the order above, in which a node differs
from node 0, named with both values and the flag that sets it.  Every rank
then refuses to start with that message (`TPMismatch`).

The model digest (`model_digest`) is SHA-256 over the file's bytes (a
safetensors directory: each file's name and bytes, in name order), hashed in
64 MiB pieces on several threads and remembered per (path, size, mtime,
inode) under the build cache, so a machine hashes a given file once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from ..config import ConfigError

log = logging.getLogger("symphony.tp")

PROTOCOL = 2                   # the command protocol of group.py (bumped when a command changes)
RECORD_BYTES = 8192            # a record's room in the exchange (length prefix included)
PIECE = 64 << 20               # bytes a digest thread hashes at a time

# (record key, what it is, the flags that set it), in the order a disagreement is reported
FIELDS = (
    ("protocol", "the tensor-parallel protocol", "the same Symphony release on every node"),
    ("symphony", "the Symphony version", "the same Symphony release on every node"),
    ("torch", "the torch version", "the same torch on every node"),
    ("model", "the model file's content (SHA-256)", "--model: the same file on every node"),
    ("engine.dtype", "the dtype", "--dtype"),
    ("engine.weights", "the weights mode", "--weights"),
    ("engine.quantize", "load-time quantization", "--quantize"),
    ("activations", "the CPU activations", "--activations"),
    ("engine.page_size", "the KV page size", "--page-size"),
    ("engine.kv_memory_bytes", "the KV pool's memory", "--kv-memory-mb"),
    ("engine.num_pages", "the KV pool's pages", "--kv-memory-mb and --page-size"),
    ("engine.max_batch_tokens", "the tokens a step may carry", "the same Symphony release"),
    ("engine.max_seq_len", "the slots a KV file may hold", "the same Symphony release"),
    ("engine.float32_head", "the LM head's dtype", "the same Symphony release"),
    ("size", "the group's size", "--tp / --gpus / --nnodes (or the launcher's $WORLD_SIZE)"),
    ("timeout_s", "the collective timeout", "--tp-timeout"),
)


class TPMismatch(ConfigError):
    """The ranks were started with settings that disagree: the kernel cannot start."""


def record(*, node: int, rank: int, model: str, engine: dict, activations: str, size: int,
           timeout_s: float) -> dict:
    """This rank's record (``engine``: `engine_json.config_json`'s fields, the device left out)."""
    import torch
    return {"node": node, "host": socket.gethostname(), "rank": rank, "protocol": PROTOCOL,
            "symphony": _symphony_version(), "torch": torch.__version__, "model": model,
            "engine": {k: v for k, v in engine.items() if k != "device"}, "activations": activations,
            "size": size, "timeout_s": timeout_s}


def exchange(mine: dict, size: int, group) -> list[Optional[dict]]:
    """Every rank's record, in rank order (None for one that cannot be read), via an
    all-gather on ``group`` (a gloo group: CPU tensors)."""
    import torch
    import torch.distributed as dist
    raw = json.dumps(mine, sort_keys=True).encode()
    if len(raw) > RECORD_BYTES - 4:
        raise TPMismatch(f"this rank's settings record is {len(raw)} bytes, over {RECORD_BYTES - 4}")
    buf = torch.zeros(RECORD_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4:4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(out, buf, group=group)
    records = []
    for o in out:
        b = bytes(o.tolist())
        n = int.from_bytes(b[:4], "little")
        try:
            r = json.loads(b[4:4 + n]) if n <= RECORD_BYTES - 4 else None
        except ValueError:
            r = None
        records.append(r if isinstance(r, dict) else None)
    return records


def disagreement(records: list[Optional[dict]]) -> Optional[str]:
    """Why the ranks cannot run together (the first field a node differs from node 0
    in), or None when they agree.  The same answer on every rank."""
    ref = records[0]
    if ref is None:
        return "rank 0's settings record cannot be read (another Symphony release?)"
    for r, rec in enumerate(records):
        if rec is None:
            return f"rank {r}'s settings record cannot be read (another Symphony release on its node?)"
        for key, what, flags in FIELDS:
            mine, theirs = _get(rec, key), _get(ref, key)
            if mine != theirs:
                return (f"the nodes disagree on {what}: node {rec.get('node')} (host {rec.get('host')}, rank {r}) "
                        f"has {_show(key, mine)}, node {ref.get('node')} (host {ref.get('host')}, rank 0) has "
                        f"{_show(key, theirs)}; start every node with the same {flags}")
    return None


def check(mine: dict, size: int, group) -> None:
    """Exchange records and raise `TPMismatch` (on every rank alike) if they disagree."""
    why = disagreement(exchange(mine, size, group))
    if why:
        log.error("%s", why)
        raise TPMismatch(why)


def model_digest(path) -> str:
    """SHA-256 of the model's bytes (see the module docstring); ``path`` None: the embedded model."""
    from ..loader import default_model_path
    p = Path(path) if path is not None else default_model_path()
    files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
    stats = [(str(f.resolve()), *_stat(f)) for f in files]
    key = hashlib.sha256(json.dumps(stats).encode()).hexdigest()
    cache = _cache_file()
    known = _read_cache(cache)
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for f in files:
            h.update(f.name.encode() + b"\0" if p.is_dir() else b"")
            size = f.stat().st_size
            h.update(size.to_bytes(8, "little"))
            for d in pool.map(lambda off, f=f: _piece(f, off), range(0, size, PIECE)):
                h.update(d)
    digest = h.hexdigest()
    known[key] = digest
    _write_cache(cache, known)
    return digest


# ---------------------------------------------------------------- helpers
def _get(rec: dict, key: str):
    v = rec
    for part in key.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v


def _show(key: str, v) -> str:
    if key == "model" and isinstance(v, str):
        return f"sha256 {v[:16]}..."
    if key == "engine.kv_memory_bytes" and isinstance(v, int):
        return f"{v / 2**20:g} MiB"
    return "none" if v is None else str(v)


def _symphony_version() -> str:
    try:
        from importlib.metadata import version
        return version("symphony")
    except Exception:                       # running from a checkout that is not installed
        return "unknown"


def _stat(f: Path) -> tuple:
    st = f.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _piece(f: Path, off: int) -> bytes:
    with open(f, "rb") as fh:
        fh.seek(off)
        return hashlib.sha256(fh.read(PIECE)).digest()


def _cache_file() -> Path:
    base = os.environ.get("SYMPHONY_BUILD_DIR") or os.path.expanduser("~/.cache/symphony")
    return Path(base) / "model-digests.json"


def _read_cache(f: Path) -> dict:
    try:
        d = json.loads(f.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(f: Path, known: dict) -> None:
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(list(known.items())[-256:])))
        os.replace(tmp, f)
    except OSError as e:                    # a read-only home: hash again next time
        log.debug("model digest cache not written: %s", e)
