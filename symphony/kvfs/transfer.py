"""Moving a KV file between kernels: export it as bytes, import bytes as a file, or adopt the
durable files a dead kernel left in a directory this one can read.

    snap, pages = <export_job(fs, who, path) run in the slow lane>   # who may read it; blocks held
    blob = store.encode(snap, pages)                                  # any thread
    header, data = store.decode(fs, blob, "import")                   # any thread; CorruptFile
    inode = import_file(fs, who, "/home/bob/x.kv", header, data)     # the syscall thread
    adopt(fs, who, peer_dir, "/home/bob/serve-cache")                # the syscall thread

The bytes are the durable file format (store.py): a header (path, owner, mode,
times, advice, positions, dtype, page shape, the model's fingerprint), the K/V
of every token for every KV head, and a SHA-256 of both.  So a file moves
between kernels of any tensor-parallel size, and one written by another model,
dtype or KV layout is refused (`CorruptFile`, naming what differs), as is one
whose hash does not match.

Permissions: an export needs what opening the file read-only needs; an import
creates a new file at the path asked as the importing user (the directory must
let them create it, the name must be free), owned by them and charged to their
quotas (pages, page references, named files), whoever owned the original; its
mode is the one asked for, else the original's, less the umask.  Its advice
(cache, keep, ...) and the time left before it expires come along.  Adopting
takes only files the user owned (root: any) below the directory named, from
the peer directories the administrator listed (``--peer-durable-dir``).
"""
from __future__ import annotations

import heapq
import logging
import os
import struct
import time
from pathlib import Path
from stat import S_ISREG
from typing import Generator, Optional

import orjson

from symphony.engine.page_allocator import pages_for

from .errors import AlreadyExists, CorruptFile
from .namespace import ROOT_USER, Inode, Principal, split_path
from .store import MAGIC, decode, materialize, release_snapshot, snapshot

log = logging.getLogger("symphony.kvfs.store")

EXPORT_SLICE_PAGES = 8          # pages copied out per slow-lane slice


def export_job(fs, who: Principal, path: str) -> Generator:
    """The slow-lane job of an export: ``path`` checked as `KVFS.open` (read-only) checks
    it, its blocks held while its pages are copied out a slice at a time; returns
    (SyncSnapshot, pages) for `store.encode`."""
    hid = fs.open(who, path, "r")                  # NotFound, IsADirectory, PermissionDenied
    try:
        inode = fs.handles.of(who, hid).inode
        extra = {}
        if inode.expire_at is not None:
            extra["expire_in"] = max(0.0, inode.expire_at - time.monotonic())
        snap = snapshot(fs, inode, **extra)
    finally:
        fs.close(who, hid)
    pages = []
    try:
        yield
        for i in range(0, len(snap.blocks), EXPORT_SLICE_PAGES):
            pages += [fs.pager.read(b) for b in snap.blocks[i:i + EXPORT_SLICE_PAGES]]
            yield
    finally:
        release_snapshot(fs, snap)
    return snap, pages


def max_import_bytes(fs, who: Principal) -> Optional[int]:
    """The most bytes an import by ``who`` could need before its quota refuses it (None:
    no page quota): their free pages' K/V for every head, plus room for the header."""
    lim = fs.quotas.limit_for(who.user)
    if lim is None:
        return None
    L, _, S, H, D = fs.engine.kv.page_shape
    elem = fs.engine.kv.pool.element_size()
    return max(0, lim - fs.quotas.by_user[who.user]) * L * 2 * S * H * D * elem + (1 << 20)


def import_file(fs, who: Principal, path: str, header: dict, data, mode: Optional[int] = None,
                parents: bool = False) -> Inode:
    """A new file at ``path``, owned by ``who``, holding a decoded export (see the module
    docstring); ``parents``: first make the missing directories above it, as ``who``.
    Changes nothing but those directories if it raises (AlreadyExists,
    PermissionDenied, QuotaExceeded, NoSpace, ...)."""
    fs._tick()
    if parents:
        _make_parents(fs, who, path)
    n_pages = pages_for(header["length"], fs.page_size)
    parent, name = fs._parent_for_create(who, path)
    fs.quotas.check({(who.user, 0): n_pages})
    fs.quotas.check_refs(who.user, n_pages)
    inode = materialize(fs, header, data, who.user,
                        fs._new_mode(header["mode"] if mode is None else mode, fs.config.default_file_mode))
    fs._link(parent, name, inode)
    fs.inodes[inode.ino] = inode
    fs.chains.restore(inode, header.get("chain"))      # keys as its owner published them: trusted as theirs
    ttl = header.get("expire_in")
    if type(ttl) in (int, float) and ttl >= 0:
        inode.expire_at = time.monotonic() + ttl
        heapq.heappush(fs._expiry, (inode.expire_at, inode.ino))
    fs.memory.touch(inode)
    log.info("imported %s (%d tokens) for %s", path, header["length"], who.user)
    return inode


def adopt(fs, who: Principal, peer_dir: str, kv_dir: str) -> dict:
    """Import, at their own paths, the durable files in ``peer_dir`` (another kernel's
    durable directory) that lie below KVFS directory ``kv_dir`` and that ``who`` owned;
    {"adopted": [paths], "refused": [[path or file, why]]}.  A path that exists here is
    left as it is (refused: it exists)."""
    prefix = "/" + "/".join(split_path(kv_dir)) + "/"
    out: dict = {"adopted": [], "refused": []}
    for f in sorted(Path(peer_dir).glob("*.kvf")):
        try:
            head = _header_of(f)
        except (OSError, CorruptFile, ValueError) as e:
            out["refused"].append([str(f), str(e)])
            continue
        path, owner = head.get("path"), head.get("owner")
        if not isinstance(path, str) or not path.startswith(prefix):
            continue
        if owner != who.user and who.user != ROOT_USER:
            continue                                   # another user's file: not theirs to adopt
        try:
            header, data = decode(fs, _read(f), str(f))
            import_file(fs, Principal(owner, 0), path, header, data, parents=True)
            out["adopted"].append(path)
        except (CorruptFile, OSError) as e:
            out["refused"].append([path, str(e)])
        except Exception as e:                         # KVFS refused it (exists, quota): say which and why
            out["refused"].append([path, f"{type(e).__name__}: {e}"])
    return out


# ---------------------------------------------------------------- helpers
def _open_regular(f: Path):
    fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
    if not S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptFile(f"{f}: not a regular file")
    return open(fd, "rb")


def _header_of(f: Path) -> dict:
    with _open_regular(f) as fh:
        head = fh.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
            raise CorruptFile(f"{f}: not a Symphony KV file")
        (n,) = struct.unpack("<I", head[len(MAGIC):])
        if n > 64 << 20:
            raise CorruptFile(f"{f}: header of {n} bytes")
        h = orjson.loads(fh.read(n))
    if not isinstance(h, dict):
        raise CorruptFile(f"{f}: unreadable header")
    return h


def _make_parents(fs, who: Principal, path: str) -> None:
    """The directories above ``path`` below the user's home, made as ``who`` if missing."""
    parts = split_path(path)
    for i in range(3 if parts[0] == "home" else 2, len(parts)):
        try:
            fs.mkdir(who, "/" + "/".join(parts[:i]))
        except AlreadyExists:
            pass


def _read(f: Path) -> bytes:
    with _open_regular(f) as fh:
        return fh.read()



ID_FILE = "kernel-id"


def durable_id(d: str, create: bool = False) -> Optional[str]:
    """The id of durable directory ``d`` (made, 16 random bytes in hex, by the kernel whose
    --durable-dir it is: ``create``), so that gateways name a dead kernel's directory the
    same way whatever path each host mounts it at.  None if it has none (yet)."""
    f = Path(d) / ID_FILE
    try:
        text = f.read_text().strip()
        return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None
    except OSError:
        if not create:
            return None
    import secrets
    tmp = f.with_name(f"{ID_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as fh:
        fh.write(secrets.token_hex(16) + "\n")
    os.replace(tmp, f)
    return durable_id(d)
