"""Administrator limits as ceilings.

The administrator sets, per resource, a *ceiling* (the most any LIP may have)
and a *default* (what a LIP gets when its client asks for nothing); a client
may ask for less than the ceiling, never more: a request above it is refused
at spawn with a message naming the limit and the ceiling (`LimitExceeded`).

    resource        key in limits   ceiling (default)   default       kernel flags
    address space   memory_bytes    4 GiB               the ceiling   --lip-memory-mb / --default-lip-memory-mb
    CPU time        cpu_seconds     600 s               the ceiling   --lip-cpu / --default-lip-cpu
    wall clock      timeout         3600 s              the ceiling   --lip-timeout / --default-lip-timeout
    threads         threads         64                  the ceiling   --lip-threads / --default-lip-threads
    open files      open_files      1024                64            (none)

A ceiling of None means "no ceiling" (then a default of None means "no limit").
Priority classes are ceilings too: every user may ask up to ``max_priority``
(``normal`` unless the administrator says otherwise), a user named in
``user_priority`` up to that class.  ``max_lips_per_user`` bounds how many LIPs
one user may run at once, so no user can take every LIP slot (the admission
queue applies it: a user's LIPs beyond it wait, sched/admission.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from symphony.sched import priority_of
from symphony.sched.lips import PRIORITY_CLASSES

LIMIT_KEYS = ("memory_bytes", "cpu_seconds", "timeout", "threads", "open_files")
# the range a value must be in to mean anything, whatever the ceiling
RANGES = {"memory_bytes": (256 << 20, 1 << 40), "cpu_seconds": (1, 10 ** 6), "timeout": (0.1, 10 ** 7),
          "threads": (1, 4096), "open_files": (16, 65536)}
DEFAULT_CEILINGS = {"memory_bytes": 4 << 30, "cpu_seconds": 600, "timeout": 3600.0, "threads": 64,
                    "open_files": 1024}
DEFAULT_DEFAULTS = {"open_files": 64}          # the others default to their ceiling
FLAG = {"memory_bytes": "--lip-memory-mb", "cpu_seconds": "--lip-cpu", "timeout": "--lip-timeout",
        "threads": "--lip-threads", "open_files": "(fixed)"}


class LimitExceeded(PermissionError):
    """A spawn asked for more than the administrator allows."""

    code = "EPERM"


@dataclass
class LimitPolicy:
    """The administrator's ceilings and defaults (validated at construction)."""

    ceilings: dict = field(default_factory=lambda: dict(DEFAULT_CEILINGS))
    defaults: dict = field(default_factory=dict)
    max_priority: str = "normal"
    user_priority: dict = field(default_factory=dict)
    max_lips_per_user: Optional[int] = None

    def __post_init__(self):
        unknown = (set(self.ceilings) | set(self.defaults)) - set(LIMIT_KEYS)
        if unknown:
            raise ValueError(f"unknown limits {sorted(unknown)}; known: {LIMIT_KEYS}")
        ceil = {k: self.ceilings.get(k, DEFAULT_CEILINGS[k]) for k in LIMIT_KEYS}
        for k, v in ceil.items():
            if v is not None:
                ceil[k] = _value(k, v, "ceiling")
        dflt = {}
        for k in LIMIT_KEYS:
            v = self.defaults.get(k, DEFAULT_DEFAULTS.get(k, ceil[k]))
            if v is not None:
                v = _value(k, v, "default")
                if ceil[k] is not None and v > ceil[k]:
                    raise ValueError(f"the default {k} {v} is above its ceiling {ceil[k]}")
            dflt[k] = v
        self.ceilings, self.defaults = ceil, dflt
        _class(self.max_priority, "max_priority")
        if not isinstance(self.user_priority, dict):
            raise ValueError("user_priority must be a dict {user: class}")
        for u, c in self.user_priority.items():
            if not isinstance(u, str) or not u:
                raise ValueError(f"bad user name {u!r} in user_priority")
            _class(c, f"the priority class of {u}")
        m = self.max_lips_per_user
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"max_lips_per_user must be an int >= 1, got {m!r}")

    # ------------------------------------------------------------------ spawn checks
    def limits_for(self, asked) -> dict:
        """The limits a LIP runs under: what the client asked for (each at most
        the ceiling, else LimitExceeded), the default for what it did not ask."""
        if asked is None:
            asked = {}
        if not isinstance(asked, dict):
            raise ValueError("limits must be an object {name: value}")
        unknown = set(asked) - set(LIMIT_KEYS)
        if unknown:
            raise ValueError(f"unknown limits {sorted(unknown)}; known: {list(LIMIT_KEYS)}")
        out = {}
        for k in LIMIT_KEYS:
            v = asked.get(k)
            if v is None:
                out[k] = self.defaults[k]
                continue
            v = _value(k, v, "limit")
            cap = self.ceilings[k]
            if cap is not None and v > cap:
                raise LimitExceeded(f"limit {k}={_show(k, v)} is above the administrator's ceiling of "
                                    f"{_show(k, cap)} (symphony-kernel {FLAG[k]}); ask for at most that")
            out[k] = v
        return out

    def priority_for(self, user: str, asked) -> int:
        """The numeric priority for a LIP of ``user`` asking for ``asked`` (a class
        name or an int); LimitExceeded above what this user may have."""
        p = priority_of("normal" if asked is None else asked)
        cls = self.user_priority.get(user, self.max_priority)
        if p > PRIORITY_CLASSES[cls]:
            raise LimitExceeded(f"priority {asked!r} is above what user {user} may ask for ({cls}); "
                                f"the administrator may grant it (symphony-kernel --user-priority "
                                f"{user}=CLASS or --max-priority CLASS)")
        return p


# ---------------------------------------------------------------- helpers
def _value(k: str, v, what: str):
    lo, hi = RANGES[k]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
        raise ValueError(f"{what} {k} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v) if k == "timeout" else int(v)


def _show(k: str, v) -> str:
    return f"{v} ({v / 2**20:g} MiB)" if k == "memory_bytes" else str(v)


def _class(c, what: str) -> None:
    if c not in PRIORITY_CLASSES:
        raise ValueError(f"{what} must be one of {sorted(PRIORITY_CLASSES)}, got {c!r}")
