"""Capabilities under policy: what a LIP may read or fetch, as whom, how long, how many.

    policy.py    CapPolicy: the administrator's allow/deny lists, grant checks at spawn
    identity.py  Identity of the submitting user; per-thread file credentials
    files.py     read_file / list_dir: opened as that user, checked by real path
    http.py      http: every hop and resolved address checked against the grants
    pool.py      CapPool: worker threads, a per-user and a per-LIP share, per-call deadlines

``Capabilities`` is what the syscall server holds: the policy, the pool, and one
entry point per capability system call.
"""
from __future__ import annotations

from typing import Callable, Optional

from symphony.kernel.capabilities import files, http
from symphony.kernel.capabilities.identity import Identity, identity_for, nobody
from symphony.kernel.capabilities.policy import CapError, CapPolicy, parse_host
from symphony.kernel.capabilities.pool import CapPool, Job
from symphony.kernel.syscall.proc import Serving

__all__ = ["Capabilities", "CapError", "CapPolicy", "CapPool", "Identity", "Job", "identity_for",
           "nobody", "parse_host"]


class Capabilities:
    """The capability system calls of one kernel, under ``policy``.

    ``max_bytes`` caps a file read or an http body (the kernel's message limit)."""

    def __init__(self, policy: Optional[CapPolicy] = None, max_bytes: int = 1 << 20):
        self.policy = policy or CapPolicy.build()
        self.max_bytes = max_bytes
        self.pool = CapPool(self.policy.workers, self.policy.per_lip, per_user=self.policy.per_user)

    def submit(self, lip, op: str, body: dict,
               done: Callable[[Optional[dict], Optional[BaseException]], None]) -> None:
        """Queue capability ``op`` ('http', 'read', 'list') of LIP ``lip``; ``done``
        gets (result, None) or (None, exception) exactly once, from a pool thread."""
        who = owner_identity(lip)
        grants = lip.grants
        pol, mb = self.policy, self.max_bytes
        timeout = pol.timeout_s
        if op == "http":
            try:
                url, method, data, headers, timeout = http.check_args(body, pol.timeout_s, mb)
            except CapError as e:
                done(None, e)
                return

            def fn(ctx: Job):
                return http.request(grants.get("http") or [], url, method, data, headers, ctx, mb)
        elif op == "read":
            def fn(ctx: Job):
                return files.read_file(pol, who, grants, body, mb)
        elif op == "list":
            def fn(ctx: Job):
                return files.list_dir(pol, who, grants, body)
        else:
            raise ValueError(f"unknown capability {op!r}")
        self.pool.submit(lip.id, fn, done, timeout, alive=lambda: lip.state in (Serving.RUNNING, Serving.STARTING), user=lip.user)

    def close(self) -> None:
        self.pool.close()


def owner_identity(lip) -> Optional[Identity]:
    """The identity recorded on a LIP at spawn (``nobody`` when none was)."""
    uid = getattr(lip, "owner_uid", -1)
    if uid is None or uid < 0:
        return nobody()
    return Identity(uid, lip.owner_gid, tuple(getattr(lip, "owner_groups", ()) or ()))
