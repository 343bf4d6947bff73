"""Moving KV files between KVFSes (kvfs/transfer.py): export, import, adopt, on a tiny random
model.  A file moved gives the logits the original gives; permissions and quotas are the
importer's; a byte changed, another model or dtype, or a hostile header is refused and
changes nothing; advice and the time to expiry travel; adopting takes only one's own files."""
import hashlib
import struct
import time

import orjson
import pytest
import torch

from conftest import tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.weights import random_weights
from symphony.kvfs import (KVFS, AlreadyExists, KVFSConfig, PermissionDenied, Principal, QuotaExceeded)
from symphony.kvfs.errors import CorruptFile
from symphony.kvfs.store import MAGIC, decode, encode, write_durable
from symphony.kvfs.transfer import adopt, durable_id, export_job, import_file, max_import_bytes

ALICE, BOB = Principal("alice", 0), Principal("bob", 0)


def toks(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny_config(), seed=0)


def make_fs(weights, pages=64, dtype=None, **kw):
    return KVFS(Engine(weights, None, EngineConfig(page_size=4, num_pages=pages, dtype=dtype)), KVFSConfig(**kw))


def export(fs, who, path) -> bytes:
    job = export_job(fs, who, path)
    try:
        while True:
            next(job)
    except StopIteration as e:
        return encode(*e.value)


def made(fs, who, path, n=10, positions=None):
    h = fs.create(who, path)
    fs.pred(who, h, toks(n), positions=positions)
    fs.close(who, h)


def cont(fs, who, path):
    """The logits of one more token after the file (on a fork: the file is left as it is)."""
    h = fs.open(who, path, "r")
    f = fs.fork(who, h)
    out = fs.pred(who, f, [7])
    fs.close(who, f)
    fs.close(who, h)
    return out


def test_a_moved_file_gives_the_logits_of_the_original(weights):
    a, b = make_fs(weights), make_fs(weights)
    made(a, ALICE, "/home/alice/doc.kv", 11, positions=list(range(3, 14)))
    blob = export(a, ALICE, "/home/alice/doc.kv")
    header, data = decode(b, blob, "test")
    used = b.engine.kv.allocator.num_used
    inode = import_file(b, ALICE, "/home/alice/moved.kv", header, data)
    assert b.engine.kv.allocator.num_used == used + 3 and b.quotas.by_user["alice"] == 3
    st = b.stat(ALICE, "/home/alice/moved.kv")
    assert (st["length"], st["owner"], st["mode"], st["next_position"]) == (11, "alice", 0o600, 14)
    assert inode.positions == list(range(3, 14))
    assert torch.equal(cont(a, ALICE, "/home/alice/doc.kv"), cont(b, ALICE, "/home/alice/moved.kv"))


def test_permissions_are_the_readers_and_the_importers(weights):
    a, b = make_fs(weights), make_fs(weights)
    made(a, ALICE, "/home/alice/doc.kv")
    with pytest.raises(PermissionDenied, match="bob may not open /home/alice/doc.kv"):
        export(a, BOB, "/home/alice/doc.kv")
    a.chmod(ALICE, "/home/alice/doc.kv", 0o644)
    blob = export(a, BOB, "/home/alice/doc.kv")           # now readable: anyone may copy it
    header, data = decode(b, blob, "t")
    made(b, ALICE, "/home/alice/own.kv")                             # alice's home exists there
    used = b.engine.kv.allocator.num_used
    with pytest.raises(PermissionDenied):
        import_file(b, BOB, "/home/alice/doc.kv", header, data)      # not bob's home
    import_file(b, BOB, "/home/bob/copy.kv", header, data)
    assert b.stat(BOB, "/home/bob/copy.kv")["owner"] == "bob"         # the importer's, charged to bob
    assert b.quotas.by_user["bob"] == 3 and b.quotas.by_user["alice"] == 3         # alice: her own.kv
    with pytest.raises(AlreadyExists):
        import_file(b, BOB, "/home/bob/copy.kv", header, data)
    assert b.engine.kv.allocator.num_used == used + 3                 # the refusals took nothing


def test_an_import_over_the_quota_is_refused_before_any_page_is_taken(weights):
    a, b = make_fs(weights), make_fs(weights, user_page_quota=2)
    made(a, ALICE, "/home/alice/doc.kv", 10)                          # 3 pages
    header, data = decode(b, export(a, ALICE, "/home/alice/doc.kv"), "t")
    assert max_import_bytes(b, ALICE) < len(export(a, ALICE, "/home/alice/doc.kv")) + (2 << 20)
    with pytest.raises(QuotaExceeded):
        import_file(b, ALICE, "/home/alice/doc.kv", header, data)
    assert b.engine.kv.allocator.num_used == 0 and "doc.kv" not in b.root.children["home"].children.get(
        "alice", b.root).children


def test_another_model_dtype_or_a_changed_byte_is_refused(weights):
    a = make_fs(weights)
    made(a, ALICE, "/home/alice/doc.kv")
    blob = export(a, ALICE, "/home/alice/doc.kv")
    other = make_fs(random_weights(tiny_config(), seed=5))
    with pytest.raises(CorruptFile, match="written by a different model"):
        decode(other, blob, "t")
    with pytest.raises(CorruptFile, match="KV data is float32 but this kernel runs bfloat16"):
        decode(make_fs(weights, dtype=torch.bfloat16), blob, "t")
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(CorruptFile, match="content hash mismatch"):
        decode(a, bytes(bad), "t")


def _rehash(blob: bytes, **changes) -> bytes:
    """A blob with header fields changed and a valid hash again (what a hostile client can send)."""
    (n,) = struct.unpack("<I", blob[8:12])
    header = dict(orjson.loads(blob[12:12 + n]), **changes)
    h = orjson.dumps(header)
    raw = blob[12 + n:-32]
    return MAGIC + struct.pack("<I", len(h)) + h + raw + hashlib.sha256(h + raw).digest()


@pytest.mark.parametrize("changes, match", [
    ({"positions": [10 ** 9] * 10}, "positions must be ints in"), ({"positions": ["x"] * 10}, "positions must be"),
    ({"mode": 0o4777}, "mode must be an int"), ({"ctime": "now"}, "ctime must be a number"),
    ({"length": 9}, "data length does not match"), ({"owner": 3}, "path and owner must be strings")])
def test_a_hostile_header_with_a_valid_hash_is_refused(weights, changes, match):
    a = make_fs(weights)
    made(a, ALICE, "/home/alice/doc.kv")
    with pytest.raises(CorruptFile, match=match):
        decode(a, _rehash(export(a, ALICE, "/home/alice/doc.kv"), **changes), "t")


def test_advice_and_the_time_left_travel(weights):
    a, b = make_fs(weights), make_fs(weights)
    made(a, ALICE, "/home/alice/c.kv")
    h = a.open(ALICE, "/home/alice/c.kv", "rw")
    a.advise(ALICE, h, "cache")
    a.advise(ALICE, h, "expire", 100)
    a.close(ALICE, h)
    header, data = decode(b, export(a, ALICE, "/home/alice/c.kv"), "t")
    inode = import_file(b, ALICE, "/home/alice/c.kv", header, data, mode=0o640)
    assert inode.advice == "cache" and 95 < inode.expire_at - time.monotonic() <= 100
    assert b.stat(ALICE, "/home/alice/c.kv")["mode"] == 0o640 & ~b.config.umask


def test_adopting_a_dead_kernels_durable_files_takes_only_ones_own_below_the_directory(weights, tmp_path):
    d = tmp_path / "durable"
    a = make_fs(weights, durable_dir=str(d))
    ident = durable_id(str(d), create=True)
    assert durable_id(str(d)) == ident and len(ident) == 32
    a.create(ALICE, "/home/alice/made-home")                          # (alice's home, made on first use)
    for path in ("/home/alice/cache", "/home/alice/other"):
        a.mkdir(ALICE, path)
    for who, path in ((ALICE, "/home/alice/cache/x"), (ALICE, "/home/alice/other/y"), (BOB, "/shared/z"), (ALICE, "/shared/w")):
        made(a, who, path)
        write_durable(a, a.inodes[max(a.inodes)])
    b = make_fs(weights)
    got = adopt(b, ALICE, str(d), "/home/alice/cache")
    assert got == {"adopted": ["/home/alice/cache/x"], "refused": []}
    assert torch.equal(cont(a, ALICE, "/home/alice/cache/x"), cont(b, ALICE, "/home/alice/cache/x"))
    assert adopt(b, BOB, str(d), "/shared")["adopted"] == ["/shared/z"]             # not alice's w
    again = adopt(b, ALICE, str(d), "/home/alice/cache")
    assert again["adopted"] == [] and "exists" in again["refused"][0][1]
