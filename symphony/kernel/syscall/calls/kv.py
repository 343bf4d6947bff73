"""The KV file calls: KVFS's namespace and data operations, as the calling LIP.

Each handler reads its typed body and checks only what depends on KVFS's
state (handles, paths, permissions), in KVFS.  A durable sync and a listing
run in the slow lane a slice at a time (durable.py, slowlane.py), charged to
the LIP's user; the rest answer at once, but a lookup that waits for a
chain being written (kvfs/chains.py): it is parked, and one job in the slow
lane (`WAIT_LANE`, no user's) polls every parked lookup once a pass of the
syscall loop -- a step, or 50 ms when idle -- without taking a slice, and
answers each when its `ChainWait` is done (blocks written, writer gone,
stalled, deadline).  A parked lookup of a LIP that is no longer running is
dropped.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from symphony.ipc import abi
from symphony.kvfs import KVFS, InvalidArgument
from symphony.kvfs.chains import ChainWait, check_block

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.syscall.durable import list_job, sync_job
from symphony.kernel.syscall.proc import Serving
from symphony.kernel.syscall.slowlane import WAIT, SlowLane, Writer

log = logging.getLogger("symphony.syscalls")

WAIT_LANE = "\0chain-waits"      # the slow lane's key for the parked lookups' poller: no user name


@dataclass
class _Parked:
    """A lookup waiting for promised blocks."""

    lip: object
    slot: int
    cid: int
    body: object
    wait: ChainWait


class KvCalls:
    """KV file calls; given KVFS, the slow lane and its durable writer, and the answers."""

    OPS = {abi.KV_CREATE: "create", abi.KV_OPEN: "open", abi.KV_CLOSE: "close", abi.KV_REMOVE: "remove",
           abi.KV_FORK: "fork", abi.KV_TRUNCATE: "truncate", abi.KV_EXTRACT: "extract",
           abi.KV_MERGE: "merge", abi.KV_STAT: "stat", abi.KV_LIST: "list", abi.KV_ADVISE: "advise",
           abi.KV_RENAME: "rename", abi.KV_SYNC: "sync", abi.KV_MKDIR: "mkdir", abi.KV_RMDIR: "rmdir",
           abi.KV_LOOKUP: "lookup", abi.KV_PUBLISH: "publish"}
    # served while a step is on the device: metadata, and what moves no page (a listing runs in the
    # slow lane, between steps); the others wait for the step in flight, which writes pages (a lookup
    # forks and claims pages; a publish keeps its order among the calls that change KV files)
    ANYTIME = {abi.KV_CREATE, abi.KV_STAT, abi.KV_LIST, abi.KV_ADVISE, abi.KV_MKDIR}

    def __init__(self, fs: KVFS, slow: SlowLane, writer: Writer, answers: Answers):
        self.fs, self.slow, self.writer, self.answers = fs, slow, writer, answers
        self.parked: list[_Parked] = []       # lookups waiting for promised blocks
        self._polling = False                 # the poller is in the slow lane

    # ------------------------------------------------------------------ answered at once
    def create(self, lip, slot, cid, b, toks):
        return {"handle": self.fs.create(lip.principal, b.path, b.mode)}   # mode None: KVFS default (0600)

    def open(self, lip, slot, cid, b, toks):
        return self._opened(self.fs.open(lip.principal, b.path, b.mode))

    def close(self, lip, slot, cid, b, toks):
        self.fs.close(lip.principal, b.kv)
        return {}

    def remove(self, lip, slot, cid, b, toks):
        self.fs.remove(lip.principal, b.path)
        return {}

    def fork(self, lip, slot, cid, b, toks):
        return self._opened(self.fs.fork(lip.principal, b.kv, b.path, b.mode))

    def truncate(self, lip, slot, cid, b, toks):
        self.fs.truncate(lip.principal, b.kv, b.n)
        return {"length": self.fs.handles[b.kv].inode.length}

    def extract(self, lip, slot, cid, b, toks):
        return self._opened(self.fs.extract(lip.principal, b.kv, [list(r) for r in b.ranges], b.path, b.mode))

    def merge(self, lip, slot, cid, b, toks):
        return self._opened(self.fs.merge(lip.principal, b.kvs, b.path, b.mode))

    def stat(self, lip, slot, cid, b, toks):
        return self.fs.stat(lip.principal, b.kv if b.kv is not None else b.path)

    def advise(self, lip, slot, cid, b, toks):
        self.fs.advise(lip.principal, b.kv, b.hint, b.seconds)
        return {}

    def mkdir(self, lip, slot, cid, b, toks):
        self.fs.mkdir(lip.principal, b.path, b.mode)
        return {}

    def rmdir(self, lip, slot, cid, b, toks):
        self.fs.rmdir(lip.principal, b.path)
        return {}

    def rename(self, lip, slot, cid, b, toks):
        node = self.fs.rename(lip.principal, b.old, b.new, rewrite_durable=False)
        if getattr(node, "durable", False):                          # its copy under the new path, later
            self.slow.submit(lip.user, sync_job(self.fs, self.writer, node), _logged(node.path))
        return {}

    # ------------------------------------------------------------------ chain files
    def lookup(self, lip, slot, cid, b, toks):
        keys = _keys(toks, b.n_keys)
        who = lip.principal
        d = self.fs.listable(who, b.dir)                              # r on the directory
        check_block(b.block, self.fs.page_size)
        limit = b.n_keys if b.limit is None else min(b.limit, b.n_keys)
        trust = tuple(u for u in b.trust or () if u != who.user)
        w = ChainWait(self.fs.chains, who, d, keys, b.block, limit, trust, time.monotonic() + b.wait)
        m = w.poll()
        if m is None:
            self.parked.append(_Parked(lip, slot, cid, b, w))
            if not self._polling:
                self._polling = True
                self.slow.submit(WAIT_LANE, self._poller(), self._poller_done)
            return None
        return self._looked_up(lip, b, w, m)

    def publish(self, lip, slot, cid, b, toks):
        self.fs.chains.publish(lip.principal, b.kv, _keys(toks, b.n_keys), b.block, b.ttl)
        return {}

    def _looked_up(self, lip, b, w: ChainWait, m) -> dict:
        h, claimed = self.fs.chains.open(lip.principal, w.d, m, w.keys, b.block, b.claim, b.mode, b.ttl)
        inode = self.fs.handles[h].inode
        return {"handle": h, "length": inode.length, "path": inode.path, "claimed": claimed,
                "waited": round(time.monotonic() - w.started, 6) if w.waited else 0.0}

    def _poller(self):
        """The slow-lane job that answers parked lookups as they finish waiting."""
        while self.parked:
            still = []
            for p in self.parked:
                if p.lip.state != Serving.RUNNING:
                    continue                                          # killed or gone: nobody to answer
                try:
                    m = p.wait.poll()
                    if m is None:
                        still.append(p)
                        continue
                    self.answers.reply(p.lip, p.slot, p.cid, self._looked_up(p.lip, p.body, p.wait, m))
                except Exception as e:                                # its own error, for its caller
                    self.answers.error(p.lip, p.slot, p.cid, e)
            self.parked = still
            if still:
                yield WAIT

    def _poller_done(self, result, err) -> None:
        self._polling = False
        if err is not None:
            log.error("chain lookup poller failed: %s: %s", type(err).__name__, err)
        if self.parked:                                               # (it failed with lookups parked)
            self._polling = True
            self.slow.submit(WAIT_LANE, self._poller(), self._poller_done)

    # ------------------------------------------------------------------ in the slow lane
    def sync(self, lip, slot, cid, b, toks):
        inode = self.fs.sync_target(lip.principal, b.kv)             # its errors at once
        self._slow(lip, slot, cid, sync_job(self.fs, self.writer, inode))

    def list(self, lip, slot, cid, b, toks):
        self._slow(lip, slot, cid, _entries(list_job(self.fs, lip.principal, b.path)))

    # ------------------------------------------------------------------ helpers
    def _opened(self, h: int) -> dict:
        return {"handle": h, "length": self.fs.handles[h].inode.length}

    def _slow(self, lip, slot, cid, job) -> None:
        """Run ``job`` in the slow lane, charged to the LIP's user; answer when it is done."""
        def done(result, err):
            if err is None:
                self.answers.reply(lip, slot, cid, result)
            else:
                self.answers.error(lip, slot, cid, err)
        self.slow.submit(lip.user, job, done)


def _keys(toks, n: int) -> list[bytes]:
    """The ``n`` chain keys of a call's int32 array, 16 bytes each."""
    if len(toks) != n * abi.KEY_WORDS:
        raise InvalidArgument(f"n_keys {n} needs {n * abi.KEY_WORDS} int32 words in the call's array, "
                              f"got {len(toks)}")
    raw = np.ascontiguousarray(toks, dtype="<i4").tobytes()
    return [raw[i:i + 16] for i in range(0, len(raw), 16)]


def _entries(job):
    """A listing job whose result is the reply {"entries": [...]}."""
    return {"entries": (yield from job)}


def _logged(path):
    def done(result, err):
        if err is not None:
            log.error("durable copy of renamed %s not rewritten: %s: %s", path, type(err).__name__, err)
    return done
