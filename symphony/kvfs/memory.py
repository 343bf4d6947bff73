"""KVFS under memory pressure: cache files, pinned processes, reclaim,
whole-process suspension, and the counters.

`Memory` is a part of `fs.KVFS` (``fs.memory``; KVFS's methods of the same
names call it).  It owns the eviction order (the LRU lists by advice) and is
given in its constructor the pager, the quotas, how to find the files a
process has open and how to delete a cache file (both the namespace's), and
the kernel's ``evict_first`` and ``pinned``.  The kernel's level-2 memory
manager (on the syscall thread, between steps) uses this API to guarantee
each step its device pages *before* the step runs:

    need = sum(fs.device_need(who, h, n) for ...)    # pages the step will take
    fs.reclaim(need, protect=fs.pid_blocks(running)) # cache, drop_first, idle, blocked
    fs.suspend(pid, keep=shared_blocks)              # or suspend a whole LIP

Who may lose what, in order:
  * a **cache file** (advice "cache") that no handle has open is *deleted*
    (unlinked, its durable copy removed, its pages freed in every tier), least
    recently used first, before any other eviction; opening it later gives
    NotFound and its owner recomputes it;
  * drop_first (and expired) files are swapped out, then idle files (no
    handle open), least recently used first, then the files of blocked LIPs
    (``evict_first``);
  * files that a **pinned** pid (``KVFS(pinned=...)``: the running LIPs) has
    open are never page-evicted: a running LIP loses its pages only whole,
    by `suspend`;
  * "keep" files are never evicted.
A block counts as freed by deleting a cache file only when that file holds its
last reference (``ref == 1``).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Iterable, Iterator

from .errors import InvalidArgument, NoSpace
from .namespace import Block, Handles, Inode
from .pager import Pager
from .quota import Quotas

log = logging.getLogger("symphony.kvfs")


class Memory:
    """Who loses device pages, and when (see the module docstring)."""

    def __init__(self, pager: Pager, quotas: Quotas, handles: Handles,
                 delete: Callable[[Inode], None], evict_first: Callable[[], list[int]],
                 pinned: Callable[[], set[int]]):
        """``handles``: the open handles (whose files each process has open);
        ``delete(inode)``: unlink a cache file (its pages go with its last handle)."""
        self.pager, self.quotas = pager, quotas
        self.open_inodes, self.delete = handles.open_inodes, delete
        self.evict_first, self.pinned = evict_first, pinned
        # eviction order: least recently used first; "keep" files are in none
        self.lru_drop: "OrderedDict[int, Inode]" = OrderedDict()
        self.lru_normal: "OrderedDict[int, Inode]" = OrderedDict()
        self.lru_cache: "OrderedDict[int, Inode]" = OrderedDict()   # advice "cache": may be deleted
        self._lru_of = {"drop_first": self.lru_drop, "normal": self.lru_normal, "cache": self.lru_cache}

    def touch(self, inode: Inode) -> None:
        """The file was used (or its advice changed): last in its LRU list."""
        lru = self._lru_of.get(inode.advice)
        if lru is not None and lru.get(inode.ino) is inode:   # in its list already (a file in use): last
            lru.move_to_end(inode.ino)
            return
        self.forget(inode)
        if lru is not None:
            lru[inode.ino] = inode

    def forget(self, inode: Inode) -> None:
        """The file is gone (or "keep"): in no LRU list."""
        self.lru_drop.pop(inode.ino, None)
        self.lru_normal.pop(inode.ino, None)
        self.lru_cache.pop(inode.ino, None)

    # ================================================================== queries
    def stats(self) -> dict:
        """Counters since start: cache files dropped and their pages, pages and
        bytes swapped out / in, host->disk demotions, disk reads, whole-process
        suspensions; and the free pages / slots of each tier now."""
        s, p = self.pager.stats, self.pager
        return {"cache_drops": s.cache_drops, "cache_drop_pages": s.cache_drop_pages,
                "swap_out_pages": s.swap_outs, "swap_in_pages": s.swap_ins,
                "swap_out_bytes": s.swap_out_bytes, "swap_in_bytes": s.swap_in_bytes,
                "demotions": s.demotions, "disk_reads": s.disk_reads, "suspensions": s.suspensions,
                "cache_files": len(self.lru_cache),
                "device_pages_free": p.alloc.num_free, "device_pages": p.alloc.capacity,
                "host_slots_free": p.host_slots_free(), "host_slots": p.host_max,
                "host_slots_made": p.host_capacity,
                "disk_slots_free": p.free_slots() - p.host_slots_free(), "disk_slots": p.disk_pages}

    def pid_blocks(self, pids: Iterable[int]) -> set[int]:
        """Block ids of every file the processes ``pids`` have open."""
        return {b.id for inode in self.open_inodes(pids) for b in inode.blocks}

    def pid_device_pages(self, pid: int) -> int:
        """Device pages of the files ``pid`` has open (shared pages counted once)."""
        return len({b.id for i in self.open_inodes([pid]) for b in i.blocks if b.device >= 0})

    def pid_pages(self, pid: int) -> int:
        """Pages in every tier of the files ``pid`` has open (shared pages once)."""
        return len({b.id for i in self.open_inodes([pid]) for b in i.blocks})

    def resume_need(self, pid: int) -> int:
        """Device pages needed to bring back every file ``pid`` has open."""
        return len(self._pid_swapped(pid))

    def reclaimable(self, protect: Iterable[int] = frozenset()) -> int:
        """How many device pages `reclaim` could free now (not counting those
        already free), touching no pinned process's file and no block in
        ``protect``."""
        idle = any(i.handles == 0 for d in (self.lru_cache, self.lru_normal) for i in d.values())
        if not (idle or self.lru_drop or self.evict_first()):
            return 0                                   # nothing to reclaim: no walk of the pinned files
        protect = self._guarded(protect)
        freed = _deletable(self._droppable(), protect)[1]
        dropped = {b.id for b in freed if b.device >= 0}
        slots = sum(1 for b in freed if b.device < 0)
        swappable = {b.id for b in self._reclaim_victims(protect)} - dropped
        return len(dropped) + min(len(swappable), self.pager.free_slots() + slots)

    def cache_pages_by_user(self) -> dict[str, int]:
        """{user: pages charged to them that only unopened cache files hold}: room
        in their quota, since those files go before anything of theirs would."""
        out: dict[str, int] = {}
        for b in _cache_only(self._droppable()):
            out[b.user] = out.get(b.user, 0) + 1
        return out

    # ================================================================== actions
    def make_quota_room(self, user: str, n: int) -> int:
        """Delete ``user``'s unopened cache files (LRU) whose pages only such
        files hold and are charged to ``user``, until ``n`` more pages fit in
        their quota (or none is left); returns the pages freed."""
        lim = self.quotas.limit_for(user)
        if lim is None:
            return 0
        cache = [i for i in self._droppable() if i.owner == user]
        mine = {b.id for b in _cache_only(cache) if b.user == user}
        before = self.quotas.by_user[user]
        for inode in cache:
            if self.quotas.by_user[user] + n <= lim:
                break
            if any(b.id in mine for b in inode.blocks):
                self._drop_cache_file(inode)
        return before - self.quotas.by_user[user]

    def reclaim(self, n: int, protect: Iterable[int] = frozenset()) -> int:
        """Try to make ``n`` device pages free without touching the files of
        pinned processes or blocks in ``protect`` (block ids): delete unopened
        cache files (LRU), then swap out drop_first/expired files, idle files
        (LRU), the files of blocked LIPs (``evict_first``).  When host and disk
        are full, cache files there are deleted for slots; if still short,
        swaps are skipped (never raises for lack of room).  Returns the device
        pages free afterwards."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgument(f"reclaim needs a page count >= 0, got {n!r}")
        protect = self._guarded(protect)
        alloc = self.pager.alloc
        if alloc.num_free < n:
            self._drop_cache(n, protect)
        want = n - alloc.num_free
        if want > 0:
            batch, seen = [], set()
            for b in self._reclaim_victims(protect):
                if b.id not in seen:
                    seen.add(b.id)
                    batch.append(b)
                    if len(batch) == want:
                        break
            if self.pager.free_slots() < len(batch):
                self._slot_room(len(batch) - self.pager.free_slots(), protect)
            self.pager.swap_out(batch[:self.pager.free_slots()])
        return alloc.num_free

    def suspend(self, pid: int, keep: Iterable[int] = frozenset(), partial: bool = False) -> int:
        """Move every device block of every file ``pid`` has open to host/disk
        (demoting to disk as usual), except blocks in ``keep`` (those shared
        with running LIPs) and "keep" files.  Returns the device pages freed.
        If host and disk cannot take them all, even after deleting cache files
        there, raises `NoSpace` and changes nothing -- unless ``partial``: then
        as many as they can take go (the kernel's manager suspends a LIP whole
        as far as there is room: its calls are held all the same), and only
        no room at all raises."""
        keep = set(keep)
        blocks = list({b.id: b for i in self.open_inodes([_pid(pid)]) if i.advice != "keep"
                       for b in i.blocks if b.device >= 0 and b.id not in keep}.values())
        if not blocks:
            return 0
        short = len(blocks) - self.pager.free_slots()
        if short > 0:
            more = sum(1 for i in _deletable(self._droppable(), keep)[0]
                       for b in i.blocks if b.device < 0 and b.ref == 1)
            if more < short and partial and self.pager.free_slots() + more > 0:
                blocks = blocks[:self.pager.free_slots() + more]     # what the tiers can take
                short = len(blocks) - self.pager.free_slots()
            elif more < short:
                raise NoSpace(f"cannot suspend process {pid}: its {len(blocks)} device KV pages need "
                              f"host/disk slots; {self.pager.slots_report()}, and only {more} more "
                              f"from cache files")
            self._slot_room(short, keep)
        self.pager.swap_out(blocks)
        self.pager.stats.suspensions += 1
        log.debug("suspended process %d: %d KV pages off the device", pid, len(blocks))
        return len(blocks)

    def swap_in_pid(self, pid: int) -> int:
        """Bring every block of every file ``pid`` has open back to the device,
        reclaiming (never from pinned processes) for room; returns the pages
        brought in.  Raises `NoSpace`, changing nothing, if there is no room."""
        blocks = self._pid_swapped(pid)
        if not blocks:
            return 0
        free = self.reclaim(len(blocks), self.pid_blocks([pid]))
        if free < len(blocks):
            raise NoSpace(f"cannot bring back process {pid}: needs {len(blocks)} device KV pages, "
                          f"{free} free after reclaiming")
        self.pager.swap_in(blocks)
        return len(blocks)

    # ================================================================== helpers
    def make_room(self, n: int, protect: set[int]) -> None:
        """Leave ``n`` device pages free for a pred, extract, merge or load:
        delete unopened cache files first, then evict `_victims`; raises
        `NoSpace` saying what ran out."""
        if self.pager.alloc.num_free >= n:
            return
        guarded = self._guarded(protect)
        self._drop_cache(n, guarded)
        self.pager.make_room(n, self._victims(protect), lambda k: self._slot_room(k, guarded))

    def _victims(self, protect: set[int]) -> Iterator[Block]:
        """Device blocks to evict: drop-first files, then the files of blocked
        LIPs (`evict_first`), then open cache files and the rest, least recently
        used first; never "keep" files, never a file a pinned pid has open."""
        protect = self._guarded(protect)
        yield from _blocks(self.lru_drop.values(), protect)
        pids = self.evict_first()
        if pids:
            yield from _blocks(self.open_inodes(pids), protect)
        yield from _blocks(self.lru_cache.values(), protect)
        yield from _blocks(self.lru_normal.values(), protect)

    def _reclaim_victims(self, protect: set[int]) -> Iterator[Block]:
        """`reclaim`'s swap order: drop-first files, idle files (LRU), blocked LIPs' files."""
        yield from _blocks(self.lru_drop.values(), protect)
        idle = [i for d in (self.lru_cache, self.lru_normal) for i in d.values() if i.handles == 0]
        yield from _blocks(idle, protect)
        pids = self.evict_first()
        if pids:
            yield from _blocks(self.open_inodes(pids), protect)

    def _guarded(self, protect: Iterable[int]) -> set[int]:
        """``protect`` plus every block a pinned process has open."""
        pinned = self.pinned()
        return set(protect) | self.pid_blocks(pinned) if pinned else set(protect)

    def _pid_swapped(self, pid: int) -> list[Block]:
        return list({b.id: b for i in self.open_inodes([_pid(pid)])
                     for b in i.blocks if b.device < 0}.values())

    def _droppable(self) -> list[Inode]:
        """Cache files that may be deleted now (named, no handle open), LRU first."""
        return [i for i in self.lru_cache.values() if i.linked and i.handles == 0]

    def _drop_cache(self, n: int, protect: set[int]) -> None:
        """Delete unopened cache files holding device pages that only such files
        hold (a page several checkpoints share is freed with the last of them),
        LRU first, until ``n`` device pages are free."""
        cache, only = _deletable(self._droppable(), protect)
        freed = {b.id for b in only if b.device >= 0}
        for inode in cache:
            if self.pager.alloc.num_free >= n:
                return
            if any(b.id in freed for b in inode.blocks):
                self._drop_cache_file(inode)

    def _slot_room(self, k: int, protect: set[int]) -> None:
        """Delete unopened cache files holding host/disk slots, LRU first,
        until ``k`` more slots are free (or none is left to delete)."""
        goal = self.pager.free_slots() + k
        cache, only = _deletable(self._droppable(), protect)
        freed = {b.id for b in only if b.device < 0}
        for inode in cache:
            if self.pager.free_slots() >= goal:
                return
            if any(b.id in freed for b in inode.blocks):
                self._drop_cache_file(inode)

    def _drop_cache_file(self, inode: Inode) -> None:
        path = inode.path
        pages = sum(1 for b in inode.blocks if b.ref == 1)
        self.delete(inode)
        self.pager.stats.cache_drops += 1
        self.pager.stats.cache_drop_pages += pages
        log.info("KV cache file %s dropped to free memory (%d pages)", path, pages)


def _blocks(inodes: Iterable[Inode], protect: set[int]) -> Iterator[Block]:
    """Device blocks of ``inodes`` (a snapshot) outside ``protect``; none of a "keep" file."""
    for inode in list(inodes):
        if inode.advice != "keep":
            for b in inode.blocks:
                if b.device >= 0 and b.id not in protect:
                    yield b


def _cache_only(cache: list[Inode]) -> list[Block]:
    """The blocks that only the files ``cache`` reference: deleting them all frees
    these (files that share pages, such as prefix checkpoints, each hold a
    reference: a page is free with the last of them)."""
    seen: dict[int, list] = {}                   # block id -> [block, references from cache]
    for inode in cache:
        for b in inode.blocks:
            e = seen.get(b.id)
            if e is None:
                seen[b.id] = [b, 1]
            else:
                e[1] += 1
    return [b for b, n in seen.values() if n == b.ref]


def _deletable(cache: list[Inode], protect: set[int]) -> tuple[list[Inode], list[Block]]:
    """The cache files of ``cache`` that may be deleted without freeing a block in
    ``protect``, and the blocks only they hold (`_cache_only` of them).  A cache
    file that shares pages with a running LIP's open file (a prefix-cache entry
    and a request that forked it: every entry shares the system prompt's pages
    with every request) may go: those pages keep the open file's reference and
    stay.  Only a protected block that nothing but cache files references keeps
    every file holding it."""
    only = _cache_only(cache)
    unsafe = {b.id for b in only if b.id in protect}
    if not unsafe:
        return list(cache), only
    cache = [i for i in cache if not any(b.id in unsafe for b in i.blocks)]
    return cache, _cache_only(cache)


def _pid(pid) -> int:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise InvalidArgument(f"a process id is an int > 0, got {pid!r}")
    return pid
