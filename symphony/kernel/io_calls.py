"""The non-pred system calls: info, KV files, messages and output, chunked-reply FETCH, recv, and
capabilities.  `IOCalls` is a part of `SyscallServer`; `handler_table` maps ABI ops to handlers.

Every handler gets its call's body already decoded and validated as the op's type
(`symphony.ipc.schema`, by `SyscallServer._handle`): it reads typed fields and checks
only what depends on the kernel's state (handles, paths, permissions, sizes).
"""
from __future__ import annotations

import logging
import time

import orjson

import msgspec

from symphony.ipc import abi
from symphony.ipc.layout import RESP_BODY_OFF
from symphony.ipc.protocol import encode_frame

from .durable import list_job, sync_job
from .failure import fail as _fail
from .inflow import input_bytes
from .proc import LipProc

log = logging.getLogger("symphony.syscalls")

MAX_MESSAGE_BYTES = 1 << 20
MAX_QUEUED_OUTPUT = 1 << 20     # per LIP: output bytes not yet taken by its client before send() waits


class IOCalls:
    """Handlers of every call but pred (mixed into SyscallServer)."""

    def _nop(self, lip, slot, cid, body, toks):
        return {}

    def _info(self, lip, slot, cid, body, toks):
        c = self.engine.model_config
        return {"lip": lip.id, "user": lip.user, "grants": lip.grants, "limits": lip.limits,
                "vocab_size": c.vocab_size, "max_context": c.max_context, "page_size": self.engine.page_size,
                "eos_ids": list(self.engine.tokenizer.eos_ids) if self.engine.tokenizer else []}

    def _kv(self, fn):
        def h(self, lip, slot, cid, body, toks):
            return fn(self, lip.principal, body)
        return h

    def _send(self, lip, slot, cid, body, toks):
        data = body.data
        if len(orjson.dumps(data)) > MAX_MESSAGE_BYTES:
            _fail("InvalidArgument", "EINVAL", f"message larger than {MAX_MESSAGE_BYTES} bytes")
        return self._emit_output(lip, slot, cid, {"event": "out", "data": data})

    def _write_stream(self, lip, slot, cid, body, toks):
        return self._emit_output(lip, slot, cid, {"event": body.stream, "data": body.data[:MAX_MESSAGE_BYTES]})

    def _emit_output(self, lip, slot, cid, event: dict):
        """Hand ``event`` to the client and count its bytes as queued; past
        ``max_queued_output`` the call waits (parked, like recv) until the
        client has taken enough (`credit_output`)."""
        lip.out_bytes += len(encode_frame(event))      # the event loop credits the same frame size back
        self.emit(lip.id, event)
        if lip.out_bytes > self.max_queued_output:
            lip.parked_out.append((slot, cid))
            lip.blocked_since = time.monotonic()
            return None
        return {}

    def credit_output(self, lip_id: int, n: int) -> None:
        """The event loop says ``n`` bytes of the LIP's output left the kernel
        (taken by the client, or dropped): wake parked senders if there is room."""
        lip = self.lips.get(lip_id)
        if lip is None:
            return
        lip.out_bytes = max(0, lip.out_bytes - n)
        while lip.parked_out and lip.out_bytes <= self.max_queued_output:
            slot, cid = lip.parked_out.popleft()
            self._reply(lip, slot, cid, {})

    def _fetch(self, lip, slot, cid, body, toks):
        """The next chunk of a reply too large for a slot: raw bytes, not JSON."""
        try:
            chunk = lip.replies.take(body.id, body.offset, lip.ring.slot_bytes - RESP_BODY_OFF)
        except (KeyError, IndexError) as e:
            _fail("InvalidArgument", "EINVAL", f"fetch: {e.args[0]}")
        if lip.state in ("running", "killing"):
            lip.ring.respond(slot, cid, abi.OK, chunk)
        return None

    def _recv(self, lip, slot, cid, body, toks):
        if lip.parked_recv is not None:
            _fail("InvalidArgument", "EBUSY", "another thread of this LIP is already in recv()")
        lip.parked_recv = (slot, cid)
        lip.blocked_since = time.monotonic()
        self._serve_recv(lip)
        return None

    def _serve_recv(self, lip: LipProc) -> None:
        if lip.parked_recv is None or not (lip.inbox or lip.eof):
            return
        slot, cid = lip.parked_recv
        lip.parked_recv = None
        if not lip.inbox:
            self._reply(lip, slot, cid, {"eof": True})
            return
        data = lip.inbox.popleft()
        self.on_input_read(lip.id, input_bytes(data))     # its sender may send more (inflow.py)
        self._reply(lip, slot, cid, {"data": data})

    def _cap(self, op: str):
        """A capability call: run on the capability pool (policy, per-LIP share,
        deadline: see capabilities/), answered from the syscall thread."""
        def h(self, lip, slot, cid, body, toks):
            def done(res, err):
                def reply():
                    lip.caps_in_flight -= 1
                    if err is None:
                        self._reply(lip, slot, cid, res)
                    else:
                        self._reply_error(lip, slot, cid, err)
                self.submit(reply)
            lip.caps_in_flight += 1
            lip.blocked_since = time.monotonic()
            args = {k: v for k, v in msgspec.structs.asdict(body).items() if v is not None}   # absent: policy default
            self.caps.submit(lip, op, args, done)
            return None
        return h

    def _slow(self, lip, slot, cid, job) -> None:
        """Run ``job`` in the slow lane, charged to the LIP's user; answer when it is done."""
        def done(result, err):
            if err is None:
                self._reply(lip, slot, cid, result)
            else:
                self._reply_error(lip, slot, cid, err)
        self.slow.submit(lip.user, job, done)

    def _kv_sync(self, lip, slot, cid, body, toks):
        inode = self.fs.sync_target(lip.principal, body.kv)         # its errors at once
        self._slow(lip, slot, cid, sync_job(self.fs, self.writer, inode))

    def _kv_list(self, lip, slot, cid, body, toks):
        self._slow(lip, slot, cid, _entries(list_job(self.fs, lip.principal, body.path)))

    def _kv_rename(self, lip, slot, cid, body, toks):
        node = self.fs.rename(lip.principal, body.old, body.new, rewrite_durable=False)
        if getattr(node, "durable", False):                          # its copy under the new path, later
            self.slow.submit(lip.user, sync_job(self.fs, self.writer, node), _logged(node.path))
        return {}

    _handlers: dict = {}


def _entries(job):
    """A listing job whose result is the reply {"entries": [...]}."""
    return {"entries": (yield from job)}


def _logged(path):
    def done(result, err):
        if err is not None:
            log.error("durable copy of renamed %s not rewritten: %s: %s", path, type(err).__name__, err)
    return done


def _kv_create(s, who, b):
    return {"handle": s.fs.create(who, b.path, b.mode)}        # mode None: KVFS default (0600)


def _kv_open(s, who, b):
    h = s.fs.open(who, b.path, b.mode)
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_close(s, who, b):
    s.fs.close(who, b.kv)
    return {}


def _kv_fork(s, who, b):
    h = s.fs.fork(who, b.kv, b.path, b.mode)
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_truncate(s, who, b):
    s.fs.truncate(who, b.kv, b.n)
    return {"length": s.fs.handles[b.kv].inode.length}


def _kv_extract(s, who, b):
    h = s.fs.extract(who, b.kv, [list(r) for r in b.ranges], b.path, b.mode)
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_merge(s, who, b):
    h = s.fs.merge(who, b.kvs, b.path, b.mode)
    return {"handle": h, "length": s.fs.handles[h].inode.length}


def _kv_stat(s, who, b):
    return s.fs.stat(who, b.kv if b.kv is not None else b.path)


def _kv_advise(s, who, b):
    s.fs.advise(who, b.kv, b.hint, b.seconds)
    return {}


def _kv_simple(method, *fields):
    """A KVFS call whose arguments are the body's ``fields``, replying {}."""
    def h(s, who, b):
        getattr(s.fs, method)(who, *[getattr(b, f) for f in fields])
        return {}
    return h


def handler_table(S) -> dict:
    """ABI op -> handler(server, lip, slot, call_id, body, tokens) of the server class S."""
    return {
        abi.NOP: S._nop, abi.INFO: S._info, abi.PRED: S._pred,
        abi.KV_CREATE: S._kv(S, _kv_create), abi.KV_OPEN: S._kv(S, _kv_open),
        abi.KV_CLOSE: S._kv(S, _kv_close), abi.KV_FORK: S._kv(S, _kv_fork),
        abi.KV_TRUNCATE: S._kv(S, _kv_truncate), abi.KV_EXTRACT: S._kv(S, _kv_extract),
        abi.KV_MERGE: S._kv(S, _kv_merge), abi.KV_STAT: S._kv(S, _kv_stat), abi.KV_LIST: S._kv_list,
        abi.KV_ADVISE: S._kv(S, _kv_advise), abi.KV_REMOVE: S._kv(S, _kv_simple("remove", "path")),
        abi.KV_RENAME: S._kv_rename, abi.KV_SYNC: S._kv_sync,
        abi.KV_MKDIR: S._kv(S, _kv_simple("mkdir", "path", "mode")),
        abi.KV_RMDIR: S._kv(S, _kv_simple("rmdir", "path")),
        abi.SEND: S._send, abi.RECV: S._recv, abi.WRITE_STREAM: S._write_stream, abi.FETCH: S._fetch,
        abi.CAP_HTTP: S._cap(S, "http"), abi.CAP_READ_FILE: S._cap(S, "read"),
        abi.CAP_LIST_DIR: S._cap(S, "list"),
    }
