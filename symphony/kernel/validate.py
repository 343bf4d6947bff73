"""Argument checks shared by the system-call handlers."""
from __future__ import annotations

from .failure import fail as _fail


def _path(body, key="path", optional=False):
    v = body.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str):
        _fail("InvalidArgument", "EINVAL", f"{key} must be a string path")
    return v


def _int(v, name, lo, hi):
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        _fail("InvalidArgument", "EINVAL", f"{name} must be an int in [{lo}, {hi}], got {v!r}")
    return v
