"""Client sessions: the kernel's Unix-socket RPC server.

`ClientSessions` is a part of `daemon.Kernel`, on the event loop.  Each
connection is one session: framed JSON requests (ipc/protocol.py), each
answered on the same connection; the LIPs a session starts attached are
killed when it ends (a queued one leaves the queue).  The caller's user is the
peer's Unix user (SO_PEERCRED); root may act as any user by naming it.  It
owns no state beyond each connection's: the connection table is bounds.py's,
LIPs are the lifecycle's (lifecycle.py), and `ps` and `stats` come from
status.py, which reads published snapshots only.
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

from symphony.kernel.loop.bounds import MAX_REPLY_BYTES, ClientBounds, ConnectionRefused, Connections
from symphony.kernel.capabilities import identity_for
from symphony.kernel.syscall.durable import list_job
from symphony.kernel.escape import printable
from symphony.kernel.loop.inflow import InputFlow, input_bytes
from symphony.kernel.loop.lifecycle import LipLifecycle
from symphony.kernel.snapshot import ProcRow
from symphony.kernel.loop.status import KernelStatus

log = logging.getLogger("symphony.kernel")

_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


class ClientSessions:
    """The client RPC server (event loop)."""

    def __init__(self, lifecycle: LipLifecycle, status: KernelStatus, conns: Connections, inflow: InputFlow,
                 sys_server, fs, stopping: asyncio.Event, *, bounds: ClientBounds, kernel_uid: int,
                 gateway_uid: Optional[int] = None, test_hooks: bool = False):
        """``lifecycle``: spawn, input, kill; ``status``: `ps`, `stats`;
        ``conns``: the connection table; ``inflow``: unread input per LIP;
        ``sys_server``, ``fs``: the syscall thread and its KVFS (kv_* requests,
        run there); ``stopping``: set to stop the kernel (root's `shutdown`);
        ``kernel_uid``: the kernel's own uid (what the gateway spawns as);
        ``gateway_uid``: the trusted gateway's uid, if any; ``test_hooks``:
        serve the fault-injection requests (--test-hooks)."""
        self.lifecycle, self.status, self.conns, self.inflow = lifecycle, status, conns, inflow
        self.sys, self.fs, self.stopping, self.bounds = sys_server, fs, stopping, bounds
        self.kernel_uid, self.gateway_uid, self.test_hooks = kernel_uid, gateway_uid, test_hooks

    async def serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection, until it closes (asyncio.start_unix_server's callback)."""
        procs = self.lifecycle.procs
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
                    if any(lip in procs for lip in attached):
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
                self.lifecycle.kill(lip_id, "killed: the client that ran it disconnected")
            writer.close()

    async def _request(self, uid: int, msg: dict, writer, attached: set) -> Optional[dict]:
        op = msg.get("op")
        user = _user_for(uid, msg.get("user"), self.gateway_uid)
        if op == "spawn":
            attach = msg.get("attach", True)
            acting = msg.get("user") is not None
            reply = await self.lifecycle.spawn(user, msg, watcher=writer if attach else None,
                                               caller_uid=self.kernel_uid if uid == self.gateway_uid else uid,
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
            if not await self.inflow.wait_room(lip.lip, n, lambda: lip.lip in self.lifecycle.procs):
                return None                            # back-pressure; it ended meanwhile: dropped
            self.inflow.sent(lip.lip, n)
            self.lifecycle.give_input(lip.lip, data)
            return None
        if op == "kill":
            lip = self._own(uid, user, msg.get("lip"))
            self.lifecycle.kill(lip.lip, f"killed by {user}")
            return {"ok": True, "lip": lip.lip}
        if op == "ps":                                 # others' LIPs without their arguments
            admin = uid == 0 and msg.get("user") is None   # root acting as a user sees what that user sees
            return self.status.ps(None if admin else user)
        if op == "stats":
            return await self.status.fresh_stats()
        who = Principal(user, 0)
        if op == "kv_ls":                              # in slices, charged to the user (slowlane.py)
            path = msg.get("path") or "/"
            return {"entries": await asyncio.wrap_future(
                self.sys.slow_call(user, lambda: list_job(self.fs, who, path)))}
        if op == "kv_stat":
            return await asyncio.wrap_future(self.sys.call_future(lambda: self.fs.stat(who, msg.get("path")), anytime=True))
        if op == "kv_rm":
            await asyncio.wrap_future(self.sys.call_future(lambda: self.fs.remove(who, msg.get("path"))))
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
        {"hook": "syscall_crash"}: an unexpected exception in its loop;
        {"hook": "step_fault"}: the next forward pass raises (its calls get the error)."""
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
        elif hook == "step_fault":
            self.sys.submit(self.sys.device.fail_next, anytime=True)
        else:
            raise ValueError(f"unknown test hook {hook!r}")
        return {"ok": True}

    def _own(self, uid: int, user: str, lip_id) -> ProcRow:
        e = self.lifecycle.procs.get(lip_id)
        if e is None:
            raise ValueError(f"no running LIP {lip_id!r}")
        if uid != 0 and e.row.user != user:
            raise PermissionError(f"LIP {lip_id} belongs to {e.row.user}")
        return e.row


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
