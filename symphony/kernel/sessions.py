"""Client sessions: the kernel's Unix-socket RPC server.

A mixin of `daemon.Kernel`, on the event loop.  Each connection is one
session: framed JSON requests (ipc/protocol.py), each answered on the same
connection; the LIPs a session starts attached are killed when it ends (a
queued one leaves the queue).  The
caller's user is the peer's Unix user (SO_PEERCRED); root may act as any user
by naming it.  `ps` and `stats` are answered from published snapshots
(snapshot.py) only, never from another thread's live state.
"""
from __future__ import annotations

import asyncio
import logging
import pwd
import re
import socket
import struct
import time
from typing import Optional

from symphony.ipc.protocol import ProtocolError, encode_frame
from symphony.kvfs import KVFSError, Principal

from .bounds import MAX_REPLY_BYTES, ConnectionRefused
from .capabilities import identity_for
from .durable import list_job
from .escape import printable
from .inflow import input_bytes
from .snapshot import ProcRow

log = logging.getLogger("symphony.kernel")

FRESH_SNAPSHOT_WAIT_S = 0.25   # stats: how long to wait for the syscall thread to publish (a stall is not waited out)

_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


class ClientSessions:
    """The client RPC server of `daemon.Kernel`."""

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = _peer_uid(writer)
        try:
            self.conns.open(uid)                       # ConnectionRefused over a bound
        except ConnectionRefused as e:
            if self.conns.refused == 1 or self.conns.refused % 1000 == 0:
                log.warning("client connection of uid %d refused (%d so far): %s", uid, self.conns.refused, e)
            writer.write(encode_frame({"error": "EMFILE", "type": "LimitExceeded", "message": str(e)}))
            writer.close()
            return
        attached: set[int] = set()
        idle_s = self.bounds.idle_timeout_s or None
        try:
            while True:
                try:
                    msg = await self.conns.read_request(reader, uid, idle_s)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                except asyncio.TimeoutError:           # no request for idle_s
                    if any(lip in self.procs for lip in attached):
                        continue                       # it waits for its LIPs' events
                    log.info("closing an idle client connection of uid %d (%g s without a request)", uid, idle_s)
                    writer.write(encode_frame({"error": "ETIMEDOUT", "type": "IdleTimeout", "message":
                                               f"connection closed: no request for {idle_s:g} s and no LIP "
                                               f"attached (symphony-kernel --client-idle-timeout)"}))
                    break
                try:
                    reply = await self._request(uid, msg, writer, attached)
                except (ValueError, KVFSError, PermissionError, TimeoutError) as e:
                    reply = {"error": getattr(e, "code", "EINVAL"), "type": type(e).__name__,
                             "message": printable(e)}
                except Exception as e:                     # a kernel bug: fail this request only
                    log.exception("client request %r failed", msg.get("op") if isinstance(msg, dict) else None)
                    reply = {"error": "EIO", "type": "InternalError", "message": printable(f"internal error: {e!r}")}
                if reply is not None:
                    writer.write(encode_frame(fit_reply(reply)))
                    await writer.drain()
        except ProtocolError as e:
            log.warning("client protocol error (uid %d): %s", uid, e)
        finally:
            self.conns.close(uid)
            for lip_id in attached:                        # a session's LIPs end with it
                self._kill(lip_id, "killed: the client that ran it disconnected")
            writer.close()

    async def _request(self, uid: int, msg: dict, writer, attached: set) -> Optional[dict]:
        op = msg.get("op")
        user = _user_for(uid, msg.get("user"), self.gateway_uid)
        if op == "spawn":
            attach = msg.get("attach", True)
            acting = msg.get("user") is not None
            reply = await self.spawn(user, msg, watcher=writer if attach else None,
                                     caller_uid=self.uids.kernel_uid if uid == self.gateway_uid else uid,
                                     owner=identity_for(uid, user, acting=acting,
                                                        on_behalf=acting and uid == self.gateway_uid))
            if attach:
                attached.add(reply["lip"])
            return reply
        if op == "input":
            lip = self._own(uid, user, msg.get("lip"))
            data = None if msg.get("eof") else msg.get("data")
            if data is not None and not isinstance(data, str):
                raise ValueError("input data must be a string")
            n = input_bytes(data)
            if not await self.inflow.wait_room(lip.lip, n, lambda: lip.lip in self.procs):
                return None                            # back-pressure; it ended meanwhile: dropped
            self.inflow.sent(lip.lip, n)
            if lip.lip in self.admission:              # kept until it starts
                self._queue_input(lip.lip, data)
                return None
            self.sys.submit(lambda: self.sys.give_input(lip.lip, data))
            return None
        if op == "kill":
            lip = self._own(uid, user, msg.get("lip"))
            self._kill(lip.lip, f"killed by {user}")
            return {"ok": True, "lip": lip.lip}
        if op == "ps":                                 # others' LIPs without their arguments
            admin = uid == 0 and msg.get("user") is None   # root acting as a user sees what that user sees
            return self.ps(None if admin else user)
        if op == "stats":
            await self._fresh_serving_snapshot()
            return self.stats()
        who = Principal(user, 0)
        if op == "kv_ls":                              # in slices, charged to the user (slowlane.py)
            path = msg.get("path") or "/"
            return {"entries": await asyncio.wrap_future(
                self.sys.slow_call(user, lambda: list_job(self.fs, who, path)))}
        if op == "kv_stat":
            return await self.sys_call(lambda: self.fs.stat(who, msg.get("path")))
        if op == "kv_rm":
            await self.sys_call(lambda: self.fs.remove(who, msg.get("path")))
            return {"ok": True}
        if op == "test_hook" and self.test_hooks:
            return self._test_hook(uid, msg)
        if op == "shutdown":
            if uid != 0:
                raise PermissionError("only root may shut the kernel down")
            self.stopping.set()
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}")

    def _test_hook(self, uid: int, msg: dict) -> dict:
        """Fault injection, only with --test-hooks, root only:
        {"hook": "stall", "seconds": s}: hold the syscall thread s seconds;
        {"hook": "syscall_crash"}: an unexpected exception in its loop."""
        if uid != 0:
            raise PermissionError("test hooks are root only")
        hook = msg.get("hook")
        if hook == "stall":
            secs = msg.get("seconds")
            if not isinstance(secs, (int, float)) or isinstance(secs, bool) or not 0 <= secs <= 600:
                raise ValueError("seconds must be a number in [0, 600]")
            self.sys.submit(lambda: time.sleep(secs))
        elif hook == "syscall_crash":
            self.sys.inject_fault()
        else:
            raise ValueError(f"unknown test hook {hook!r}")
        return {"ok": True}

    def _own(self, uid: int, user: str, lip_id) -> ProcRow:
        e = self.procs.get(lip_id)
        if e is None:
            raise ValueError(f"no running LIP {lip_id!r}")
        if uid != 0 and e.row.user != user:
            raise PermissionError(f"LIP {lip_id} belongs to {e.row.user}")
        return e.row

    def ps(self, viewer: Optional[str] = None) -> dict:
        """The `ps` reply, from the published snapshots only: the process
        table's rows (event loop) and the syscall thread's counters.  A
        running LIP the memory manager suspended shows state "suspended".
        ``viewer``: the user asking (others' LIPs come without their
        arguments, limits and why they wait: that names their user's KV use);
        None: an administrator, who sees everything."""
        (rows, finished, _), served = self.procs.snapshot, self.sys.snapshot
        full = lambda r: viewer is None or r.user == viewer  # noqa: E731
        queued = self.queued_views()                   # position, waited_s of each queued LIP
        for lip, pages in served.suspended.items():    # running, but swapped out for a more important LIP
            queued.setdefault(lip, {}).update(state="suspended", suspended_pages=pages)

        def row(r):
            q = queued.get(r.lip, {})
            if not full(r):
                q = {k: v for k, v in q.items() if k != "waiting_for"}
            return dict(r.ps(served.counters(r.lip), full(r)), **q)
        return {"lips": [row(r) for r in rows],
                "finished": [dict(r.ps(r.final, full(r)), **e) for r, e in finished[-20:]]}

    async def _fresh_serving_snapshot(self, wait_s: float = FRESH_SNAPSHOT_WAIT_S) -> None:
        """Have the syscall thread publish what it serves now (an awaited command
        publishes), so that `stats` reflects every call whose reply or output the
        client already saw.  A stalled thread is not waited for beyond ``wait_s``:
        the last published snapshot is served then.  Concurrent callers share one
        request, so a flood of `stats` during a stall queues one command, not many."""
        pending = getattr(self, "_publish_request", None)
        if pending is None or pending.done():
            pending = self._publish_request = asyncio.wrap_future(self.sys.call_future(lambda: None))
        try:
            await asyncio.wait_for(asyncio.shield(pending), wait_s)   # a timeout leaves it for the others
        except (asyncio.TimeoutError, RuntimeError):
            pass

    def stats(self) -> dict:
        """The `stats` reply, from the published snapshots only."""
        served = self.sys.snapshot
        d = {"lips": sum(r.state != "queued" for r in self.procs.snapshot.rows)}
        d.update(served.as_stats())
        d.update(self.admission_stats())
        d["instance"] = self.instance
        d["model"] = getattr(self.engine, "model_id", None) or self.engine.model_config.name or "default"
        d["model_name"] = self.engine.model_config.name
        d["page_size"] = self.engine.page_size
        d["context"] = self.engine.max_seq_len
        d["compute_threads"] = self.sys.compute_threads
        d["output_queued_bytes"] = self.queued_output_bytes()
        d["input_queued_bytes"] = self.inflow.total()
        d["connections"] = len(self.conns)
        d["connections_refused"] = self.conns.refused
        return d



# ---------------------------------------------------------------- helpers
def fit_reply(reply: dict, limit: int = MAX_REPLY_BYTES) -> dict:
    """``reply``, made to fit in ``limit`` bytes of JSON: a reply with a list too
    long (`ps`'s LIPs, a listing's entries) keeps its first items and says how
    many more there were (``"more": {"lips": n}``); nothing else is that large."""
    import orjson
    if len(orjson.dumps(reply)) <= limit:
        return reply
    reply = dict(reply)
    more = {}
    for key in ("lips", "finished", "entries"):
        items = reply.get(key)
        if not isinstance(items, list) or not items:
            continue
        sizes = [len(orjson.dumps(x)) + 1 for x in items]
        room = limit - (len(orjson.dumps(reply)) - sum(sizes)) - 256
        keep, used = 0, 0
        while keep < len(items) and used + sizes[keep] <= room:
            used += sizes[keep]
            keep += 1
        if keep < len(items):
            reply[key], more[key] = items[:keep], len(items) - keep
        if len(orjson.dumps(reply)) <= limit - 128:
            break
    if more:
        reply["more"] = more
    return reply


def _peer_uid(writer) -> int:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _user_for(uid: int, asked, gateway_uid: Optional[int] = None) -> str:
    """The KVFS user a request of Unix uid ``uid`` acts as: its own name, or
    ``asked`` when root asks, or when the trusted gateway (``--gateway-uid``)
    asks for anyone but root."""
    if asked is not None and gateway_uid is not None and uid == gateway_uid and uid != 0:
        if not isinstance(asked, str) or not _USER_RE.fullmatch(asked) or asked == "root":
            raise PermissionError(f"the gateway may act for any user but root, not {asked!r}")
        return asked
    if asked is not None:
        if uid != 0:
            try:
                own = pwd.getpwuid(uid).pw_name
            except KeyError:
                own = f"uid{uid}"
            if asked != own:
                raise PermissionError("only root may act as another user")
        if not isinstance(asked, str) or not _USER_RE.fullmatch(asked):
            raise ValueError(f"bad user name {asked!r}")
        return asked
    try:
        name = pwd.getpwuid(uid).pw_name.lower()
    except KeyError:
        name = f"uid{uid}"
    return name if _USER_RE.fullmatch(name) else f"uid{uid}"
