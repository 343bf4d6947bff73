"""Chain files: KV files found by the hash chain of their token blocks (block-level prefix caching).

A **chain file** is a named KV file that carries *keys*: key i names blocks
0..i of the tokens its writer feeds it, ``block`` tokens a block (a multiple of
the page size, so that a prefix of whole blocks is whole pages, shared, never
copied).  The writer computes the keys as a hash chain, key(i) = H(key(i-1),
tokens of block i), so that equal keys mean equal prefixes -- for writers one
trusts: KVFS holds no token ids and cannot check a key against the KV.  Of its
keys, the first ``min(len(keys), length // block)`` blocks are *written*; the
rest are *promised*: declared by a writer still feeding them.

    find(who, dir, keys, block, limit, trust) -> Match    the longest chain, now and promised
    open(who, dir, match, keys, block, claim, mode, ttl)  the matched prefix as a new file
    publish(who, h, keys, block)                          make a named file a chain file (or re-key it)
    ChainWait(...).poll(now)                              a lookup waiting for promised blocks

**Which files count** for ``who``: in the directory, with the same ``block``,
owned by ``who`` or a user in ``trust``, readable by ``who``, writable by
nobody but their owner, their positions 0..n-1 for the blocks taken.  Anything
else is passed over: a planted file is never forked.

**Promises and waiting.**  A file is *being written* while the process that
published its keys (its writer) holds a read-write handle on it and its length
has grown within `STALL_S` seconds (as lookups observe it); a lookup whose
longest match is promised by such a file may wait for it (`ChainWait`): it
ends when the blocks are written, the writer closes or dies, the file stalls
or the caller's deadline passes, and then forks whatever is written by then
(a waiter that gives up still reuses the writer's progress).  A process never
waits for its own promises.  So a waiter holds nothing others wait for, no
wait outlives its deadline, and a writer that never finishes delays others by
at most `STALL_S` after its last progress.

**Claims.**  ``open(claim=True)`` makes the result a new chain file in the
directory (a name of 16 random hex digits: names say nothing of the prompt),
promised by the caller, advised ``cache`` (deleted when memory is short and
nobody has it open) and expiring after ``ttl``; a claim the caller may not
make (no write permission, no inode or page-reference room even after
removing its own least recently used unopened chain files) gives an
anonymous file instead.  When a writer closes its chain file, the same
owner's unopened chain files whose keys are a prefix of its keys are removed
(they hold nothing the new file does not: a conversation keeps one file, not
one per turn).

**Index**, per directory: key -> owner -> {ino: inode} (newest last), and
last key -> {ino: inode}; kept up to date by KVFS on unlink, rename (a chain
file moved elsewhere loses its keys) and truncate (keys past the new length
are dropped: a rewritten block never keeps its old key).  A file's keys are at
most its pages, so the index is bounded by the page-reference quota.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

from .errors import AlreadyExists, InvalidArgument, InvalidPath, PermissionDenied, QuotaExceeded
from .namespace import Directory, Inode, Principal, may

STALL_S = 10.0          # a promise whose file has not grown for this long is not waited for
MAX_KEYS = 1 << 14      # keys of one file
EVICT_TRIES = 32        # own unopened chain files removed at most to make room for one claim


@dataclass(eq=False)
class Chain:
    """The chain of one file: its directory, block size, keys and writer."""

    dir: Directory
    block: int
    keys: list
    writer: int                             # the pid that published the keys (0: none)
    ttl: Optional[float] = None             # a hit by its owner renews its expiry by this much
    seen: tuple = (0, 0.0)                  # (length, monotonic time) when a lookup last saw it grow
    checked: int = 0                        # leading positions verified to be 0, 1, 2, ...


@dataclass
class Match:
    """A lookup's result: the longest chain written now (``source``: ``blocks``
    blocks of it) and the longest promised beyond it (``pending``: ``promised``)."""

    source: Optional[Inode] = None
    blocks: int = 0
    pending: Optional[Inode] = None
    promised: int = 0


@dataclass
class ChainStats:
    lookups: int = 0            # results opened
    hit_blocks: int = 0         # blocks they forked
    claims: int = 0
    waits: int = 0              # lookups that waited for promised blocks
    wait_s: float = 0.0
    prunes: int = 0             # redundant chain files removed


class Chains:
    """The chain index of one KVFS (``fs.chains``)."""

    def __init__(self, fs, delete: Callable[[Inode], None]):
        """``fs``: the KVFS whose files these are; ``delete(inode)``: unlink a file."""
        self.fs, self.delete = fs, delete
        self.keys: dict[Directory, dict[bytes, dict[str, dict[int, Inode]]]] = {}
        self.last: dict[Directory, dict[bytes, dict[int, Inode]]] = {}
        self.stats = ChainStats()
        self.files = 0                                   # chain files now

    def counters(self) -> dict:
        """The counters, named for KVFS's stats: chain_lookups, chain_hit_blocks, ..."""
        c = self.stats
        return {"chain_files": self.files,
                "chain_lookups": c.lookups, "chain_hit_blocks": c.hit_blocks, "chain_claims": c.claims,
                "chain_waits": c.waits, "chain_wait_s": round(c.wait_s, 3), "chain_prunes": c.prunes}

    # ================================================================== lookups
    def find(self, who: Principal, d: Directory, keys: Sequence[bytes], block: int, limit: int,
             trust: Iterable[str] = (), now: Optional[float] = None) -> Match:
        """The longest chain of ``keys[:limit]`` written in ``d`` by ``who`` or a
        ``trust``ed user, and the longest promised one beyond it (see the module
        docstring for which files count)."""
        m = Match()
        idx = self.keys.get(d)
        if not idx:
            return m
        now = time.monotonic() if now is None else now
        users = list(dict.fromkeys([who.user, *trust]))
        for j in range(min(limit, len(keys)), 0, -1):          # j blocks, longest first
            if m.blocks >= j:
                break
            owners = idx.get(keys[j - 1])
            if not owners:
                continue
            for u in users:
                for inode in reversed(list(owners.get(u, {}).values())):
                    c = inode.chain
                    if c.block != block or not self._usable(who, inode):
                        continue
                    got = min(self.written(inode), j)
                    if got > m.blocks:
                        m.source, m.blocks = inode, got
                    if got == j:
                        break
                    if m.promised < j and self._promising(who, inode, now):
                        m.pending, m.promised = inode, j
                if m.blocks >= j:
                    break
        if m.promised <= m.blocks:
            m.pending, m.promised = None, 0
        return m

    def written(self, inode: Inode) -> int:
        """Blocks of the file's chain that are written (positions 0..n-1 checked)."""
        c = inode.chain
        n = min(len(c.keys), inode.length // c.block)
        want = n * c.block
        if c.checked < want:
            pos = inode.positions
            k = c.checked
            while k < want and pos[k] == k:
                k += 1
            c.checked = k
        return min(n, c.checked // c.block)

    def writing(self, inode: Inode) -> bool:
        """Whether the file's writer still holds a read-write handle on it."""
        c = inode.chain
        return bool(c.writer) and any(h.inode is inode and h.writable for h in self.fs.handles.of_pid(c.writer))

    # ================================================================== the result file
    def open(self, who: Principal, d: Directory, m: Match, keys: Sequence[bytes], block: int,
             claim: bool = False, mode: Optional[int] = None, ttl: Optional[float] = None) -> tuple[int, bool]:
        """A new file (read-write) holding the first ``m.blocks * block`` tokens
        of ``m.source`` (pages shared): with ``claim``, a chain file in ``d`` with
        ``keys``, promised by ``who`` (see Claims); else anonymous.  Returns
        (handle, claimed).  The source's use is recorded (LRU; a hit on one's
        own file renews its expiry)."""
        n = m.blocks * block
        hid = None
        if claim and keys and may(who, d, "w"):
            hid = self._claim(who, d, m.source, n, mode)
        claimed = hid is not None
        if hid is None:
            try:
                hid = self._copy(who, m.source, n, None, None)
            except QuotaExceeded:                                # no room for the shared pages: start afresh
                hid = self.fs.create(who)
                n = 0
        if claimed:
            self.stats.claims += 1
            fs = self.fs
            self._attach(fs.handles[hid].inode, d, block, list(keys), who.pid, ttl)
            fs.advise(who, hid, "cache")
            if ttl is not None:
                fs.advise(who, hid, "expire", ttl)            # (0: gone at once, its keys with it)
        if m.source is not None and n:
            self._used(who, m.source)
        self.stats.lookups += 1
        self.stats.hit_blocks += n // block
        return hid, claimed

    def publish(self, who: Principal, hid: int, keys: Sequence[bytes], block: int,
                ttl: Optional[float] = None) -> None:
        """Make the named file ``hid`` (a read-write handle) a chain file with
        ``keys`` in its directory, promised by ``who`` (replacing any keys it
        had; no keys: it is no chain file any more)."""
        h = self.fs.handles.of(who, hid)
        inode = h.inode
        if not h.writable:
            raise PermissionDenied(f"KV handle {hid} is read-only: only a writer publishes keys")
        if not inode.linked:
            raise InvalidArgument("only a named KV file can be a chain file (anonymous files are never found)")
        check_block(block, self.fs.page_size)
        if len(keys) > MAX_KEYS:
            raise InvalidArgument(f"a chain file has at most {MAX_KEYS} keys, got {len(keys)}")
        old = inode.chain
        if old is not None:
            ttl = old.ttl if ttl is None else ttl
            self.forget(inode)
        if keys:
            self._attach(inode, inode.parent, block, list(keys), who.pid, ttl)

    def closed(self, inode: Inode, pid: int) -> None:
        """A handle of ``pid`` on the chain file closed: if that was its writer's
        last read-write one, prune the files it makes redundant."""
        c = inode.chain
        if c is not None and c.writer == pid and inode.linked and not self.writing(inode):
            c.writer = 0
            self._prune(inode)

    # ================================================================== KVFS's hooks
    @staticmethod
    def record(inode: Inode) -> Optional[dict]:
        """The file's chain as a durable or exported file keeps it (None: no chain file)."""
        c = inode.chain
        return None if c is None else {"block": c.block, "keys": [k.hex() for k in c.keys], "ttl": c.ttl}

    def restore(self, inode: Inode, rec: Optional[dict]) -> None:
        """Make a file just linked (restored, imported, adopted) the chain file ``rec``
        (`record`'s, checked by the store) says, with no writer; no record: nothing."""
        if rec and rec["keys"] and inode.linked:
            self._attach(inode, inode.parent, rec["block"], [bytes.fromhex(k) for k in rec["keys"]], 0,
                         rec.get("ttl"))

    def forget(self, inode: Inode) -> None:
        """The file leaves the index (unlinked, moved, or re-keyed)."""
        c = inode.chain
        if c is None:
            return
        inode.chain = None
        self.files -= 1
        idx, last = self.keys.get(c.dir, {}), self.last.get(c.dir, {})
        for k in c.keys:
            owners = idx.get(k)
            if owners is None:
                continue
            files = owners.get(inode.owner)
            if files is not None:
                files.pop(inode.ino, None)
                if not files:
                    del owners[inode.owner]
            if not owners:
                del idx[k]
        if c.keys:
            ends = last.get(c.keys[-1])
            if ends is not None:
                ends.pop(inode.ino, None)
                if not ends:
                    del last[c.keys[-1]]
        if not idx:
            self.keys.pop(c.dir, None)
            self.last.pop(c.dir, None)

    def cut(self, inode: Inode, n: int) -> None:
        """The file was truncated to ``n`` tokens: keys of blocks past it go."""
        c = inode.chain
        if c is None:
            return
        c.checked = min(c.checked, n)
        keep = n // c.block
        if keep < len(c.keys):
            d, block, keys, writer, ttl = c.dir, c.block, c.keys[:keep], c.writer, c.ttl
            self.forget(inode)
            if keys:
                self._attach(inode, d, block, keys, writer, ttl)

    # ================================================================== helpers
    def _usable(self, who: Principal, inode: Inode) -> bool:
        return inode.linked and may(who, inode, "r") and not inode.mode & 0o022

    def _promising(self, who: Principal, inode: Inode, now: float) -> bool:
        """Whether a lookup of ``who`` may wait for the file's promised blocks."""
        c = inode.chain
        if c.writer == who.pid or not self.writing(inode):
            return False
        if inode.length != c.seen[0]:
            c.seen = (inode.length, now)
            return True
        return now - c.seen[1] < STALL_S

    def _attach(self, inode: Inode, d: Directory, block: int, keys: list, writer: int,
                ttl: Optional[float]) -> None:
        inode.chain = Chain(d, block, keys, writer, ttl, (inode.length, time.monotonic()))
        self.files += 1
        idx = self.keys.setdefault(d, {})
        for k in keys:
            idx.setdefault(k, {}).setdefault(inode.owner, {})[inode.ino] = inode
        self.last.setdefault(d, {}).setdefault(keys[-1], {})[inode.ino] = inode

    def _claim(self, who: Principal, d: Directory, src: Optional[Inode], n: int, mode) -> Optional[int]:
        """A new named file in ``d`` holding ``src``'s first ``n`` tokens; None
        when there is no room for it, even after removing ``who``'s least
        recently used unopened chain files."""
        for _ in range(EVICT_TRIES + 1):
            path = f"{d.path}/{secrets.token_hex(8)}"
            try:
                return self._copy(who, src, n, path, mode)
            except AlreadyExists:                                # a name drawn twice: draw again
                continue
            except QuotaExceeded:
                if not self._evict_one(who.user, keep=src):
                    return None
            except (PermissionDenied, InvalidPath):
                return None
        return None

    def _copy(self, who: Principal, src: Optional[Inode], n: int, path, mode) -> int:
        if src is None or n == 0:
            return self.fs.create(who, path, mode)
        return self.fs.data.prefix(who, src, n, path, mode)

    def _evict_one(self, user: str, keep: Optional[Inode]) -> bool:
        """Remove ``user``'s least recently used unopened chain file; whether there was one."""
        for inode in list(self.fs.memory.lru_cache.values()):
            if inode.owner == user and inode.chain is not None and inode.handles == 0 and inode.linked \
                    and inode is not keep:
                self.delete(inode)
                return True
        return False

    def _used(self, who: Principal, inode: Inode) -> None:
        """A lookup forked the file: most recently used; its owner's hit renews its expiry."""
        inode.atime = time.time()
        self.fs.memory.touch(inode)
        c = inode.chain
        if c.ttl is not None and inode.owner == who.user and inode.expire_at is not None:
            self.fs.renew(inode, c.ttl)

    def _prune(self, inode: Inode) -> None:
        """Remove the owner's unopened chain files in the same directory whose
        keys are a prefix of this file's written keys."""
        c = inode.chain
        last = self.last.get(c.dir, {})
        for k in c.keys[:self.written(inode)]:
            for other in list(last.get(k, {}).values()):
                oc = other.chain
                if other is inode or other.owner != inode.owner or other.handles or oc.block != c.block:
                    continue
                self.delete(other)
                self.stats.prunes += 1


@dataclass
class ChainWait:
    """A lookup that may wait for promised blocks (see the module docstring):
    `poll` gives the `Match` to open once it is done waiting, else None."""

    chains: Chains
    who: Principal
    d: Directory
    keys: Sequence[bytes]
    block: int
    limit: int
    trust: tuple
    deadline: float
    started: float = field(default_factory=time.monotonic)
    _watch: Optional[tuple] = None          # (promising file, its length) when last polled

    @property
    def waited(self) -> bool:
        """Whether a poll has answered "wait" (the lookup was parked)."""
        return self._watch is not None

    def poll(self, now: Optional[float] = None) -> Optional[Match]:
        now = time.monotonic() if now is None else now
        if self._watch is not None and now < self.deadline:    # nothing changed: still waiting
            inode, length = self._watch
            c = inode.chain
            if c is not None and inode.length == length and now - c.seen[1] < STALL_S \
                    and self.chains.writing(inode):
                return None
        m = self.chains.find(self.who, self.d, self.keys, self.block, self.limit, self.trust, now)
        if m.pending is not None and now < self.deadline:
            self._watch = (m.pending, m.pending.length)
            return None
        if self._watch is not None:
            self.chains.stats.waits += 1
            self.chains.stats.wait_s += now - self.started
        return m


def check_block(block, page_size: int) -> int:
    if not isinstance(block, int) or isinstance(block, bool) or block < page_size or block % page_size:
        raise InvalidArgument(f"block must be a multiple of the page size {page_size}, got {block!r}")
    return block
