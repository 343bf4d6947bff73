"""Automatic prefix caching as a library: KV files named by the hash of the tokens they hold.

    pc = PrefixCache("/home/alice/serve-cache", block=16, user="alice", specials=tok.special_ids)
    hit, n = pc.lookup(prompt, limit=len(prompt) - 1)   # a trusted read-only file of prompt[:n], or None
    f = hit.fork() if hit else kv.create()              # compute only prompt[n:]
    ...                                                  # pred(f, prompt[n:]) ...
    pc.save(f, prompt, after=n, upto=len(f))            # checkpoints of the new full blocks

**Names.** A prompt is cut into blocks of ``block`` tokens (the kernel's page
size).  Block k's digest is BLAKE2b-128 of block k-1's digest and block k's
tokens (the first one chains from a salt), so it names every token before it;
the checkpoint of the first p tokens is ``DIR/<hex digest>``, the digest of
block p/block - 1 when p is a multiple of the block, else of that chain and
the p % block tokens after it.

**Where checkpoints go** (a file per block would spend the 10,000 named files
a user may have):

* right before every special token (a chat template's message openers and
  closers): so exactly at the end of each message, of a system prompt, of an
  assistant answer;
* every ``grid`` blocks (long text without special tokens);
* the end of what is saved (the prompt; the prompt + answer).

A checkpoint at a block boundary shares whole pages with the file it was cut
from; one elsewhere also holds a copy of its last, partial page (one page
each).  A repeated system prompt ends at a special token; a conversation's
next turn is the previous prompt + answer (ending exactly where the answer's
closer now stands) + a new message: both find a checkpoint right before their
new tokens, and compute nothing of the old ones (but the answer's last token
when it was cut by max_tokens: a lookup also probes one token before each
special token).

**Lookup** searches the prompt's candidate boundaries (the same rule) from the
top: it probes the last, then 1, 2, 3, 5, 9, ... boundaries lower until a
checkpoint is there, then binary-searches between that one and the miss above
it (checkpoints of one prefix are made together, so where a boundary has one
the boundaries below it normally have one too; a hole, such as a checkpoint
the memory manager dropped, costs reuse, never correctness).  The next turn of
a conversation or a repeated prompt finds its checkpoint within the first few
probes; a cold prompt with C boundaries costs ~log2(C) + 1.  A probe is one
``kv.stat`` (no handle); the winner is opened read-only and checked again on
the handle.  A file counts only if it is trustworthy: owned by the running
user or a user in ``trust``, writable by nobody else, holding exactly the p
tokens its name promises, at positions 0..p-1.  Anything else (missing,
dropped by the memory manager, planted, half-written) is a miss: it is never
forked.

**Saving** is ``f.extract([[0, p]], path)`` (shares f's pages, computes
nothing) at each candidate boundary above what the lookup found, then
``advise("cache")`` (the memory manager may delete it while nobody has it open:
a later lookup misses) and ``advise("expire", ttl)``, renewed on each hit of
one's own file, so that unused checkpoints leave the namespace.  With
``durable``, every checkpoint made is also synced to the kernel's durable
directory (each holds its whole prefix: a conversation's next turn may fork
any of them), so that another kernel can adopt them if this one dies.  Two requests
making the same checkpoint at once is fine (AlreadyExists); a full quota or a
refused directory stops saving for this request (the request itself never
fails); on a full quota (named files, pages or page references) the user's own
checkpoints in the directory are removed (`purge`) so that the cache cannot
keep the user from working.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

from .errors import (AlreadyExists, InvalidArgument, InvalidPath, NoSpace, NotADirectory, NotFound,
                     PermissionDenied, QuotaExceeded, SyscallError)
from .runtime import KVFile, kv

__all__ = ["PrefixCache"]


class PrefixCache:
    """KV checkpoints of token prefixes in directory ``directory`` (see the module docstring).

    ``trust``: users whose checkpoints are used besides ``user`` (the running
    user); with any, new checkpoints are readable by everyone (mode 0644),
    otherwise private (0600).  ``specials``: token ids that mark boundaries."""

    def __init__(self, directory: str, *, block: int, user: str, trust: Iterable[str] = (),
                 specials: Iterable[int] = (), grid: int = 32, ttl: Optional[float] = 3600.0,
                 salt: bytes = b"symphony-prefix-v1", durable: bool = False):
        self.dir = directory.rstrip("/") or "/"
        self.durable = durable                # sync every checkpoint made (kv_sync)
        self.block, self.grid, self.ttl, self.user = int(block), int(grid), ttl, user
        self.trust = frozenset(trust) | {user}
        self.mode = 0o644 if set(trust) - {user} else None
        self.specials = np.array(sorted(set(specials)), dtype=np.int64)
        self.root = hashlib.blake2b(salt, digest_size=16).digest()
        self.saving = True
        self._prompt: list = []
        self._chain: list[bytes] = []      # digests of the blocks of self._prompt

    # ------------------------------------------------------------ public API
    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[Optional[KVFile], int]:
        """The longest trusted checkpoint of ``tokens[:p]``, p <= ``limit``: (an open
        read-only handle, p), or (None, 0).  The caller forks and closes it.
        InvalidPath: the directory is not a valid KVFS path."""
        self._prompt = list(tokens)
        self._chain = self._digests(self._prompt, len(self._prompt) // self.block)
        cands = self.candidates(self._prompt, limit, lookup=True)
        top = len(cands) - 1
        while top >= 0:
            best = self._search(cands, top)
            if best < 0:
                break
            p = cands[best]
            try:
                f = kv.open(self.path(self._prompt, p))
                st = f.stat()                                # the file this handle holds, not the path
            except SyscallError:
                top = best - 1
                continue
            if self._good(st, p):
                if st["owner"] == self.user and self.ttl:
                    _quiet(f.advise, "expire", self.ttl)     # in use: keep it longer
                return f, p
            f.close()
            top = best - 1
        return None, 0

    def save(self, f: KVFile, tokens: Sequence[int], *, after: int, upto: int) -> int:
        """Checkpoints of ``f`` (which holds ``tokens[:upto]`` at least) at the
        candidate boundaries in (``after``, ``upto``]; returns how many were made."""
        made = 0
        for p in self.candidates(tokens, upto):
            if p <= after or not self.saving:
                continue
            made += self._checkpoint(f, self.path(tokens, p), p, sync=self.durable)
        return made

    def candidates(self, tokens: Sequence[int], limit: int, lookup: bool = False) -> list[int]:
        """The prefix lengths in (0, ``limit``] where checkpoints of ``tokens`` go;
        with ``lookup``, also one token before each special token: an answer
        cut by max_tokens was saved without its last token (never fed), and
        its next turn then computes just that one again."""
        B, limit = self.block, min(limit, len(tokens))
        arr = np.asarray(tokens[:limit], dtype=np.int64)
        at = np.flatnonzero(np.isin(arr, self.specials)) if self.specials.size else np.zeros(0, int)
        ps = {int(i) for i in at}                            # right before each special token
        if lookup:
            ps.update(int(i) - 1 for i in at)
        ps.update(range(B * self.grid, limit + 1, B * self.grid))
        ps.add(limit)
        return sorted(p for p in ps if 0 < p <= limit)

    def path(self, tokens: Sequence[int], p: int) -> str:
        """The name of the checkpoint of ``tokens[:p]``."""
        full, rest = divmod(p, self.block)
        chain = self._digests(tokens, full)
        digest = chain[-1] if chain else self.root
        if rest:                                             # the chain, then the partial block
            tail = np.asarray(tokens[full * self.block:p], dtype=np.int32).tobytes()
            digest = hashlib.blake2b(digest + tail, digest_size=16).digest()
        return f"{self.dir}/{digest.hex()}"

    def purge(self) -> int:
        """Remove the running user's checkpoints in the directory; returns how many."""
        n = 0
        try:
            entries = kv.list(self.dir)
        except SyscallError:
            return 0
        for e in entries:
            if e.get("type") == "file" and e.get("owner") == self.user:
                try:
                    kv.remove(f"{self.dir}/{e['name']}")
                    n += 1
                except SyscallError:
                    pass
        return n

    # ------------------------------------------------------------ helpers
    def _digests(self, tokens: Sequence[int], n: int) -> list[bytes]:
        """Digests of the first ``n`` blocks of ``tokens`` (reusing the prompt's)."""
        B, chain = self.block, []
        k = min(n, len(self._chain))
        if k and list(tokens[:k * B]) == self._prompt[:k * B]:
            chain = self._chain[:k]
        prev = chain[-1] if chain else self.root
        arr = np.asarray(tokens[:n * B], dtype=np.int32)
        for i in range(len(chain), n):
            prev = hashlib.blake2b(prev + arr[i * B:(i + 1) * B].tobytes(), digest_size=16).digest()
            chain.append(prev)
        return chain

    def _search(self, cands: list, top: int) -> int:
        """The index of the longest good-looking checkpoint in ``cands[:top + 1]``
        (-1: none): probes top, top-1, top-2, top-3, then twice as far each time,
        down to 0, until one is there, then a binary search between it and the miss
        above it.  (The first few one by one: a conversation's last checkpoint is a
        few boundaries below its next prompt's top, and may be the only one there,
        as when only each turn's last checkpoint was made durable and moved.)"""
        ok = lambda i: self._good(kv_stat(self.path(self._prompt, cands[i])), cands[i])
        miss, i, step, tries = top + 1, top, 1, 0
        while not ok(i):
            if i == 0:
                return -1
            tries += 1
            miss, i = i, max(0, i - step)
            step = step * 2 if tries >= 3 else 1
        lo, hi = i, miss - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _good(self, st: Optional[dict], p: int) -> bool:
        return (st is not None and st.get("type") == "file" and st["owner"] in self.trust
                and not st["mode"] & 0o022 and st["length"] == p and st.get("next_position") == p)

    def _checkpoint(self, f: KVFile, path: str, p: int, sync: bool = False) -> int:
        for attempt in range(2):
            try:
                g = f.extract([[0, p]], path=path, mode=self.mode)
            except AlreadyExists:
                return 0                                     # another request made it: fine
            except NotFound:
                if attempt or not self._mkdirs():
                    self.saving = False
                    return 0
                continue
            except QuotaExceeded:
                self.saving = False
                self.purge()                                 # any quota (files, pages, page references):
                return 0                                     # the cache must not keep the user from working
            except (NoSpace, PermissionDenied, InvalidPath, InvalidArgument, NotADirectory):
                self.saving = False
                return 0
            with g:
                _quiet(g.advise, "cache")
                if self.ttl:
                    _quiet(g.advise, "expire", self.ttl)
                if sync:                                     # a kernel without a durable directory: not
                    _quiet(g.sync)                           # durable, and the request goes on
            return 1
        return 0

    def _mkdirs(self) -> bool:
        """Make the directory and its missing parents (system ones such as
        /home/<user> exist or are made by the kernel: their errors are ignored)."""
        parts = [p for p in self.dir.split("/") if p]
        for i in range(1, len(parts) + 1):
            try:
                kv.mkdir("/" + "/".join(parts[:i]), mode=0o755 if self.mode else None)
            except AlreadyExists:
                pass
            except SyscallError:
                if i == len(parts):
                    return False
        return True


def kv_stat(path: str) -> Optional[dict]:
    """stat, None for a missing or unreachable file; InvalidPath (a bad directory) is raised."""
    try:
        return kv.stat(path)
    except InvalidPath:
        raise
    except SyscallError:
        return None


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except SyscallError:
        pass
