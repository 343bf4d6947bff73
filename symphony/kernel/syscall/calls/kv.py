"""The KV file calls: KVFS's namespace and data operations, as the calling LIP.

Each handler reads its typed body and checks only what depends on KVFS's
state (handles, paths, permissions), in KVFS.  A durable sync and a listing
run in the slow lane a slice at a time (durable.py, slowlane.py), charged to
the LIP's user; the rest answer at once.
"""
from __future__ import annotations

import logging

from symphony.ipc import abi
from symphony.kvfs import KVFS

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.syscall.durable import list_job, sync_job
from symphony.kernel.syscall.slowlane import SlowLane, Writer

log = logging.getLogger("symphony.syscalls")


class KvCalls:
    """KV file calls; given KVFS, the slow lane and its durable writer, and the answers."""

    OPS = {abi.KV_CREATE: "create", abi.KV_OPEN: "open", abi.KV_CLOSE: "close", abi.KV_REMOVE: "remove",
           abi.KV_FORK: "fork", abi.KV_TRUNCATE: "truncate", abi.KV_EXTRACT: "extract",
           abi.KV_MERGE: "merge", abi.KV_STAT: "stat", abi.KV_LIST: "list", abi.KV_ADVISE: "advise",
           abi.KV_RENAME: "rename", abi.KV_SYNC: "sync", abi.KV_MKDIR: "mkdir", abi.KV_RMDIR: "rmdir"}
    # served while a step is on the device: metadata, and what moves no page (a listing runs in the
    # slow lane, between steps); the others wait for the step in flight, which writes pages
    ANYTIME = {abi.KV_CREATE, abi.KV_STAT, abi.KV_LIST, abi.KV_ADVISE, abi.KV_MKDIR}

    def __init__(self, fs: KVFS, slow: SlowLane, writer: Writer, answers: Answers):
        self.fs, self.slow, self.writer, self.answers = fs, slow, writer, answers

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


def _entries(job):
    """A listing job whose result is the reply {"entries": [...]}."""
    return {"entries": (yield from job)}


def _logged(path):
    def done(result, err):
        if err is not None:
            log.error("durable copy of renamed %s not rewritten: %s: %s", path, type(err).__name__, err)
    return done
