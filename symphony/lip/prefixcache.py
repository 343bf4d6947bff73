"""Automatic prefix caching as a library: every full block of every earlier prompt, found by its hash chain.

    pc = PrefixCache("/home/alice/serve-cache", block=16, user="alice")
    f, n = pc.open(prompt, limit=len(prompt) - 1, promise=len(prompt))   # one system call
    ...                                                  # pred(f, prompt[n:]) ...: compute only the rest
    pc.publish(f, prompt + answer, upto=len(f))         # the answer's full blocks too (a conversation's next turn)
    f.close()

**Keys.**  A prompt is cut into blocks of ``block`` tokens (a multiple of the
kernel's page size: a prefix of whole blocks is whole pages, shared, never
copied).  Block k's key is BLAKE2b-128 of block k-1's key and block k's token
ids (the first chains from a salt), so a key names every token before it:
equal keys, equal prefixes.  As in vLLM's automatic prefix caching, only full
blocks are cached, and at most ``limit`` tokens are reused (a prompt's last
token is always computed: its distribution is the answer's first); a prompt's
blocks past the first ``abi.MAX_KEYS_PER_CALL`` (2048: 32,768 tokens at 16 a
block) are not cached.

**One call to look up and to claim.**  `open` is one ``kv.lookup`` (see
symphony.lip.runtime): the kernel finds the longest chain of the prompt's keys
among the chain files of the directory that the user or a ``trust``ed user
wrote (writable by nobody else; anything else, planted or half-written, is
passed over), forks it copy-on-write, and makes the result itself a chain
file promising the keys of the first ``promise`` tokens: requests that arrive
while it is being computed wait for it (at most ``wait`` seconds, less if
its writer stops making progress or ends) and fork it, instead of computing
the same prefix again -- a burst of requests with one system prompt computes
it once.  The file is a cache file (the memory manager deletes it when
memory is short and nobody has it open) expiring after ``ttl`` seconds
unless a hit of the user's own renews it; its name is random (it says nothing
of the prompt).  `publish` adds the blocks fed after the prompt (the
answer), so the conversation's next turn finds prompt and answer.  The kernel
keeps one file per distinct prompt: when a request's file is done, the user's
files whose keys are a prefix of its keys are removed.

**Failures never fail the request**: a directory that cannot be made or
written gives an unclaimed (anonymous) result; a full inode or page-reference
quota makes the kernel remove the user's least recently used unopened cache
files first; the page quota is made room for by the kernel the same way.  Only
a directory that is no valid KVFS path raises (InvalidPath).

**Durable.**  With ``durable``, each `publish` also syncs the file to the
kernel's durable directory, its keys with it: another kernel that adopts it
(``--peer-durable-dir``) finds the conversation by the same lookup.

**Shared and private.**  Without other ``trust``ed users the files are
private (0600, in the user's own directory); with them, readable by every
user (0644), so that the trusted users' lookups may fork them.
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

from symphony.ipc import abi

from .errors import AlreadyExists, InvalidPath, NotADirectory, NotFound, PermissionDenied, SyscallError
from .runtime import KVFile, kv

__all__ = ["PrefixCache"]


class PrefixCache:
    """Block-level prefix caching in directory ``directory`` (see the module docstring)."""

    def __init__(self, directory: str, *, block: int, user: str, trust: Iterable[str] = (),
                 ttl: Optional[float] = 3600.0, wait: float = 30.0, salt: bytes = b"symphony-prefix-v2",
                 durable: bool = False):
        self.dir = directory.rstrip("/") or "/"
        self.durable = durable              # sync the file, keys and all, each time it is published
        self.block, self.ttl, self.wait, self.user = int(block), ttl, float(wait), user
        self.trust = sorted(set(trust) - {user})
        self.mode = 0o644 if self.trust else None
        self.root = hashlib.blake2b(salt, digest_size=16).digest()
        self.claim = True
        self._published = 0                 # blocks the claimed file's keys cover
        self._tokens: list = []
        self._chain: list[bytes] = []       # keys of the blocks of self._tokens

    # ------------------------------------------------------------ public API
    def open(self, tokens: Sequence[int], limit: int, promise: int) -> tuple[KVFile, int]:
        """(a new read-write file holding the longest cached prefix of ``tokens``,
        at most ``limit`` tokens, whole blocks; its length).  Unless it cannot,
        the file promises the blocks of ``tokens[:promise]`` (the caller feeds
        them next): others wait for them.  InvalidPath: a bad directory."""
        n = min(min(promise, len(tokens)) // self.block, abi.MAX_KEYS_PER_CALL)
        if n == 0:
            return kv.create(), 0
        keys = b"".join(self.keys(tokens, n))
        for attempt in range(2):
            try:
                f = kv.lookup(self.dir, keys, self.block, limit=max(0, limit) // self.block, wait=self.wait,
                              claim=self.claim, trust=self.trust, mode=self.mode, ttl=self.ttl)
                self._published = n if f.path else 0
                return f, len(f)
            except NotFound:
                if attempt or not self._mkdirs():
                    break
            except (PermissionDenied, NotADirectory):
                break
        self.claim = False
        return kv.create(), 0

    def publish(self, f: KVFile, tokens: Sequence[int], upto: int) -> bool:
        """Extend ``f``'s keys to the full blocks of ``tokens[:upto]`` (``f`` holds
        them), if ``f`` is a claimed chain file; whether it did.  With ``durable``,
        then sync the claimed file (keys and all), new blocks or not."""
        n = min(min(upto, len(tokens)) // self.block, abi.MAX_KEYS_PER_CALL)
        if f.path is None:
            return False
        done = False
        if n > self._published:
            try:
                f.publish(b"".join(self.keys(tokens, n)), self.block, self.ttl)
                self._published, done = n, True
            except SyscallError:
                return False
        if self.durable:
            try:
                f.sync()                    # a kernel without a durable directory: not durable, the request goes on
            except SyscallError:
                pass
        return done

    def keys(self, tokens: Sequence[int], n: int) -> list[bytes]:
        """The keys of the first ``n`` blocks of ``tokens`` (the last ones' reused)."""
        B, chain = self.block, []
        k = min(n, len(self._chain))
        if k and list(tokens[:k * B]) == self._tokens[:k * B]:
            chain = self._chain[:k]
        prev = chain[-1] if chain else self.root
        arr = np.asarray(tokens[:n * B], dtype=np.int32)
        for i in range(len(chain), n):
            prev = hashlib.blake2b(prev + arr[i * B:(i + 1) * B].tobytes(), digest_size=16).digest()
            chain.append(prev)
        if len(chain) >= len(self._chain):
            self._tokens, self._chain = list(tokens[:n * B]), chain
        return chain

    # ------------------------------------------------------------ helpers
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
