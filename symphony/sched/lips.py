"""Level 1: LIPs.  Admission control against the KV budget (the queue that
waits for it: admission.py), priority classes,
and which LIPs to swap out first when device pages run short.

    admit(pages_free, pages_wanted, running) -> (ok, reason)
    swap_out_order(lips) -> LIP ids, the ones to swap out first first

A LIP that is blocked (waiting for input, for a capability call or for its
user) gives its KV pages up before any running one; among equals, lower
priority first, then the one blocked longest / used least recently.
"""
from __future__ import annotations

from dataclasses import dataclass

PRIORITY_CLASSES = {"batch": -1, "normal": 0, "interactive": 1}


@dataclass
class LipView:
    id: int
    priority: int = 0
    blocked: bool = False          # in recv(), a capability call, or waiting on its user
    blocked_since: float = 0.0
    last_active: float = 0.0
    device_pages: int = 0


def swap_out_order(lips: list[LipView]) -> list[int]:
    """LIP ids in the order their pages should leave the device."""
    def key(l: LipView):
        if l.blocked:
            return (0, l.priority, l.blocked_since, l.id)
        return (1, l.priority, l.last_active, l.id)
    return [l.id for l in sorted((l for l in lips if l.device_pages > 0), key=key)]


def admit(running: int, max_lips: int, pages_free: int, pages_reserve: int) -> tuple[bool, str]:
    """Whether a new LIP may start now: a LIP slot must be free and the device
    must have the ``pages_reserve`` pages it is expected to need (the admission
    queue, admission.py, asks this of the LIP at its head)."""
    if running >= max_lips:
        return False, f"too many LIPs running ({running} of {max_lips})"
    if pages_free < pages_reserve:
        return False, f"KV memory is short ({pages_free} pages free, {pages_reserve} needed)"
    return True, ""


def priority_of(name) -> int:
    if isinstance(name, int) and not isinstance(name, bool) and -10 <= name <= 10:
        return name
    if name in PRIORITY_CLASSES:
        return PRIORITY_CLASSES[name]
    raise ValueError(f"priority must be one of {sorted(PRIORITY_CLASSES)} or an int in [-10, 10], got {name!r}")
