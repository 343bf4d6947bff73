"""KV that moves with its users: when the kernel holding a conversation drains or dies.

A stored response (``previous_response_id``) runs its continuation on the kernel
that served it, where the serving program's prefix cache holds the
conversation's KV (router.py pins it there).  When that kernel is out of
rotation the gateway no longer just answers 503:

    draining   (``symphony drain``; its `stats` say so) the user's prefix-cache files
               are copied to the least loaded live kernel, each exported there and
               imported here as the same user (checksummed, refused across models),
               and the user's stored responses are pinned to the new kernel.  When a
               kernel is first seen draining this is done for every user with a
               stored response on it (`evacuate`), and again on demand (`follow`)
    dead       a live kernel given the dead one's durable directory
               (``--peer-durable-dir``: shared storage) adopts the files the user
               owned there that were made durable (the serving program syncs a
               conversation's last checkpoint under ``--durable-responses``), and the
               stored responses move to it

If nothing could be moved the pin stays, and the continuation is the 503 it
always was (``previous_response_unavailable``): the gateway never silently
recomputes a conversation elsewhere.  One move per (user, source kernel) at a time.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from .kernel import KernelRefused, KernelUnavailable

log = logging.getLogger("symphony.gateway")


class Mover:
    """Moves users' KV files between the gateway's kernels and re-pins their responses."""

    def __init__(self, kernels, store, cache_dir):
        """``cache_dir(user)``: the user's prefix-cache directory (None: no prefix cache)."""
        self.kernels, self.store, self.cache_dir = kernels, store, cache_dir
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self.moved_files = 0
        self.moved_bytes = 0

    async def follow(self, user: str, stored) -> Optional[int]:
        """The kernel a continuation of ``user``'s response ``stored`` should run on: its
        kernel while that is in rotation (or comes back when probed), else the kernel its
        files were moved to, else its kernel still (the caller's 503)."""
        ks, pin = self.kernels, stored.kernel
        if pin is None or ks.table.live[pin]:
            return pin
        src = ks[pin]
        if await ks.revive([src]):
            return pin
        await self.move_user(user, src)
        return stored.kernel                            # re-pinned if its files moved

    async def evacuate(self, src) -> None:
        """A kernel was first seen draining: move every user with stored responses on it."""
        users = self.store.users_pinned_to(src.index)
        log.info("%s is draining: moving the KV files of %d users with stored responses there", src, len(users))
        for user in users:
            try:
                await self.move_user(user, src)
            except Exception as e:                      # one user's failure must not stop the others'
                log.warning("moving %s's KV files off %s failed: %s: %s", user, src, type(e).__name__, e)

    async def move_user(self, user: str, src):
        """Move ``user``'s prefix-cache files off ``src`` (out of rotation) to another live
        kernel and pin their stored responses there; that kernel, or None if no file moved."""
        d = self.cache_dir(user)
        if d is None:
            return None
        async with self._locks.setdefault((user, src.index), asyncio.Lock()):
            if user not in self.store.users_pinned_to(src.index):
                return None                             # moved meanwhile by another request
            if src.state == "draining":
                dst = self._least([k for k in self.kernels.live() if k is not src])
                n = 0 if dst is None else await self.copy_dir(src, dst, user, d)
            else:
                peer = (src.stats or {}).get("durable_id")
                dst = self._least([k for k in self.kernels.live() if peer and peer in (k.stats or {}).get("peers", [])])
                n = 0 if dst is None else await self.adopt(peer, src, dst, user, d)
            if not n:
                return None
            moved = self.store.repin(user, src.index, dst.index)
            log.info("moved %d KV files of %s from %s to %s; %d stored responses follow", n, user, src, dst, moved)
            return dst

    def _least(self, ks: list):
        return min(ks, key=lambda k: self.kernels.table.in_flight[k.index], default=None)

    async def copy_dir(self, src, dst, user: str, directory: str) -> int:
        """Export each file of ``user`` in ``directory`` on ``src`` and import it on ``dst``
        (one already there is kept); how many are on ``dst`` now."""
        try:
            entries = (await src.link.request(user, {"op": "kv_ls", "path": directory}))["entries"]
        except (KernelRefused, KernelUnavailable) as e:
            log.warning("cannot list %s on %s for %s: %s", directory, src, user, e)
            return 0
        n = 0
        for e in entries:
            if e.get("type") != "file" or e.get("owner") != user:
                continue
            path = f"{directory}/{e['name']}"
            try:
                blob = await src.link.export(user, path)
                await dst.link.import_(user, path, blob)
                self.moved_files += 1
                self.moved_bytes += len(blob)
                n += 1
            except KernelRefused as x:
                if x.code == "EEXIST":
                    n += 1
                    continue
                log.warning("moving %s from %s to %s failed: %s", path, src, dst, x)
                if x.code in ("EDQUOT", "ENOSPC"):
                    break
            except KernelUnavailable as x:
                log.warning("moving %s from %s to %s failed: %s", path, src, dst, x)
                break
        return n

    async def adopt(self, peer: str, src, dst, user: str, directory: str) -> int:
        """Have ``dst`` adopt the durable files ``user`` owned below ``directory`` that the dead
        ``src`` left in its durable directory (id ``peer``); how many it took."""
        try:
            r = await dst.link.request(user, {"op": "kv_adopt", "peer": peer, "dir": directory})
        except (KernelRefused, KernelUnavailable) as e:
            log.warning("%s could not adopt %s's files of %s: %s", dst, src, user, e)
            return 0
        for path, why in r.get("refused") or []:
            log.warning("%s did not adopt %s: %s", dst, path, why)
        return len(r.get("adopted") or [])
