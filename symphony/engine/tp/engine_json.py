"""The engine config every tensor-parallel rank runs, as JSON on its command line (rank 0
writes it, `worker` reads it; a module of its own so neither imports the other)."""
from __future__ import annotations

import dataclasses
import json

from ..config import DTYPES, EngineConfig, dtype_name


def config_json(cfg: EngineConfig, num_pages: int) -> str:
    """The engine config every rank runs, as JSON (dtypes by name, the pool's page count fixed)."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for f in ("dtype", "kv_dtype"):
        d[f] = None if d[f] is None else dtype_name(d[f])
    d["num_pages"] = num_pages
    return json.dumps(d)


def config_from_json(text: str, device: str) -> EngineConfig:
    d = json.loads(text)
    for f in ("dtype", "kv_dtype"):
        if d.get(f) is not None:
            d[f] = DTYPES[d[f]]
    d["device"] = device
    return EngineConfig(**d)
