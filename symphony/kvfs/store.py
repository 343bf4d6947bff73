"""Durable KV files: ``sync`` writes a named file to the durable directory;
a new KVFS on the same model restores it at start-up.

File format (one file per KV file, named by a hash of its path)::

    b"SYMKV001"                     magic
    u32 little-endian               header length
    header                          orjson: path, owner, mode, times, advice,
                                    length, positions, dtype, page shape,
                                    model fingerprint, data length
    data                            K/V of `length` slots: [n_layers, 2, length,
                                    n_kv_heads, head_dim] raw, in `dtype`
    32 bytes                        SHA-256 of header + data

A file whose hash, magic or layout does not match is refused as corrupt; one
written by another model (different fingerprint, which covers --dtype) is
refused as foreign. One of the same model with KV data of another dtype (a
kernel with another --kv-dtype) is converted as it is read: 16-bit data into a
float32 pool exactly, float32 into a 16-bit pool rounded to nearest even.
Refused files are logged and left in place, never loaded.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR, S_ISREG

import orjson
import torch

from symphony.engine.config import DTYPES, dtype_name
from symphony.engine.page_allocator import pages_for

from .chains import MAX_KEYS
from .errors import CorruptFile, InvalidArgument
from .namespace import ADVICE, ROOT_USER, Block, Directory, Inode, split_path

log = logging.getLogger("symphony.kvfs.store")

MAGIC = b"SYMKV001"


def model_fingerprint(engine) -> str:
    """Identifies the model and KV layout: config, dtype, and a sample of weights
    that rank 0 holds whole at every tensor-parallel size (the embedding, the
    first query rows, the last layer's norms), so that a durable file is read
    back at any --tp (its pages hold every KV head)."""
    cached = getattr(engine, "_kv_fingerprint", None)
    if cached:
        return cached
    c = engine.model_config
    w = engine.model.w
    h = hashlib.sha256()
    h.update(orjson.dumps({k: str(v) for k, v in vars(c).items()}))
    h.update(str(engine.dtype).encode())
    for t in (w.embed[:4], w.layers[0].wqkv[:4], w.layers[-1].mlp_norm, w.norm):
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    engine._kv_fingerprint = h.hexdigest()
    return engine._kv_fingerprint


def _file_for(fs, path: str) -> Path:
    return Path(fs.config.durable_dir) / (hashlib.sha256(path.encode()).hexdigest()[:32] + ".kvf")


@dataclass
class SyncSnapshot:
    """A named file as `sync` found it: what its durable copy will hold.  Its
    blocks carry one reference more until `release_snapshot`, so none of them is
    freed, reused or written (a write copies a shared page first) while the data
    is copied out, a slice at a time if need be."""

    path: str
    header: bytes
    blocks: list
    length: int


def sync_snapshot(fs, inode: Inode) -> SyncSnapshot:
    """Begin a sync of ``inode`` (a named file): its header now, its blocks held."""
    if not fs.config.durable_dir:
        raise InvalidArgument("this kernel has no durable directory (durable_dir) configured")
    return snapshot(fs, inode)


def snapshot(fs, inode: Inode, **extra) -> SyncSnapshot:
    """``inode``'s header now (with ``extra`` fields) and its blocks held, for a sync or an
    export (transfer.py)."""
    kv = fs.engine.kv
    L, _, _, H, D = kv.page_shape                         # whole pages: every KV head
    n = inode.length
    blocks = list(inode.blocks)
    per_slot = L * 2 * H * D * torch.empty((), dtype=kv.dtype).element_size()
    header = orjson.dumps({
        "version": 1, "path": inode.path, "owner": inode.owner, "mode": inode.mode,
        "ctime": inode.ctime, "mtime": inode.mtime, "advice": inode.advice, "length": n,
        "positions": inode.positions, "dtype": dtype_name(kv.dtype),
        "page_shape": [L, 2, H, D],
        "model": model_fingerprint(fs.engine), "data_bytes": n * per_slot,
        "chain": fs.chains.record(inode), **extra})
    fs.refs.hold(blocks)
    return SyncSnapshot(inode.path, header, blocks, n)


def release_snapshot(fs, snap: SyncSnapshot) -> None:
    fs.refs.drop(snap.blocks)
    snap.blocks = []


def write_file(durable_dir: str, snap: SyncSnapshot, pages: list, tag: int = 0) -> tuple[Path, Path]:
    """Write ``snap`` (its pages' data: `Pager.read` copies, one per block) to a
    temporary file beside its durable file, fsynced, private (0600); returns
    (temporary, final path).  Touches nothing of KVFS: runs on any thread."""
    blob = encode(snap, pages)
    dest = Path(durable_dir) / (hashlib.sha256(snap.path.encode()).hexdigest()[:32] + ".kvf")
    tmp = dest.with_name(f"{dest.stem}.{os.getpid()}.{tag}.tmp")
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return tmp, dest


def encode(snap: SyncSnapshot, pages: list) -> bytearray:
    """The file format's bytes of ``snap`` (its pages' data, one copy per block), made in
    one buffer: each page's slots are copied once, into place."""
    n, head = snap.length, snap.header
    start = len(MAGIC) + 4 + len(head)
    per_slot = 0
    if pages:
        L, two, _, H, D = pages[0].shape
        per_slot = L * two * H * D * pages[0].element_size()
    buf = bytearray(start + n * per_slot + 32)
    buf[:start] = MAGIC + struct.pack("<I", len(head)) + head
    if n:
        S = pages[0].shape[2]
        out = torch.frombuffer(buf, dtype=pages[0].dtype, count=n * per_slot // pages[0].element_size(),
                               offset=start).view(L, 2, n, H, D)          # [L, 2, n, H, D], in the buffer
        for i, pg in enumerate(pages):
            m = min(S, n - i * S)
            out[:, :, i * S:i * S + m] = pg[:, :, :m]
    view = memoryview(buf)
    buf[-32:] = hashlib.sha256(view[len(MAGIC) + 4:-32]).digest()
    return buf


def digest_of(blob) -> str:
    """The SHA-256 a file's bytes carry (of its header and data), in hex; not checked here."""
    return bytes(memoryview(blob)[-32:]).hex()


def install(fs, inode: Inode, snap: SyncSnapshot, tmp: Path, dest: Path) -> bool:
    """Make ``tmp`` the durable copy of ``inode`` if it still is the file ``snap``
    was taken of (named, at the same path); else throw it away.  Whether it was."""
    if not (inode.linked and inode.path == snap.path and inode.ino in fs.inodes):
        Path(tmp).unlink(missing_ok=True)
        return False
    os.replace(tmp, dest)
    if inode.durable and getattr(inode, "durable_file", None) not in (None, dest):
        Path(inode.durable_file).unlink(missing_ok=True)
    inode.durable, inode.durable_file = True, dest
    log.info("synced %s (%d tokens) to %s", inode.path, snap.length, dest)
    return True


def write_durable(fs, inode: Inode) -> Path:
    """Sync ``inode`` at once (the in-process API, and shutdown; the kernel's
    system call runs the same steps in slices, kernel/syscall/durable.py)."""
    snap = sync_snapshot(fs, inode)
    try:
        pages = [fs.pager.read(b) for b in snap.blocks]
    finally:
        release_snapshot(fs, snap)
    tmp, dest = write_file(fs.config.durable_dir, snap, pages)
    install(fs, inode, snap, tmp, dest)
    return dest


def secure_dir(d: Path, repair: bool = False) -> None:
    """The durable directory: made 0700 if missing; with ``repair`` (at start-up),
    an existing one is checked: owned by the kernel's user and 0700, its files
    0600 and the kernel's; whatever is not is repaired (logged).  RuntimeError if
    it cannot be (another user's directory, under a non-root kernel)."""
    if not d.exists():
        d.mkdir(mode=0o700, parents=True)
        return
    if not repair:
        return
    me = os.geteuid()
    st = os.lstat(d)
    if not S_ISDIR(st.st_mode):
        raise RuntimeError(f"durable directory {d} is not a directory")
    if st.st_uid != me:
        if me != 0:
            raise RuntimeError(f"durable directory {d} is owned by uid {st.st_uid}, not by the kernel's "
                               f"user (uid {me}); KV files there could be read or planted by others")
        os.chown(d, me, os.getegid())
        log.warning("durable directory %s was owned by uid %d; now the kernel's (uid %d)", d, st.st_uid, me)
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)
        log.warning("durable directory %s was mode %03o; now 0700 (private to the kernel)", d, st.st_mode & 0o777)
    fixed = 0
    for f in d.iterdir():
        fst = os.lstat(f)
        if S_ISREG(fst.st_mode) and fst.st_uid == me and fst.st_mode & 0o077:
            os.chmod(f, 0o600)
            fixed += 1
    if fixed:
        log.warning("durable directory %s: %d files were readable by others; now 0600", d, fixed)


def remove_durable(fs, inode: Inode) -> None:
    f = getattr(inode, "durable_file", None)
    if f is not None:
        Path(f).unlink(missing_ok=True)
    inode.durable, inode.durable_file = False, None


def rename_durable(fs, old_path: str, inode: Inode) -> None:
    write_durable(fs, inode)


def read_durable(fs, file: Path) -> tuple[dict, torch.Tensor]:
    """Parse and verify one durable file; raises `CorruptFile`."""
    return decode(fs, Path(file).read_bytes(), str(file))


def decode(fs, blob: bytes, file: str) -> tuple[dict, torch.Tensor]:
    """Parse and verify the file format's bytes (``file``: what messages call them): the
    header and the data [L, 2, n, H, D]; `CorruptFile` saying what does not match this
    kernel (a hash, the dtype, the layout, the model).  Reads ``fs`` only: any thread."""
    if len(blob) < len(MAGIC) + 4 + 32 or blob[:len(MAGIC)] != MAGIC:
        raise CorruptFile(f"{file}: not a Symphony KV file (bad magic or too short)")
    (hlen,) = struct.unpack("<I", blob[8:12])
    view = memoryview(blob)
    body, digest = view[12:-32], bytes(view[-32:])            # views: the data is copied once, below
    if hlen > len(body):
        raise CorruptFile(f"{file}: header length {hlen} past the end of the file")
    if hashlib.sha256(body).digest() != digest:
        raise CorruptFile(f"{file}: content hash mismatch (corrupt or truncated)")
    try:
        header = orjson.loads(body[:hlen])
    except orjson.JSONDecodeError as e:
        raise CorruptFile(f"{file}: unreadable header: {e}") from None
    kv = fs.engine.kv
    L, _, _, H, D = kv.page_shape
    # dtype and layout first: the fingerprint covers them too, but this says what differs. A file
    # of the same model and activations with another KV dtype (--kv-dtype) is converted as read.
    dtype, stored = dtype_name(kv.dtype), header.get("dtype")
    same_model = header.get("model") == model_fingerprint(fs.engine)
    if stored != dtype and not (same_model and stored in DTYPES):
        raise CorruptFile(f"{file}: KV data is {stored} but this kernel runs {dtype} "
                          f"(written by a kernel with another --dtype)")
    file_dtype = DTYPES[stored]
    n = header.get("length")
    shape = header.get("page_shape")
    want = [L, 2, H, D]
    if shape != want:
        raise CorruptFile(f"{file}: KV layout {shape} does not match this kernel's {want}")
    if not same_model:
        raise CorruptFile(f"{file}: written by a different model or KV layout (foreign file)")
    raw = body[hlen:]
    per_slot = L * 2 * H * D * torch.empty((), dtype=file_dtype).element_size()
    if not isinstance(n, int) or len(raw) != n * per_slot or len(header.get("positions", [])) != n:
        raise CorruptFile(f"{file}: data length does not match {n} tokens")
    _check_header(header, file, getattr(fs.engine, "max_seq_len", None) or 1 << 30, fs.page_size)
    if not n:
        data = torch.empty(0, dtype=kv.dtype)
    else:                                                     # a writable buffer is used in place
        data = torch.frombuffer(raw if not raw.readonly else bytearray(raw), dtype=torch.uint8).view(file_dtype)
        data = data.to(kv.dtype)                              # (16 bits widened exactly; float32 rounded)
    return header, data.view(L, 2, n, H, D)


def _check_header(h: dict, file: str, context: int, page: int) -> None:
    """The header's fields that become an inode's, checked for type and range (an imported
    file's header comes from a client)."""
    pos = h.get("positions")
    if not isinstance(pos, list) or not all(type(p) is int and 0 <= p < context for p in pos):
        raise CorruptFile(f"{file}: positions must be ints in [0, {context})")
    if len(pos) > context:
        raise CorruptFile(f"{file}: {len(pos)} tokens, more than the context ({context})")
    for k in ("ctime", "mtime"):
        if type(h.get(k)) not in (int, float):
            raise CorruptFile(f"{file}: {k} must be a number")
    if type(h.get("mode")) is not int or not 0 <= h["mode"] <= 0o777:
        raise CorruptFile(f"{file}: mode must be an int in [0, 0o777]")
    if not isinstance(h.get("path"), str) or not isinstance(h.get("owner"), str):
        raise CorruptFile(f"{file}: path and owner must be strings")
    _check_chain(h.get("chain"), page, file)


def _check_chain(c, page: int, file: str) -> None:
    """A chain file's keys (chains.Chains.record): a block of whole pages, at most
    chains.MAX_KEYS keys, each 16 to 64 bytes in hex; a ttl or null."""
    if c is None:
        return
    if not isinstance(c, dict) or set(c) - {"block", "keys", "ttl"}:
        raise CorruptFile(f"{file}: chain must be {{block, keys, ttl}}")
    b, keys, ttl = c.get("block"), c.get("keys"), c.get("ttl")
    if type(b) is not int or b < page or b % page:
        raise CorruptFile(f"{file}: chain block must be a multiple of the page size {page}")
    if not isinstance(keys, list) or len(keys) > MAX_KEYS:
        raise CorruptFile(f"{file}: chain keys must be a list of at most {MAX_KEYS}")
    for k in keys:
        if not isinstance(k, str) or not 32 <= len(k) <= 128:
            raise CorruptFile(f"{file}: a chain key must be 16 to 64 bytes in hex")
        try:
            bytes.fromhex(k)
        except ValueError:
            raise CorruptFile(f"{file}: a chain key must be hex") from None
    if ttl is not None and (type(ttl) not in (int, float) or not ttl > 0):
        raise CorruptFile(f"{file}: chain ttl must be null or seconds > 0")


def materialize(fs, header: dict, data: torch.Tensor, owner: str, mode: int) -> Inode:
    """A new, unlinked inode of ``owner`` holding ``data`` (decoded) in device pages
    (evicting as needed), charged to ``owner``; its times, positions and advice from
    ``header``.  The caller links it (or drops its blocks)."""
    S = fs.page_size
    n_pages = pages_for(header["length"], S)
    fs.memory.make_room(n_pages, set())
    pages = fs.engine.kv.allocator.allocate(n_pages)
    for i, p in enumerate(pages):
        fs.engine.kv.write_page(p, data[:, :, i * S:(i + 1) * S])
    inode = Inode(owner, mode & 0o777, 0)
    inode.blocks = [Block(p, owner, 0) for p in pages]
    fs.quotas.charge(owner, 0, n_pages)
    fs.quotas.refs_by_user[owner] += n_pages
    inode.positions = list(header["positions"])
    inode.ctime, inode.mtime = header["ctime"], header["mtime"]
    advice = header.get("advice", "normal")
    inode.advice = advice if advice in ADVICE else "normal"
    return inode


def load_durable(fs, file: Path) -> Inode:
    """Restore one durable file into the namespace (device pages, evicting as needed)."""
    header, data = read_durable(fs, file)
    path = header["path"]
    parts = split_path(path)
    owner = header["owner"]
    inode = materialize(fs, header, data, owner, int(header["mode"]))
    d = fs.root
    for i, name in enumerate(parts[:-1]):
        nxt = d.children.get(name)
        if nxt is None:
            if parts[0] == "home":                      # /home/<user>/...: the user's, private
                nxt = d.children[name] = Directory(name, d, parts[1], 0o700)
            else:
                nxt = d.children[name] = Directory(name, d, ROOT_USER, 0o755)
            if not (i == 1 and parts[0] == "home"):   # a home directory counts for nobody
                fs.quotas.add_inode(nxt.owner)
        d = nxt
    if parts[-1] in d.children:
        fs.refs.drop(inode.blocks, owner)
        raise CorruptFile(f"{file}: {path} already exists")
    fs._link(d, parts[-1], inode)
    fs.inodes[inode.ino] = inode
    inode.durable, inode.durable_file = True, Path(file)
    fs.chains.restore(inode, header.get("chain"))
    fs.memory.touch(inode)
    return inode


def restore_all(fs) -> dict:
    """Load every durable file; refuse (log, skip) corrupt or foreign ones."""
    d = Path(fs.config.durable_dir)
    report = {"restored": [], "refused": []}
    secure_dir(d, repair=True)
    t0 = time.perf_counter()
    for f in sorted(d.glob("*.tmp")):                  # a sync the kernel did not finish
        f.unlink(missing_ok=True)
    for f in sorted(d.glob("*.kvf")):
        st = os.lstat(f)
        if not S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("refusing durable KV file: %s: not a regular file of the kernel's user", f)
            report["refused"].append((str(f), "not a regular file of the kernel's user"))
            continue
        try:
            inode = load_durable(fs, f)
            report["restored"].append(inode.path)
        except CorruptFile as e:
            log.warning("refusing durable KV file: %s", e)
            report["refused"].append((str(f), str(e)))
    if report["restored"] or report["refused"]:
        log.info("restored %d durable KV files in %.2f s (%d refused)", len(report["restored"]),
                 time.perf_counter() - t0, len(report["refused"]))
    return report
