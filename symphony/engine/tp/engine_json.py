"""The engine config every tensor-parallel rank runs, as JSON on its command line (rank 0
writes it, `worker` reads it; a module of its own so neither imports the other)."""
from __future__ import annotations

import dataclasses
import json

import torch

from ..config import EngineConfig


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
