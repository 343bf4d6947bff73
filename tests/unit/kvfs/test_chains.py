"""Chain files (kvfs/chains.py): the longest written chain, forked with shared pages and equal
to recomputation; promises and waits with their bounds; trust, permissions and planted files;
the index kept true through truncate, rename, remove, expiry and cache drops; claims under
quota; pruning of redundant files."""
import hashlib

import pytest
import torch

from conftest import TINY_ATOL, tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.reference import ReferenceLlama
from symphony.engine.weights import random_weights
from symphony.kvfs import KVFS, InvalidArgument, KVFSConfig, PermissionDenied, Principal
from symphony.kvfs.chains import STALL_S, ChainWait

ALICE, ALICE2, BOB, ROOT = Principal("alice", 1), Principal("alice", 2), Principal("bob", 3), Principal("root", 4)
B = 4                                   # tokens a block (the page size here)


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny_config(), seed=0)


def make_fs(weights, pages=64, **kw):
    return KVFS(Engine(weights, None, EngineConfig(page_size=B, num_pages=pages)), KVFSConfig(**kw))


def toks(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def keys(tokens, salt=b"k"):
    """The hash chain of the tokens' full blocks."""
    out, prev = [], hashlib.blake2b(salt, digest_size=16).digest()
    for i in range(len(tokens) // B):
        prev = hashlib.blake2b(prev + bytes(str(tokens[i * B:(i + 1) * B]), "ascii"), digest_size=16).digest()
        out.append(prev)
    return out


def lookup(fs, who, d, tokens, claim=True, limit=None, trust=(), ttl=None, mode=None):
    """(handle, claimed, blocks forked) of a lookup that does not wait."""
    ks = keys(tokens)
    dd = fs.listable(who, d)
    m = fs.chains.find(who, dd, ks, B, len(ks) if limit is None else limit, trust)
    h, claimed = fs.chains.open(who, dd, m, ks, B, claim=claim, mode=mode, ttl=ttl)
    return h, claimed, m.blocks


def ref(weights, tokens):
    return ReferenceLlama(weights).forward(tokens)[-1]


def ino(fs, h):
    return fs.handles[h].inode


def test_the_longest_written_chain_is_forked_with_shared_pages_and_equals_recompute(weights):
    fs = make_fs(weights)
    fs.mkdir(ALICE, "/home/alice/c")
    a = toks(14)
    h, claimed, got = lookup(fs, ALICE, "/home/alice/c", a)
    assert claimed and got == 0 and fs.stat(ALICE, h)["advice"] == "cache"
    assert ino(fs, h).path.startswith("/home/alice/c/") and len(ino(fs, h).name) == 16
    fs.pred(ALICE, h, a)
    fs.close(ALICE, h)
    b = a[:10] + toks(6, seed=1)                       # 2 blocks in common, the third differs
    h2, claimed, got = lookup(fs, ALICE2, "/home/alice/c", b, claim=False)
    src = fs.chains.find(ALICE2, fs.listable(ALICE2, "/home/alice/c"), keys(a), B, 3).source
    assert not claimed and got == 2 and ino(fs, h2).path is None and fs.stat(ALICE2, h2)["length"] == 8
    assert [x.id for x in ino(fs, h2).blocks] == [x.id for x in src.blocks[:2]]       # shared, not copied
    torch.testing.assert_close(fs.pred(ALICE2, h2, b[8:]), ref(weights, b), atol=TINY_ATOL, rtol=0)
    # the limit: never more blocks than asked for (a prompt's last token must be computed)
    h3, _, got = lookup(fs, ALICE2, "/home/alice/c", a[:12], claim=False, limit=2)
    assert got == 2
    assert fs.stats()["chain_hit_blocks"] == 4 and fs.stats()["chain_files"] == 1


def test_only_trusted_readable_unwritable_files_of_the_same_block_count(weights):
    fs = make_fs(weights)
    fs.mkdir(ROOT, "/shared/c")
    fs.chmod(ROOT, "/shared/c", 0o777)
    t = toks(12)
    ks = keys(t)
    hb = fs.create(BOB, "/shared/c/planted", mode=0o644)      # bob plants other tokens under alice's keys
    fs.pred(BOB, hb, toks(12, seed=5))
    fs.chains.publish(BOB, hb, ks, B)
    d = fs.listable(ALICE, "/shared/c")
    assert fs.chains.find(ALICE, d, ks, B, 3).blocks == 0                       # not trusted
    assert fs.chains.find(ALICE, d, ks, B, 3, trust=["bob"]).blocks == 3        # trusted: used as it is
    assert fs.chains.find(ALICE, d, ks, B * 2, 3, trust=["bob"]).blocks == 0    # another block size
    fs.chmod(BOB, "/shared/c/planted", 0o600)
    assert fs.chains.find(ALICE, d, ks, B, 3, trust=["bob"]).blocks == 0        # unreadable
    fs.chmod(ROOT, "/shared/c/planted", 0o646)
    assert fs.chains.find(ALICE, d, ks, B, 3, trust=["bob"]).blocks == 0        # others may write it
    # positions other than 0, 1, 2, ... never match
    hp = fs.create(ALICE, "/shared/c/shifted", mode=0o644)
    fs.pred(ALICE, hp, t, positions=list(range(5, 17)))
    fs.chains.publish(ALICE, hp, ks, B)
    assert fs.chains.find(ALICE, d, ks, B, 3).blocks == 0
    # a lookup needs read permission on the directory, a claim write permission
    fs.mkdir(ALICE, "/home/alice/c")
    with pytest.raises(PermissionDenied):
        fs.listable(BOB, "/home/alice/c")
    fs.mkdir(ROOT, "/shared/ro", mode=0o755)
    h, claimed, _ = lookup(fs, ALICE, "/shared/ro", t)
    assert not claimed and ino(fs, h).path is None


def test_publish_checks_its_arguments(weights):
    fs = make_fs(weights)
    h = fs.create(ALICE)
    with pytest.raises(InvalidArgument, match="named"):
        fs.chains.publish(ALICE, h, keys(toks(8)), B)
    n = fs.create(ALICE, "/home/alice/n")
    with pytest.raises(InvalidArgument, match="multiple of the page size"):
        fs.chains.publish(ALICE, n, keys(toks(8)), 6)
    r = fs.open(ALICE2, "/home/alice/n", "r")
    with pytest.raises(PermissionDenied):
        fs.chains.publish(ALICE2, r, keys(toks(8)), B)
    fs.chains.publish(ALICE, n, keys(toks(8)), B)
    fs.chains.publish(ALICE, n, [], B)                                       # no keys: no chain file
    assert ino(fs, n).chain is None and fs.stats()["chain_files"] == 0


def test_a_lookup_waits_for_promised_blocks_and_forks_them_as_they_are_written(weights):
    fs = make_fs(weights)
    fs.mkdir(ALICE, "/home/alice/c")
    t = toks(16)
    w, claimed, _ = lookup(fs, ALICE, "/home/alice/c", t)                    # the writer's claim: 4 promised
    d = fs.listable(ALICE2, "/home/alice/c")
    ks = keys(t[:12] + toks(4, seed=9))                                       # 3 blocks in common
    wait = ChainWait(fs.chains, ALICE2, d, ks, B, 4, (), deadline=1e18)
    assert wait.poll() is None
    assert fs.chains.find(ALICE, d, ks, B, 4).pending is None                # never one's own promise
    fs.pred(ALICE, w, t[:8])
    assert wait.poll() is None                                                # 2 of 3 written
    fs.pred(ALICE, w, t[8:13])
    m = wait.poll()
    assert m is not None and m.blocks == 3 and m.pending is None
    h, _ = fs.chains.open(ALICE2, d, m, ks, B, claim=True)
    torch.testing.assert_close(fs.pred(ALICE2, h, [7]), ref(weights, t[:12] + [7]), atol=TINY_ATOL, rtol=0)
    assert fs.stats()["chain_waits"] == 1


def test_a_wait_ends_at_its_deadline_when_the_writer_closes_or_dies_or_stalls(weights):
    fs = make_fs(weights)
    fs.mkdir(ALICE, "/home/alice/c")
    t = toks(16)
    ks = keys(t)
    d = fs.listable(ALICE2, "/home/alice/c")
    w, _, _ = lookup(fs, ALICE, "/home/alice/c", t)
    fs.pred(ALICE, w, t[:5])
    now = fs.chains.find(ALICE2, d, ks, B, 4).pending.chain.seen[1]
    wait = ChainWait(fs.chains, ALICE2, d, ks, B, 4, (), deadline=now + 3)
    assert wait.poll(now + 1) is None
    m = wait.poll(now + 3)                                        # the deadline: what is written by then
    assert m.blocks == 1 and m.pending is not None
    # stalled: no growth for STALL_S; later lookups do not wait for it either
    wait = ChainWait(fs.chains, ALICE2, d, ks, B, 4, (), deadline=now + 1e6)
    assert wait.poll(now + STALL_S - 1) is None
    assert wait.poll(now + STALL_S + 1).pending is None
    fs.pred(ALICE, w, t[5:9])                                     # progress again: waited for again
    assert ChainWait(fs.chains, ALICE2, d, ks, B, 4, (), deadline=1e18).poll(now + STALL_S + 2) is None
    fs.close(ALICE, w)                                            # the writer is done: nothing promised
    m = ChainWait(fs.chains, ALICE2, d, ks, B, 4, (), deadline=1e18).poll()
    assert m.blocks == 2 and m.pending is None
    w2, _, _ = lookup(fs, ALICE, "/home/alice/c", toks(16, seed=3))
    fs.exit_process(ALICE.pid)                                    # a writer that dies promises nothing
    assert fs.chains.find(ALICE2, d, keys(toks(16, seed=3)), B, 4).pending is None


def test_the_index_follows_truncate_rename_remove_expiry_and_cache_drops(weights):
    fs = make_fs(weights, pages=12)
    fs.mkdir(ALICE, "/home/alice/c")
    fs.mkdir(ALICE, "/home/alice/other")
    t = toks(16)
    ks = keys(t)
    d = fs.listable(ALICE, "/home/alice/c")
    h, _, _ = lookup(fs, ALICE, "/home/alice/c", t, ttl=30)
    fs.pred(ALICE, h, t)
    fs.truncate(ALICE, h, 9)                    # blocks 3, 4 may be rewritten: their keys go
    fs.pred(ALICE, h, toks(7, seed=4))
    assert fs.chains.find(ALICE2, d, ks, B, 4).blocks == 2
    path = ino(fs, h).path
    fs.rename(ALICE, path, "/home/alice/other/x")
    assert fs.chains.find(ALICE2, d, ks, B, 4).blocks == 0 and fs.stats()["chain_files"] == 0
    fs.close(ALICE, h)
    fs.remove(ALICE, "/home/alice/other/x")
    h, _, _ = lookup(fs, ALICE, "/home/alice/c", t)
    fs.pred(ALICE, h, t)
    fs.close(ALICE, h)
    fs.remove(ALICE, next(iter(d.children.values())).path)
    assert fs.chains.find(ALICE2, d, ks, B, 4).blocks == 0
    h, _, _ = lookup(fs, ALICE, "/home/alice/c", t, ttl=0)
    fs.pred(ALICE, h, t)
    fs.close(ALICE, h)
    fs.stat(ALICE, "/home/alice")                                  # expiry is applied lazily
    assert fs.chains.find(ALICE2, d, ks, B, 4).blocks == 0 and not d.children
    h, _, _ = lookup(fs, ALICE, "/home/alice/c", t)
    fs.pred(ALICE, h, t)
    fs.close(ALICE, h)
    g = fs.create(BOB)
    fs.pred(BOB, g, toks(40, seed=2))                              # needs the cache file's pages
    assert fs.stats()["cache_drops"] == 1 and fs.chains.find(ALICE2, d, ks, B, 4).blocks == 0
    assert fs.stats()["chain_files"] == 0 and not fs.chains.keys


def test_claims_make_room_in_the_inode_quota_and_prune_redundant_files(weights):
    fs = make_fs(weights, user_inode_quota=4)
    fs.mkdir(ALICE, "/home/alice/c")                                    # 1 inode
    d = fs.listable(ALICE, "/home/alice/c")
    convo = toks(8)
    for turn in range(3):                                                 # each turn extends the last
        h, claimed, got = lookup(fs, ALICE, "/home/alice/c", convo)
        assert claimed and got == (0 if turn == 0 else len(convo) // B - 2)
        fs.pred(ALICE, h, convo[got * B:])
        fs.close(ALICE, h)
        assert len(d.children) == 1                                       # the previous turn's file pruned
        convo = convo + toks(8, seed=turn + 10)
    assert fs.stats()["chain_prunes"] == 2
    held = fs.open(ALICE, next(iter(d.children.values())).path)            # open: never pruned or evicted
    for s in range(5):                                                     # other prompts: 3 more fit
        h, claimed, _ = lookup(fs, ALICE, "/home/alice/c", toks(8, seed=20 + s))
        assert claimed
        fs.pred(ALICE, h, toks(8, seed=20 + s))
        fs.close(ALICE, h)
    assert len(d.children) == 3 and held in fs.handles                    # LRU own files made room
    assert fs.handles[held].inode.linked


def test_hits_of_the_owner_renew_the_expiry_without_growing_the_heap(weights, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("symphony.kvfs.fs.time.monotonic", lambda: clock[0])
    fs = make_fs(weights)
    fs.mkdir(ALICE, "/home/alice/c")
    d = fs.listable(ALICE, "/home/alice/c")
    t = toks(12)
    h, claimed, _ = lookup(fs, ALICE, "/home/alice/c", t, ttl=30)
    fs.pred(ALICE, h, t)
    fs.close(ALICE, h)
    for _ in range(200):                                   # a hot prefix: hit every 2 s for 400 s
        clock[0] += 2
        g, _, got = lookup(fs, ALICE2, "/home/alice/c", t, claim=False)
        assert got == 3
        fs.close(ALICE2, g)
    assert len(d.children) == 1 and len(fs._expiry) <= 2  # alive long past its first 30 s, one entry
    clock[0] += 29
    fs.stat(ALICE, "/home/alice")
    assert len(d.children) == 1
    clock[0] += 2                                          # 31 s without a hit: expired
    fs.stat(ALICE, "/home/alice")
    assert not d.children and fs.chains.find(ALICE2, d, keys(t), B, 3).blocks == 0


def test_a_synced_chain_file_keeps_its_keys_across_a_restart_and_refuses_bad_ones(weights, tmp_path):
    """A durable chain file (a conversation synced for another kernel to adopt) is found by
    the same lookup once restored; a header whose chain record is malformed is refused."""
    from symphony.kvfs.errors import CorruptFile
    from symphony.kvfs.store import _check_chain
    fs = make_fs(weights, durable_dir=str(tmp_path))
    fs.mkdir(ALICE, "/home/alice/c")
    a = toks(14)
    h, claimed, _ = lookup(fs, ALICE, "/home/alice/c", a)
    fs.pred(ALICE, h, a)
    fs.sync(ALICE, h)
    fs.close(ALICE, h)
    again = make_fs(weights, durable_dir=str(tmp_path))
    assert again.stats()["chain_files"] == 1
    h2, _, got = lookup(again, ALICE2, "/home/alice/c", a + toks(4, seed=3), claim=False)
    assert got == 3 and again.stat(ALICE2, h2)["length"] == 12
    torch.testing.assert_close(again.pred(ALICE2, h2, a[12:]), ref(weights, a), atol=TINY_ATOL, rtol=0)
    assert lookup(again, BOB, "/tmp", a, claim=False)[2] == 0              # elsewhere: nothing
    for bad in ({"block": 3, "keys": [], "ttl": None}, {"block": B, "keys": ["zz" * 16], "ttl": None},
                {"block": B, "keys": ["ab"], "ttl": None}, {"block": B, "keys": [], "ttl": -1},
                {"block": B, "keys": [], "extra": 1}, [1, 2]):
        with pytest.raises(CorruptFile, match="chain"):
            _check_chain(bad, B, "f")
