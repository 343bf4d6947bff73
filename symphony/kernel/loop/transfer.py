"""The client RPC's KV moves: ``kv_export``, ``kv_import`` and ``kv_adopt`` (kvfs/transfer.py
does the KVFS side; this module the frames and the threads).

    export   the syscall thread's slow lane copies the file's pages out a slice at a time
             (other LIPs' calls go on); a worker thread encodes and hashes them; the
             event loop writes `ExportHead` and the chunks, waiting on the client
    import   the chunks are read under the user's partial-frame bound, at most what the
             user's quota could hold (announced size checked first); a worker thread
             checks the hash and decodes; the syscall thread makes the file
    adopt    the syscall thread imports a dead peer's durable files (slow: whole files)

A refused import still reads (and drops) the chunks announced, so the connection
stays in step.  Every refusal is an ordinary error reply and changes nothing.
"""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

from symphony.ipc import rpc
from symphony.ipc.protocol import ProtocolError, encode_frame
from symphony.kvfs import Principal
from symphony.kvfs.errors import InvalidArgument, NotFound, QuotaExceeded
from symphony.kvfs.store import decode, digest_of, encode
from symphony.kvfs.transfer import adopt, durable_id, export_job, import_file, max_import_bytes


class KvTransfers:
    """The export, import and adopt requests of one kernel (event loop)."""

    def __init__(self, sys_server, fs, conns, peer_dirs: tuple = ()):
        """``peer_dirs``: other kernels' durable directories this one may adopt from."""
        self.sys, self.fs, self.conns = sys_server, fs, conns
        self.peer_dirs = tuple(peer_dirs)
        d = fs.config.durable_dir
        self.own_id = durable_id(d, create=True) if d and Path(d).is_dir() else None

    def peers(self) -> dict[str, str]:
        """{id: directory} of the peer durable directories that have an id (read each time:
        a peer kernel makes its id when it first starts)."""
        out = {}
        for d in self.peer_dirs:
            i = durable_id(d)
            if i:
                out[i] = d
        return out

    async def export(self, user: str, req: rpc.KvExport, writer) -> None:
        """Answer an export: `ExportHead`, then the chunks (written here: no other reply)."""
        who = Principal(user, 0)
        snap, pages = await asyncio.wrap_future(self.sys.slow_call(user, lambda: export_job(self.fs, who, req.path)))
        loop = asyncio.get_running_loop()
        blob, digest = await loop.run_in_executor(None, _encode_hashed, snap, pages)
        frames = rpc.raw_frames(blob)
        import orjson
        head = orjson.loads(snap.header)
        writer.write(encode_frame({"header": head, "size": len(blob), "sha256": digest, "chunks": len(frames)}))
        for h, data in frames:
            writer.write(h)
            writer.write(data)
            await writer.drain()

    async def import_(self, user: str, uid, req: rpc.KvImport, reader) -> dict:
        """Read an import's chunks and make the file; its `Imported` reply."""
        who = Principal(user, 0)
        cap = await asyncio.wrap_future(self.sys.call_future(lambda: max_import_bytes(self.fs, who)))
        refused = None
        if cap is not None and req.size > cap:
            refused = QuotaExceeded(f"kv_import of {req.size} bytes: more than user {user!r}'s free KV quota could "
                                    f"hold ({cap} bytes)")
        expected_chunks = max(1, -(-req.size // rpc.CHUNK_BYTES))
        if refused is None and req.chunks != expected_chunks:
            refused = InvalidArgument(f"kv_import of {req.size} bytes comes in {expected_chunks} chunks of "
                                      f"{rpc.CHUNK_BYTES} bytes, not {req.chunks}")
        parts, got = [], 0
        for seq in range(req.chunks):
            data = await self._raw(reader, uid)            # ProtocolError: not a raw frame (out of step)
            if refused is not None:
                continue                                   # read and dropped: the stream stays in step
            got += len(data)
            if got > req.size:
                refused = InvalidArgument(f"kv_import: more than the {req.size} bytes announced arrived")
                parts = []
                continue
            parts.append(data)
        if refused is not None:
            raise refused
        blob = bytearray().join(parts)                   # writable: decoded in place
        loop = asyncio.get_running_loop()
        header, data = await loop.run_in_executor(None, _verify, self.fs, blob, req)
        inode = await asyncio.wrap_future(self.sys.call_future(
            lambda: import_file(self.fs, who, req.path, header, data, req.mode, req.parents)))
        return {"path": req.path, "length": inode.length, "pages": len(inode.blocks)}

    async def _raw(self, reader, uid) -> bytes:
        """One raw frame, its bytes held under the user's partial-frame bound (bounds.py)
        and arriving within the idle timeout, as a request frame's are."""
        try:
            n = rpc.raw_length(await reader.readexactly(4))
        except rpc.RpcError as e:
            raise ProtocolError(f"kv_import: {e}") from None
        await self.conns.reserve(uid, n)
        try:
            idle = self.conns.bounds.idle_timeout_s or None
            return await asyncio.wait_for(reader.readexactly(n), idle)
        except asyncio.TimeoutError:
            raise ProtocolError(f"a KV data frame of {n} bytes did not arrive within {idle:g} s") from None
        finally:
            self.conns.release(uid, n)

    async def adopt(self, user: str, req: rpc.KvAdopt) -> dict:
        """Adopt a dead peer's durable files below ``req.dir`` (kvfs/transfer.py)."""
        d = self.peers().get(req.peer)
        if d is None:
            raise NotFound(f"no peer durable directory with id {req.peer} (symphony-kernel --peer-durable-dir "
                           f"names those this kernel may adopt from)")
        who = Principal(user, 0)
        return await asyncio.wrap_future(self.sys.call_future(lambda: adopt(self.fs, who, d, req.dir)))


def _encode_hashed(snap, pages) -> tuple[bytearray, str]:
    blob = encode(snap, pages)
    return blob, digest_of(blob)


def _verify(fs, blob, req: rpc.KvImport):
    """The import's bytes checked (their size, the digest announced, then everything
    `store.decode` checks, the digest against the content first) and decoded."""
    if len(blob) != req.size:
        raise InvalidArgument(f"kv_import: {len(blob)} bytes arrived, {req.size} were announced")
    if len(blob) < 32 or digest_of(blob) != req.sha256:
        raise InvalidArgument("kv_import: the file's SHA-256 is not the one announced (another file, or cut short)")
    return decode(fs, blob, f"kv_import {req.path}")


def peer_dirs_checked(dirs) -> tuple:
    """--peer-durable-dir values, each an existing directory (ValueError otherwise)."""
    out = []
    for d in dirs or ():
        if not Path(d).is_dir():
            raise ValueError(f"--peer-durable-dir {d}: not a directory")
        out.append(os.path.realpath(d))
    return tuple(out)

