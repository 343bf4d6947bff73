"""Who a LIP runs as: one unprivileged uid (= gid) of its own per live LIP.

When the kernel runs as root (the multi-user deployment), every LIP worker drops
to a uid drawn from a dynamic range (default 61184-65519, the range systemd's
DynamicUser uses), never 0, never the kernel's, never one another live LIP
holds.  A uid is skipped if /etc/passwd or /etc/group names it (a real account)
or if some process not ours runs as it (a scan of /proc at start-up and each
time the allocator wraps around the range).  Allocation goes round-robin, so
a uid just released is the last to be handed out again.  The uid is released
when the zygote reports the worker reaped: a LIP cannot fork, and its threads
die with it, so nothing of it is left.

A kernel that is not root cannot switch identities: it says so at start-up
and accepts LIPs only from its own uid (``check_caller``).
"""
from __future__ import annotations

import grp
import os
import pwd
from typing import Optional

DEFAULT_RANGE = (61184, 65519)
MAX_UID = (1 << 32) - 2          # (uid_t) -1 means "unchanged" to setresuid


class IdentityError(PermissionError):
    """A LIP cannot be given an identity (no free uid, or a caller this kernel may not serve)."""
    code = "EPERM"


class NoFreeUid(IdentityError):
    """Every uid of the LIP range is taken: admission waits for one to come free."""


def parse_range(text: str) -> tuple[int, int]:
    """``"FIRST-LAST"`` -> (first, last); ValueError with the reason if malformed."""
    if not isinstance(text, str):
        raise ValueError("uid range must be a string FIRST-LAST")
    parts = text.strip().split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"uid range {text!r} must be FIRST-LAST, e.g. 61184-65519")
    first, last = int(parts[0]), int(parts[1])
    if not 1 <= first <= last <= MAX_UID:
        raise ValueError(f"uid range {text!r}: need 1 <= FIRST <= LAST <= {MAX_UID}")
    return first, last


def check_caller(kernel_uid: int, caller_uid: int, can_switch: bool) -> None:
    """May a LIP be started for a client of Unix uid ``caller_uid``?

    A kernel that gives every LIP its own uid serves everyone.  One that cannot
    (not root) would run every LIP as itself: it serves only its own uid."""
    if can_switch or caller_uid == kernel_uid:
        return
    raise IdentityError(f"this kernel runs as uid {kernel_uid} without root, so it cannot give a LIP "
                        f"an identity of its own; it runs LIPs only for uid {kernel_uid}, not for "
                        f"uid {caller_uid} (run the kernel as root to serve other users)")


def _process_uids() -> set[int]:
    """Every uid (real, effective, saved, fs) of a live process."""
    out: set[int] = set()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        out.update(int(x) for x in line.split()[1:5])
                        break
        except (OSError, ValueError):
            pass
    return out


class UidPool:
    """Hands out one uid per live LIP from [first, last] (see the module docstring).

    ``can_switch`` is False when the process is not root: then ``allocate`` returns
    None (the LIP runs as the kernel's own uid) and callers are checked by
    ``check_caller``."""

    def __init__(self, first: int = DEFAULT_RANGE[0], last: int = DEFAULT_RANGE[1],
                 can_switch: Optional[bool] = None):
        if not (isinstance(first, int) and isinstance(last, int) and 1 <= first <= last <= MAX_UID):
            raise ValueError(f"bad uid range {first}-{last}")
        self.first, self.last = first, last
        self.kernel_uid = os.geteuid()
        self.can_switch = (self.kernel_uid == 0) if can_switch is None else bool(can_switch)
        self.held: dict[int, int] = {}                  # lip id -> uid
        self._held_uids: set[int] = set()
        self._cursor = first
        self._foreign: set[int] = set()
        if self.can_switch:
            self._foreign = _process_uids()

    def __len__(self) -> int:
        return len(self.held)

    def _usable(self, uid: int) -> bool:
        if uid in self._held_uids or uid in self._foreign or uid == self.kernel_uid:
            return False
        try:
            pwd.getpwuid(uid)
            return False                                # a real account
        except KeyError:
            pass
        try:
            grp.getgrgid(uid)
            return False
        except KeyError:
            return True

    def allocate(self, lip_id: int) -> Optional[int]:
        """A uid (= gid) for LIP ``lip_id``, or None if this kernel cannot switch.

        Raises NoFreeUid when every uid in the range is taken."""
        if not self.can_switch:
            return None
        if lip_id in self.held:
            return self.held[lip_id]
        n = self.last - self.first + 1
        uid = self._cursor
        for _ in range(n):
            if self._usable(uid):
                break
            uid = uid + 1 if uid < self.last else self.first
            if uid == self.first:                       # wrapped: look at /proc again
                self._foreign = _process_uids() - self._held_uids
        else:
            raise NoFreeUid(f"no free LIP uid in {self.first}-{self.last} "
                                f"({len(self.held)} held by LIPs); widen --lip-uids")
        self.held[lip_id] = uid
        self._held_uids.add(uid)
        self._cursor = uid + 1 if uid < self.last else self.first
        return uid

    def release(self, lip_id: int) -> None:
        """LIP ``lip_id``'s worker is gone: its uid may be handed out again."""
        uid = self.held.pop(lip_id, None)
        if uid is not None:
            self._held_uids.discard(uid)
