"""KVFS on a tiny random model: every operation against recomputation, exact
page accounting, typed errors that change nothing, permissions, quotas, tiers,
durability."""
import os

import pytest
import torch

from conftest import HALF_TINY_ATOL, HALF_TINY_SAME_DTYPE_ATOL, TINY_ATOL, tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine, PredError
from symphony.kvfs import (KVFS, AlreadyExists, BadHandle, DirectoryNotEmpty,
                                  InvalidArgument, InvalidPath, IsADirectory, KVFSConfig, KVPred,
                                  NoSpace, NotFound, PermissionDenied, Principal, QuotaExceeded,
                                  ReadOnlyHandle)
from symphony.engine.reference import ReferenceLlama
from symphony.engine.weights import random_weights

ALICE, BOB, ALICE2 = Principal("alice", 1), Principal("bob", 2), Principal("alice", 3)


def toks(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def weights():
    return random_weights(tiny_config(), seed=0)


def make_fs(weights, pages=64, page_size=4, **kw):
    eng = Engine(weights, None, EngineConfig(page_size=page_size, num_pages=pages))
    return KVFS(eng, KVFSConfig(**kw))


def ref_logits(weights, tokens, positions=None):
    return ReferenceLlama(weights).forward(tokens, positions)[-1]


def close(a, b):
    torch.testing.assert_close(a, b, atol=TINY_ATOL, rtol=0)


def used(fs):
    return fs.engine.kv.allocator.num_used


# ------------------------------------------------------------------ operations vs recompute

def test_pred_through_kvfs_and_reopen(weights):
    fs = make_fs(weights)
    h = fs.create(ALICE, "/home/alice/a.kv")
    fs.pred(ALICE, h, toks(10))
    fs.close(ALICE, h)
    h = fs.open(ALICE, "/home/alice/a.kv", "rw")
    close(fs.pred(ALICE, h, [5]), ref_logits(weights, toks(10) + [5]))
    st = fs.stat(ALICE, "/home/alice/a.kv")
    assert st["length"] == 11 and st["pages"] == 3 and st["owner"] == "alice"
    assert st["residency"] == {"device": 3, "host": 0, "disk": 0}


def test_fork_shares_pages_and_both_sides_match(weights):
    fs = make_fs(weights)
    a = fs.create(ALICE)
    fs.pred(ALICE, a, toks(10))                   # 2 full pages + 1 partial
    n0 = used(fs)
    b = fs.fork(ALICE, a)
    assert used(fs) == n0
    la = fs.pred(ALICE, a, [1, 2])                # copies the shared partial page
    lb = fs.pred(ALICE, b, [3])                   # b's partial page is now its own
    assert used(fs) == n0 + 1
    close(la, ref_logits(weights, toks(10) + [1, 2]))
    close(lb, ref_logits(weights, toks(10) + [3]))
    ia, ib = fs.handles[a].inode, fs.handles[b].inode
    assert ia.blocks[:2] == ib.blocks[:2] and ia.blocks[2] is not ib.blocks[2]
    assert all(bl.ref == 2 for bl in ia.blocks[:2])


def test_truncate_extract_merge_match_recompute(weights):
    fs = make_fs(weights, pages=128)
    full = toks(23, seed=1)
    f = fs.create(ALICE)
    fs.pred(ALICE, f, full)
    # truncate
    t = fs.fork(ALICE, f)
    fs.truncate(ALICE, t, 9)
    close(fs.pred(ALICE, t, [7]), ref_logits(weights, full[:9] + [7]))
    # extract keeps original positions: tokens 0..7 and 12..19
    e = fs.extract(ALICE, f, [[0, 8], [12, 20]])
    pos = list(range(8)) + list(range(12, 20))
    assert fs.handles[e].inode.positions == pos
    assert fs.handles[e].inode.blocks[:2] == fs.handles[f].inode.blocks[:2]      # aligned: shared
    got = fs.pred(ALICE, e, [4], positions=[20])
    # recompute: the same KV = each kept token computed with the full prefix before it;
    # a query then attends only to the kept slots.  Build it from per-slot K/V:
    want = _masked_reference(weights, full, keep=set(pos), query=4, qpos=20)
    close(got, want)
    # merge of a split file equals the file
    a = fs.extract(ALICE, f, [[0, 10]])
    b = fs.extract(ALICE, f, [[10, 23]])
    m = fs.merge(ALICE, [a, b])
    assert fs.handles[m].inode.positions == list(range(23))
    close(fs.pred(ALICE, m, [9]), ref_logits(weights, full + [9]))


def _masked_reference(weights, full, keep, query, qpos):
    """Reference for a query attending only to ``keep`` slots of a fully
    computed prefix: run the reference to fill a cache, then select slots."""
    ref = ReferenceLlama(weights)
    cache = ref.new_cache(len(full) + 1)
    ref.forward(full, cache=cache)
    idx = sorted(keep)
    sub = ref.new_cache(len(idx) + 1)
    sub.k[:, :len(idx)] = cache.k[:, idx]
    sub.v[:, :len(idx)] = cache.v[:, idx]
    sub.length = len(idx)
    return ref.forward([query], [qpos], cache=sub)[-1]


def test_swap_out_and_in_round_trip(weights, tmp_path):
    fs = make_fs(weights, pages=8, host_pages=2, swap_dir=str(tmp_path))  # 7 device pages
    a = fs.create(ALICE, "/tmp/a.kv")
    fs.pred(ALICE, a, toks(20, seed=2))            # 5 pages
    b = fs.create(BOB, "/tmp/b.kv")
    fs.pred(BOB, b, toks(16, seed=3))              # needs 4: evicts a's LRU pages (host, then disk)
    st = fs.stat(ALICE, "/tmp/a.kv")["residency"]
    assert st["device"] < 5 and st["host"] + st["disk"] > 0
    close(fs.pred(ALICE, a, [1]), ref_logits(weights, toks(20, seed=2) + [1]))   # swapped back in
    close(fs.pred(BOB, b, [2]), ref_logits(weights, toks(16, seed=3) + [2]))
    assert fs.pager.stats.swap_ins > 0 and fs.pager.stats.demotions > 0


def test_eviction_of_blocks_shared_by_forks(weights):
    fs = make_fs(weights, pages=9, host_pages=16)          # 8 device pages
    a = fs.create(ALICE)
    fs.pred(ALICE, a, toks(8))                             # 2 pages
    b = fs.fork(ALICE, a)
    fs.pred(ALICE, b, toks(4, 1))                          # + 1 own page; 5 free
    x = fs.create(ALICE)
    fs.pred(ALICE, x, toks(32, 2))                         # 8 pages: evict 3, the shared 2 once
    assert fs.stat(ALICE, b)["residency"] == {"device": 0, "host": 3, "disk": 0}
    close(fs.pred(ALICE, b, [5]), ref_logits(weights, toks(8) + toks(4, 1) + [5]))
    fs.pager.swap_out(fs.handles[a].inode.blocks * 2)      # duplicates in the list are harmless


def test_advice_keep_and_drop_first_choose_victims(weights):
    fs = make_fs(weights, pages=9, host_pages=16)  # 8 device pages
    k, d, n = fs.create(ALICE), fs.create(ALICE), fs.create(ALICE)
    fs.pred(ALICE, k, toks(8))                     # 2 pages each
    fs.pred(ALICE, d, toks(8, 1))
    fs.pred(ALICE, n, toks(8, 2))
    fs.advise(ALICE, k, "keep")
    fs.advise(ALICE, d, "drop_first")
    x = fs.create(ALICE)
    fs.pred(ALICE, x, toks(12, 3))                 # 3 pages, 2 free: evicts from d first
    res = lambda h: fs.stat(ALICE, h)["residency"]["device"]
    assert res(d) == 1 and res(k) == 2 and res(n) == 2
    fs.pred(ALICE, x, toks(8, 4))                  # 2 more: d's last page, then n (LRU), never k
    assert res(d) == 0 and res(n) == 1 and res(k) == 2


def test_expire_removes_the_file(weights):
    fs = make_fs(weights)
    h = fs.create(ALICE, "/tmp/old.kv")
    fs.pred(ALICE, h, toks(5))
    fs.advise(ALICE, h, "expire", 0)
    with pytest.raises(NotFound):
        fs.open(ALICE, "/tmp/old.kv")
    fs.close(ALICE, h)                             # last handle: pages freed
    assert used(fs) == 0


# ------------------------------------------------------------------ namespace and errors

def test_remove_frees_pages_when_last_handle_closes(weights):
    fs = make_fs(weights)
    h = fs.create(ALICE, "/shared/sys.kv", mode=0o644)
    fs.pred(ALICE, h, toks(9))
    r = fs.open(BOB, "/shared/sys.kv", "r")
    fs.close(ALICE, h)
    fs.remove(ALICE, "/shared/sys.kv")
    assert used(fs) == 3                           # bob still has it open
    with pytest.raises(NotFound):
        fs.open(ALICE, "/shared/sys.kv")
    f = fs.fork(BOB, r)                            # bob can still read (fork) it
    fs.close(BOB, r)
    assert used(fs) == 3                           # the fork holds the pages
    fs.close(BOB, f)
    assert used(fs) == 0


def test_typed_errors_change_nothing(weights):
    fs = make_fs(weights)
    h = fs.create(ALICE, "/home/alice/x.kv")
    fs.pred(ALICE, h, toks(6))
    ro = fs.open(ALICE, "/home/alice/x.kv", "r")
    snapshot = (used(fs), fs.handles[h].inode.length)
    cases = [
        (ReadOnlyHandle, lambda: fs.pred(ALICE, ro, [1])),
        (ReadOnlyHandle, lambda: fs.truncate(ALICE, ro, 1)),
        (NotFound, lambda: fs.open(ALICE, "/home/alice/missing.kv")),
        (AlreadyExists, lambda: fs.create(ALICE, "/home/alice/x.kv")),
        (InvalidPath, lambda: fs.create(ALICE, "relative.kv")),
        (InvalidPath, lambda: fs.create(ALICE, "/etc/passwd")),
        (InvalidPath, lambda: fs.create(ALICE, "/home/alice/../bob/x.kv")),
        (InvalidPath, lambda: fs.create(ALICE, "/home")),
        (BadHandle, lambda: fs.pred(ALICE, 999, [1])),
        (BadHandle, lambda: fs.pred(BOB, h, [1])),            # another process's handle
        (BadHandle, lambda: fs.close(ALICE2, h)),              # same user, other process
        (IsADirectory, lambda: fs.open(ALICE, "/home/alice")),
        (IsADirectory, lambda: fs.remove(ALICE, "/home/alice")),
        (InvalidArgument, lambda: fs.truncate(ALICE, h, 7)),
        (InvalidArgument, lambda: fs.extract(ALICE, h, [[3, 2]])),
        (InvalidArgument, lambda: fs.extract(ALICE, h, [[0, 4], [2, 5]])),
        (InvalidArgument, lambda: fs.open(ALICE, "/home/alice/x.kv", "w")),
        (InvalidArgument, lambda: fs.advise(ALICE, h, "forever")),
        (PredError, lambda: fs.pred(ALICE, h, [10**6])),
        (InvalidArgument, lambda: fs.pred_batch([KVPred(ALICE, h, [1]), KVPred(ALICE, h, [2])])),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()
        assert (used(fs), fs.handles[h].inode.length) == snapshot
    fs.mkdir(ALICE, "/home/alice/d")
    fs.create(ALICE, "/home/alice/d/f.kv")
    with pytest.raises(DirectoryNotEmpty):
        fs.rmdir(ALICE, "/home/alice/d")


def test_permissions(weights):
    fs = make_fs(weights)
    p = fs.create(ALICE, "/home/alice/private.kv", mode=0o600)
    fs.pred(ALICE, p, toks(4))
    s = fs.create(ALICE, "/home/alice/public.kv", mode=0o644)
    with pytest.raises(PermissionDenied):
        fs.open(BOB, "/home/alice/private.kv")
    with pytest.raises(PermissionDenied):
        fs.open(BOB, "/home/alice/public.kv", "rw")
    fs.close(BOB, fs.open(BOB, "/home/alice/public.kv", "r"))
    with pytest.raises(PermissionDenied):
        fs.create(BOB, "/home/alice/intruder.kv")
    with pytest.raises(PermissionDenied):
        fs.remove(BOB, "/home/alice/public.kv")
    with pytest.raises(PermissionDenied):
        fs.chmod(BOB, "/home/alice/private.kv", 0o666)
    # /shared is sticky: bob may add files but not remove alice's
    fs.create(ALICE, "/shared/a.kv")
    fs.create(BOB, "/shared/b.kv")
    with pytest.raises(PermissionDenied):
        fs.remove(BOB, "/shared/a.kv")
    with pytest.raises(PermissionDenied):
        fs.rename(BOB, "/shared/a.kv", "/shared/c.kv")
    fs.remove(BOB, "/shared/b.kv")
    fs.chmod(ALICE, "/home/alice/private.kv", 0o644)
    fs.close(BOB, fs.open(BOB, "/home/alice/private.kv"))
    fs.rename(ALICE, "/home/alice/public.kv", "/shared/pub.kv")
    assert [e["name"] for e in fs.list(BOB, "/shared")] == ["a.kv", "pub.kv"]
    fs.close(ALICE, s)


def test_private_defaults_and_the_umask(weights):
    fs = make_fs(weights)
    h = fs.create(ALICE, "/home/alice/secret.kv")            # no mode: private
    fs.pred(ALICE, h, toks(4))
    assert fs.stat(ALICE, "/home/alice/secret.kv")["mode"] == 0o600
    assert fs.stat(ALICE, "/home/alice")["mode"] == 0o700   # made on first use, private
    for attempt in (lambda: fs.open(BOB, "/home/alice/secret.kv"),
                    lambda: fs.list(BOB, "/home/alice"),
                    lambda: fs.create(BOB, "/home/alice/planted.kv"),
                    lambda: fs.mkdir(BOB, "/home/alice/d")):
        with pytest.raises(PermissionDenied):
            attempt()
    fs.mkdir(ALICE, "/home/alice/d")
    assert fs.stat(ALICE, "/home/alice/d")["mode"] == 0o700
    # the umask (022) clears "others may write" from any mode asked for, fork's included
    fs.create(ALICE, "/shared/pub.kv", mode=0o666)
    assert fs.stat(ALICE, "/shared/pub.kv")["mode"] == 0o644
    fs.fork(ALICE, h, "/shared/fork.kv", mode=0o646)
    fs.extract(ALICE, h, [[0, 2]], "/home/alice/x.kv")
    fs.merge(ALICE, [h], "/home/alice/m.kv", mode=0o640)
    assert [fs.stat(ALICE, p)["mode"] for p in ("/shared/fork.kv", "/home/alice/x.kv", "/home/alice/m.kv")] \
        == [0o644, 0o600, 0o640]
    fs.close(BOB, fs.open(BOB, "/shared/fork.kv"))            # shared read-only on purpose
    with pytest.raises(PermissionDenied):
        fs.open(BOB, "/shared/fork.kv", "rw")
    fs.chmod(ALICE, "/home/alice/secret.kv", 0o666)
    assert fs.stat(ALICE, "/home/alice/secret.kv")["mode"] == 0o644
    with pytest.raises(InvalidArgument):
        fs.fork(ALICE, h, "/home/alice/y.kv", mode=0o4777)
    with pytest.raises(NotFound):
        fs.stat(ALICE, "/home/alice/y.kv")                    # a bad mode made nothing
    # an administrator's stricter umask: nothing can be shared
    strict = make_fs(weights, umask=0o077)
    strict.create(ALICE, "/shared/s.kv", mode=0o644)
    assert strict.stat(ALICE, "/shared/s.kv")["mode"] == 0o600
    with pytest.raises(ValueError):
        make_fs(weights, umask=0o1000)


def test_inode_quota(weights):
    fs = make_fs(weights, user_inode_quota=3)
    fs.mkdir(ALICE, "/home/alice/d")                          # a directory counts
    fs.create(ALICE, "/home/alice/d/a.kv")
    anon = fs.create(ALICE)                                   # anonymous files do not
    fs.fork(ALICE, anon, "/shared/b.kv")
    for attempt in (lambda: fs.create(ALICE2, "/tmp/c.kv"), lambda: fs.mkdir(ALICE, "/tmp/e"),
                    lambda: fs.fork(ALICE, anon, "/tmp/c.kv"), lambda: fs.merge(ALICE, [anon], "/tmp/c.kv")):
        with pytest.raises(QuotaExceeded, match="user 'alice' has 3 named KV files and directories, "
                                                "inode quota 3"):
            attempt()
    with pytest.raises(NotFound):
        fs.stat(ALICE, "/tmp/c.kv")
    fs.close(BOB, fs.create(BOB, "/tmp/c.kv"))                # another user's own quota
    fs.rename(ALICE, "/shared/b.kv", "/home/alice/b.kv")      # a rename is no new inode
    fs.remove(ALICE, "/home/alice/b.kv")                      # a removal frees one
    fs.create(ALICE, "/tmp/c2.kv")
    fs.remove(ALICE, "/home/alice/d/a.kv")
    fs.rmdir(ALICE, "/home/alice/d")
    assert fs.quotas.inodes_by_user == {"alice": 1, "bob": 1}
    for i in range(5):                                        # root is exempt
        fs.create(Principal("root", 9), f"/shared/r{i}.kv")


def test_quotas_per_user_and_process(weights):
    fs = make_fs(weights, pages=64, user_page_quota=6, process_page_quota=4)
    a = fs.create(ALICE)
    fs.pred(ALICE, a, toks(16))                    # 4 pages: process quota reached
    with pytest.raises(QuotaExceeded, match="process 1"):
        fs.pred(ALICE, a, [1])
    assert fs.handles[a].inode.length == 16
    b = fs.create(ALICE2)
    fs.pred(ALICE2, b, toks(8))                    # alice's second process: 6 pages total
    with pytest.raises(QuotaExceeded, match="user 'alice'"):
        fs.pred(ALICE2, b, [1] * 5)
    c = fs.create(BOB)
    fs.pred(BOB, c, toks(16))                      # bob is unaffected
    fs.fork(ALICE, a)                              # forking charges nothing
    with pytest.raises(QuotaExceeded):
        fs.extract(ALICE, a, [[1, 3]])             # a copy would need a page
    fs.exit_process(1)                             # anonymous files die with the process
    assert fs.quotas.by_user["alice"] == 2 and used(fs) == 2 + 4
    fs.close(BOB, c)
    fs.exit_process(3)
    assert used(fs) == 0 and fs.quotas.by_user["alice"] == 0


def test_out_of_space_is_an_error_and_changes_nothing(weights):
    fs = make_fs(weights, pages=5, host_pages=0)   # 4 device pages, no host, no disk
    a = fs.create(ALICE)
    fs.pred(ALICE, a, toks(12))
    b = fs.create(ALICE)
    with pytest.raises(NoSpace):
        fs.pred(ALICE, b, toks(8))
    assert fs.handles[b].inode.length == 0 and used(fs) == 3


# ------------------------------------------------------------------ durability

def test_sync_survives_restart_and_refuses_corrupt_or_foreign(weights, tmp_path):
    d = str(tmp_path / "durable")
    fs = make_fs(weights, durable_dir=d)
    h = fs.create(ALICE, "/home/alice/keep.kv")
    fs.pred(ALICE, h, toks(11), positions=list(range(5, 16)))
    fs.sync(ALICE, h)
    g = fs.create(BOB, "/shared/other.kv")
    fs.pred(BOB, g, toks(3, 9))
    fs.sync(BOB, g)
    with pytest.raises(InvalidArgument):
        fs.sync(ALICE, fs.create(ALICE))            # anonymous
    # restart: a new engine and KVFS on the same weights
    fs2 = make_fs(weights, durable_dir=d)
    assert sorted(fs2.restore_report["restored"]) == ["/home/alice/keep.kv", "/shared/other.kv"]
    r = fs2.open(ALICE, "/home/alice/keep.kv", "rw")
    assert fs2.stat(ALICE, r)["owner"] == "alice"
    close(fs2.pred(ALICE, r, [3]), ref_logits(weights, toks(11) + [3], list(range(5, 17))))
    # corrupt one byte of one file, and restart on a different model
    files = sorted(os.listdir(d))
    p = os.path.join(d, files[0])
    blob = bytearray(open(p, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(p, "wb").write(blob)
    fs3 = make_fs(weights, durable_dir=d)
    assert len(fs3.restore_report["refused"]) == 1
    assert "hash mismatch" in fs3.restore_report["refused"][0][1]
    other = random_weights(tiny_config(), seed=5)
    fs4 = make_fs(other, durable_dir=d)
    assert fs4.restore_report["restored"] == []
    assert any("foreign" in why for _, why in fs4.restore_report["refused"])
    # removing a durable file removes it from disk
    fs2.remove(BOB, "/shared/other.kv")
    assert len(os.listdir(d)) == 1


# ------------------------------------------------------------------ bfloat16

BF16 = torch.bfloat16


def make_fs_bf16(weights, pages=64, page_size=4, **kw):
    eng = Engine(weights, None, EngineConfig(page_size=page_size, num_pages=pages, dtype=BF16))
    return KVFS(eng, KVFSConfig(**kw))


def close_bf16(got, weights, tokens, positions=None):
    """bfloat16 engine logits vs ReferenceLlama in float32 and in bfloat16 (conftest tolerances)."""
    torch.testing.assert_close(got, ref_logits(weights, tokens, positions),
                               atol=HALF_TINY_ATOL[BF16], rtol=0)
    torch.testing.assert_close(got, ReferenceLlama(weights, dtype=BF16).forward(tokens, positions)[-1],
                               atol=HALF_TINY_SAME_DTYPE_ATOL[BF16], rtol=0)


def file_pages(fs, hid):
    """A file's K/V, [n_layers, 2, length, n_kv_heads, head_dim], from whatever tier holds it."""
    ino = fs.handles[hid].inode
    return torch.cat([fs.pager.read(b) for b in ino.blocks], dim=2)[:, :, :ino.length]


def bits(t):
    return t.contiguous().view(torch.int16)


def test_bf16_swap_to_host_and_disk_and_back_is_bit_exact(weights, tmp_path):
    fs = make_fs_bf16(weights, pages=8, host_pages=1, swap_dir=str(tmp_path))   # 7 device pages
    assert fs.pager.host_chunks == []                          # the host tier is made when needed
    a = fs.create(ALICE, "/tmp/a.kv")
    fs.pred(ALICE, a, toks(20, seed=2))                        # 5 pages
    before = file_pages(fs, a).clone()
    assert before.dtype == BF16 and before.abs().sum() > 0
    b = fs.create(BOB, "/tmp/b.kv")
    fs.pred(BOB, b, toks(16, seed=3))                          # evicts a's pages: host, then disk
    blocks = fs.handles[a].inode.blocks
    assert any(bl.host >= 0 for bl in blocks) and any(bl.disk >= 0 for bl in blocks)
    assert torch.equal(bits(file_pages(fs, a)), bits(before))   # read back from host and disk
    assert fs.pager.host_chunks[0].dtype == BF16
    c = fs.create(BOB, "/tmp/c.kv")
    fs.pred(BOB, c, toks(3, seed=4))                           # one more page: a's host block is
    assert fs.pager.stats.demotions == 1                       # demoted to disk for room
    assert sum(bl.disk >= 0 for bl in blocks) == 2
    assert torch.equal(bits(file_pages(fs, a)), bits(before))
    close_bf16(fs.pred(ALICE, a, [1]), weights, toks(20, seed=2) + [1])   # swapped back in
    assert all(bl.device >= 0 for bl in fs.handles[a].inode.blocks)
    assert torch.equal(bits(file_pages(fs, a)[:, :, :20]), bits(before))
    assert fs.pager.stats.swap_ins > 0 and fs.pager.stats.disk_reads > 0
    close_bf16(fs.pred(BOB, b, [2]), weights, toks(16, seed=3) + [2])


def test_bf16_durable_file_reloads_bit_exact_and_dtype_mismatch_is_refused(weights, tmp_path):
    d = str(tmp_path / "durable")
    fs = make_fs_bf16(weights, durable_dir=d)
    h = fs.create(ALICE, "/home/alice/keep.kv")
    fs.pred(ALICE, h, toks(11), positions=list(range(5, 16)))
    fs.sync(ALICE, h)
    saved = file_pages(fs, h).clone()
    (f,) = os.listdir(d)
    size = os.path.getsize(os.path.join(d, f))
    c = weights.config
    assert size > 11 * c.n_layers * 2 * c.kv_size * 2          # 2 bytes an element ...
    assert size < 11 * c.n_layers * 2 * c.kv_size * 4          # ... not 4
    # restart on the same weights in bfloat16: restored bit for bit
    fs2 = make_fs_bf16(weights, durable_dir=d)
    assert fs2.restore_report["restored"] == ["/home/alice/keep.kv"]
    r = fs2.open(ALICE, "/home/alice/keep.kv", "rw")
    assert torch.equal(bits(file_pages(fs2, r)), bits(saved))
    close_bf16(fs2.pred(ALICE, r, [3]), weights, toks(11) + [3], list(range(5, 17)))
    # a float32 kernel refuses the bfloat16 file, saying why
    fs3 = make_fs(weights, durable_dir=d)
    assert fs3.restore_report["restored"] == []
    [(_, why)] = fs3.restore_report["refused"]
    assert "KV data is bfloat16 but this kernel runs float32" in why


def test_float32_durable_file_is_refused_by_a_bf16_kernel(weights, tmp_path):
    d = str(tmp_path / "durable")
    fs = make_fs(weights, durable_dir=d)
    h = fs.create(ALICE, "/home/alice/f32.kv")
    fs.pred(ALICE, h, toks(9))
    fs.sync(ALICE, h)
    fs2 = make_fs_bf16(weights, durable_dir=d)
    assert fs2.restore_report["restored"] == []
    [(path, why)] = fs2.restore_report["refused"]
    assert "KV data is float32 but this kernel runs bfloat16" in why and "--dtype" in why
    assert os.path.exists(path)                                 # refused files stay in place
    with pytest.raises(NotFound):
        fs2.open(ALICE, "/home/alice/f32.kv")
    # and the float32 kernel still loads it
    fs3 = make_fs(weights, durable_dir=d)
    assert fs3.restore_report["restored"] == ["/home/alice/f32.kv"]


def test_pager_read_is_a_copy_not_a_view_of_the_pool(weights):
    """`Pager.read` of a device block on the CPU used to return a view of the pool: a page
    reused after the read changed what the caller held."""
    fs = make_fs(weights, pages=8)
    a = fs.create(ALICE, "/tmp/a.kv")
    fs.pred(ALICE, a, toks(4, seed=5))                         # one page
    b = fs.handles[a].inode.blocks[0]
    got = fs.pager.read(b)
    before = got.clone()
    fs.engine.kv.pool[:, :, b.device] += 1.0                   # the page changes (reused, say)
    assert torch.equal(got, before)
    assert torch.equal(fs.pager.read(b), before + 1.0)


def test_a_process_peak_pages_are_counted_at_every_charge(weights):
    """`Quotas.peak(pid)`: the most pages a process held at once, whatever was freed since
    (the kernel's admission estimate for the next LIP of the same program); gone at exit."""
    fs = make_fs(weights, pages=16)
    a = fs.create(ALICE, "/tmp/a.kv")
    fs.pred(ALICE, a, toks(10, seed=1))                        # 3 pages of 4
    b = fs.create(ALICE, "/tmp/b.kv")
    fs.pred(ALICE, b, toks(5, seed=2))                         # 2 more
    assert fs.quotas.by_pid[ALICE.pid] == fs.quotas.peak(ALICE.pid) == 5
    fs.remove(ALICE, "/tmp/a.kv")
    fs.close(ALICE, a)
    assert fs.quotas.by_pid[ALICE.pid] == 2 and fs.quotas.peak(ALICE.pid) == 5
    assert fs.quotas.peak(BOB.pid) == 0
    fs.exit_process(ALICE.pid)
    assert fs.quotas.peak(ALICE.pid) == 0
