"""KVFS under memory pressure, on a tiny random model with a small
pool: cache files the pager deletes before anything else, running (pinned)
LIPs never page-evicted, reclaim / suspend / swap_in_pid for the kernel's
memory manager, device_need that agrees with what a pred takes, and NoSpace
only when it is true, with the numbers."""
import logging
import re

import pytest
import torch

from conftest import tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.weights import random_weights
from symphony.kvfs import (KVFS, InvalidArgument, KVFSConfig, KVPred, NoSpace, NotFound, PermissionDenied,
                           Principal, QuotaExceeded)

S = 4                                                    # tokens a page
ALICE, BOB = Principal("alice", 1), Principal("bob", 2)
BLOCKED, RUNNING = Principal("carol", 5), Principal("dave", 6)


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny_config(), seed=0)


def toks(n, seed=0):
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_fs(weights, pages, running=(), blocked=(), **kw):
    """A KVFS of ``pages - 1`` device pages; ``running`` pids pinned, ``blocked`` evicted first."""
    eng = Engine(weights, None, EngineConfig(page_size=S, num_pages=pages))
    hooks = {"pinned": lambda: set(running)} if running else {}
    return KVFS(eng, KVFSConfig(**kw), evict_first=lambda: list(blocked), **hooks)


def file_of(fs, who, n_pages, path=None, advice=None, seed=0, keep_open=False):
    """A file of ``n_pages`` full pages; closed unless ``keep_open`` (then its handle)."""
    h = fs.create(who, path)
    fs.pred(who, h, toks(n_pages * S, seed))
    if advice:
        fs.advise(who, h, advice)
    if keep_open:
        return h
    fs.close(who, h)


def where(fs, path):
    return fs.stat(Principal("root"), path)["residency"]


def free(fs):
    return fs.engine.kv.allocator.num_free


def exists(fs, path):
    try:
        fs.stat(Principal("root"), path)
        return True
    except NotFound:
        return False


# ------------------------------------------------------------------ cache files

def test_reclaim_order_cache_then_drop_first_then_idle_then_blocked_never_running(weights, caplog):
    fs = make_fs(weights, pages=16, running=[6], blocked=[5], host_pages=32)   # 15 device pages
    file_of(fs, ALICE, 2, "/tmp/c1", "cache", seed=1)
    file_of(fs, ALICE, 2, "/tmp/c2", "cache", seed=2)
    file_of(fs, ALICE, 2, "/tmp/d", "drop_first", seed=3)
    file_of(fs, ALICE, 2, "/tmp/idle", seed=4)
    b = file_of(fs, BLOCKED, 2, "/tmp/blocked", seed=5, keep_open=True)
    r = file_of(fs, RUNNING, 2, "/tmp/run", seed=6, keep_open=True)
    oc = file_of(fs, ALICE, 2, "/tmp/open_cache", "cache", seed=7, keep_open=True)
    assert free(fs) == 1
    with caplog.at_level(logging.INFO, logger="symphony.kvfs"):
        assert fs.reclaim(2) == 3                            # the oldest cache file is deleted
    assert not exists(fs, "/tmp/c1") and exists(fs, "/tmp/c2")
    assert "KV cache file /tmp/c1 dropped" in caplog.text
    with pytest.raises(NotFound):
        fs.open(ALICE, "/tmp/c1")
    assert fs.reclaim(5) == 5 and not exists(fs, "/tmp/c2")  # then the next cache file
    assert where(fs, "/tmp/d")["device"] == 2                # nothing swapped yet
    assert fs.reclaim(7) == 7 and where(fs, "/tmp/d")["host"] == 2 and where(fs, "/tmp/idle")["device"] == 2
    assert fs.reclaim(9) == 9 and where(fs, "/tmp/idle")["host"] == 2
    assert fs.stat(BLOCKED, b)["residency"]["device"] == 2
    assert fs.reclaim(100) == 11 and fs.stat(BLOCKED, b)["residency"]["host"] == 2
    assert fs.stat(RUNNING, r)["residency"]["device"] == 2   # never the running LIP's file,
    assert fs.stat(ALICE, oc)["residency"]["device"] == 2    # nor a cache file someone has open
    st = fs.stats()
    assert (st["cache_drops"], st["cache_drop_pages"], st["swap_out_pages"]) == (2, 4, 6)
    assert st["swap_out_bytes"] == 6 * fs.pager.page_bytes and st["device_pages_free"] == 11


def test_a_pred_deletes_cache_files_before_swapping_and_an_open_one_is_only_swapped(weights):
    fs = make_fs(weights, pages=9, host_pages=16)             # 8 device pages
    file_of(fs, ALICE, 2, "/tmp/d", "drop_first", seed=1)
    file_of(fs, ALICE, 2, "/tmp/c", "cache", seed=2)
    oc = file_of(fs, ALICE, 2, "/tmp/oc", "cache", seed=3, keep_open=True)
    x = fs.create(BOB)
    fs.pred(BOB, x, toks(3 * S, 4))                           # 3 pages, 2 free: c goes, not d
    assert not exists(fs, "/tmp/c") and where(fs, "/tmp/d")["device"] == 2
    assert fs.stats()["swap_out_pages"] == 0 and fs.stats()["cache_drops"] == 1
    fs.pred(BOB, x, toks(5 * S, 5))                           # 5 more, 1 free: d, then the open cache file
    assert where(fs, "/tmp/d")["host"] == 2 and fs.stat(ALICE, oc)["residency"]["host"] == 2
    assert exists(fs, "/tmp/oc") and fs.stats()["cache_drops"] == 1
    assert fs.stat(ALICE, oc)["advice"] == "cache"
    with pytest.raises(InvalidArgument, match="cache, expire"):
        fs.advise(ALICE, fs.create(ALICE), "discard")


def test_cache_files_that_share_pages_are_free_memory_too(weights):
    """Prefix checkpoints (cache files cut from one another by extract) share their pages: a
    page only such files hold is reclaimable, and reclaim frees it by deleting them all (LRU),
    never a page a file outside the cache still maps."""
    fs = make_fs(weights, 9, host_pages=0)                    # 8 device pages, no host tier to swap to
    h = fs.create(ALICE, "/tmp/conv")
    fs.pred(ALICE, h, toks(6 * S, 1))
    for n in (2, 4, 6):                                       # checkpoints of 2, 4 and 6 pages
        c = fs.extract(ALICE, h, [[0, n * S]], path=f"/tmp/ck{n}")
        fs.advise(ALICE, c, "cache")
        fs.close(ALICE, c)
    keep = fs.extract(ALICE, h, [[0, S]], path="/tmp/keep")   # a plain file shares page 1
    fs.close(ALICE, keep)
    fs.remove(ALICE, "/tmp/conv")
    fs.close(ALICE, h)
    assert free(fs) == 2 and fs.reclaimable() == 5            # pages 2-6: every holder is a cache file
    assert fs.reclaim(8) == 7                                 # all three go; page 1 stays (the plain file)
    assert not any(exists(fs, f"/tmp/ck{n}") for n in (2, 4, 6)) and exists(fs, "/tmp/keep")
    assert fs.stats()["cache_drops"] == 3 and fs.reclaimable() == 0


def test_a_cache_file_sharing_pages_with_a_running_lip_is_deleted_for_its_own_pages(weights):
    """A prefix-cache entry shares the system prompt's pages with every request in flight
    (which forked it): deleting the entry frees its own pages while the shared ones stay
    with the running LIP's file (were such entries kept, a full pool would refuse every new
    request)."""
    fs = make_fs(weights, 9, running=[7], host_pages=0)        # 8 device pages, no host tier
    served = Principal("alice", 7)
    c = fs.create(ALICE, "/tmp/entry")
    fs.pred(ALICE, c, toks(5 * S, 1))                          # prompt head (2 pages) + a document (3)
    fs.advise(ALICE, c, "cache")
    fs.close(ALICE, c)
    r = fs.open(served, "/tmp/entry")                           # a running request forks the head
    run = fs.extract(served, r, [[0, 2 * S]])
    fs.close(served, r)
    fs.pred(served, run, toks(S, 2))                           # and its own page
    assert free(fs) == 2 and fs.reclaimable() == 3              # the entry's own 3 pages
    assert fs.reclaim(5) == 5 and not exists(fs, "/tmp/entry")
    assert fs.stat(served, run)["residency"]["device"] == 3     # the running file keeps its pages
    # a protected page that only cache files hold keeps them
    c2 = fs.create(ALICE, "/tmp/e2")
    fs.pred(ALICE, c2, toks(2 * S, 3))
    fs.advise(ALICE, c2, "cache")
    fs.close(ALICE, c2)
    ino = fs.memory.lru_cache[next(iter(fs.memory.lru_cache))]
    assert fs.reclaim(7, protect={ino.blocks[0].id}) == 3 and exists(fs, "/tmp/e2")


def test_a_users_own_cache_files_make_room_in_their_quota(weights):
    """Over her page quota, Alice's unopened cache files are deleted before her pred is refused
    (the memory manager may delete them at any time anyway); Bob's are not hers to spend."""
    fs = make_fs(weights, 33, user_page_quota=6)
    file_of(fs, BOB, 2, "/tmp/bob-cache", "cache", seed=3)
    for n in (1, 2):
        file_of(fs, ALICE, 2, f"/tmp/c{n}", "cache", seed=n)
    assert fs.cache_pages_by_user() == {"alice": 4, "bob": 2}
    h = fs.create(ALICE)
    fs.pred(ALICE, h, toks(4 * S, 9))                         # 4 + 4 > 6: the oldest cache file goes
    assert not exists(fs, "/tmp/c1") and exists(fs, "/tmp/c2") and exists(fs, "/tmp/bob-cache")
    with pytest.raises(QuotaExceeded):
        fs.pred(ALICE, h, toks(3 * S, 8))                     # c2 too would not make room for 3 more
    assert exists(fs, "/tmp/bob-cache")


def test_reclaim_skips_what_host_and_disk_cannot_take_and_make_room_says_so(weights):
    fs = make_fs(weights, pages=9, host_pages=2)              # 8 device pages, 2 host slots, no disk
    p = file_of(fs, BOB, 2, "/tmp/p", seed=2, keep_open=True)
    assert fs.suspend(2) == 2                                 # p to the host: the slots are full
    fs.close(BOB, p)
    c = file_of(fs, ALICE, 2, "/tmp/c", "cache", seed=1, keep_open=True)
    file_of(fs, ALICE, 2, "/tmp/idle", seed=3)
    assert fs.reclaim(8) == 4                                 # idle has no slot to go to: skipped
    fs.close(ALICE, c)
    assert fs.reclaim(8) == 6 and not exists(fs, "/tmp/c")    # the closed cache file is deleted
    assert where(fs, "/tmp/idle")["device"] == 2
    with pytest.raises(NoSpace, match=r"need 7 free device KV pages: 6 free and 1 evictable, but the "
                                      r"host and disk tiers ran out of slots.*no disk tier"):
        fs.pred(ALICE, fs.create(ALICE), toks(7 * S))


# ------------------------------------------------------------------ pinned pids

def test_files_of_running_lips_are_never_page_evicted(weights):
    fs = make_fs(weights, pages=9, running=[6], host_pages=16)   # 8 device pages
    r = file_of(fs, RUNNING, 5, "/tmp/run", seed=1, keep_open=True)
    file_of(fs, ALICE, 2, "/tmp/idle", seed=2)
    x = fs.create(ALICE)
    with pytest.raises(NoSpace, match=r"need 4 free device KV pages: 1 free and only 2 more evictable"):
        fs.pred(ALICE, x, toks(4 * S, 3))
    assert fs.stat(RUNNING, r)["residency"]["device"] == 5 and fs.stats()["swap_out_pages"] == 0
    fs.pred(ALICE, x, toks(3 * S, 3))                         # 3 fit: the idle file goes
    assert where(fs, "/tmp/idle")["host"] == 2 and fs.stat(RUNNING, r)["residency"]["device"] == 5
    assert fs.reclaimable() == 0 and fs.pid_device_pages(6) == 5 and fs.pid_pages(1) == 3


# ------------------------------------------------------------------ device_need

def _need_then_run(fs, call):
    """device_need, reclaim exactly that, run: the run evicts nothing and takes it all."""
    need = fs.device_need(call.who, call.handle, len(call.tokens))
    assert fs.reclaim(need) == need                            # the pool was full: exactly need now
    outs, drops = fs.stats()["swap_out_pages"], fs.stats()["cache_drops"]
    fs.pred_batch([call])                                     # raises if it failed
    assert fs.stats()["swap_out_pages"] == outs and fs.stats()["cache_drops"] == drops
    assert free(fs) == 0
    return need


def test_device_need_is_what_the_pred_takes(weights):
    fs = make_fs(weights, pages=17, host_pages=64)            # 16 device pages
    file_of(fs, ALICE, 16, "/tmp/filler", seed=9)             # the pool is full of an idle file
    a = fs.create(ALICE)                                      # fresh file, 2 pages and a bit
    assert _need_then_run(fs, KVPred(ALICE, a, toks(9, 1))) == 3
    b = fs.fork(ALICE, a)                                     # shared partial last page: copied
    assert _need_then_run(fs, KVPred(ALICE, b, toks(2, 2))) == 1
    assert _need_then_run(fs, KVPred(ALICE, b, toks(6, 3))) == 2   # own partial page now: no copy
    assert fs.suspend(1) == 6                                 # a and b swapped out, shared pages once
    assert fs.resume_need(1) == 6
    file_of(fs, BOB, 6, "/tmp/filler2", seed=8)               # the pool full again
    assert _need_then_run(fs, KVPred(ALICE, a, toks(5, 4))) == 3 + 1   # a's 3 back + 1 new (9+5=14)


# ------------------------------------------------------------------ reclaim / reclaimable

def test_reclaim_never_touches_protected_blocks_and_reclaimable_is_exact(weights):
    fs = make_fs(weights, pages=17, running=[6], blocked=[5], host_pages=5)   # 16 device pages
    file_of(fs, ALICE, 2, "/tmp/c", "cache", seed=1)
    file_of(fs, ALICE, 3, "/tmp/idle", seed=2)
    file_of(fs, ALICE, 3, "/tmp/idle2", seed=3)
    b = file_of(fs, BLOCKED, 3, "/tmp/blocked", seed=4, keep_open=True)
    r = file_of(fs, RUNNING, 2, "/tmp/run", seed=5, keep_open=True)
    protect = {blk.id for blk in fs.handles[b].inode.blocks}     # e.g. shared with a running LIP
    assert free(fs) == 3
    assert fs.reclaimable(protect) == 2 + 5                   # the cache file + host room for 5 of 6
    assert fs.reclaim(100, protect) == 3 + 7
    assert fs.stat(BLOCKED, b)["residency"]["device"] == 3 and fs.stat(RUNNING, r)["residency"]["device"] == 2
    assert fs.reclaimable(protect) == 0 and fs.reclaim(100, protect) == 10
    with pytest.raises(InvalidArgument):
        fs.reclaim(-1)


# ------------------------------------------------------------------ suspend / resume

def _two_files(fs):
    h = fs.create(ALICE)
    fs.pred(ALICE, h, toks(4 * S + 2, 1))                     # 5 pages, a partial last one
    g = fs.create(ALICE, "/tmp/other")
    fs.pred(ALICE, g, toks(2 * S, 2))
    return h, g


@pytest.mark.parametrize("eager", [True, False])
def test_suspend_and_resume_is_bit_exact_and_frees_the_pages(weights, tmp_path, eager):
    plain = make_fs(weights, pages=17, host_pages=4)
    want = [plain.pred(ALICE, h, [3]) for h in _two_files(plain)]
    fs = make_fs(weights, pages=17, host_pages=4, swap_dir=str(tmp_path))   # 6 pages: 4 host + 2 disk
    h, g = _two_files(fs)
    before = free(fs)
    keep = {fs.handles[g].inode.blocks[0].id}                  # say a running LIP shares g's first page
    assert fs.suspend(1, keep) == 6 and free(fs) == before + 6
    assert fs.resume_need(1) == 6 and fs.stats()["suspensions"] == 1
    assert fs.stat(ALICE, h)["residency"]["disk"] > 0 and fs.stat(ALICE, g)["residency"]["device"] == 1
    assert fs.suspend(2) == 0                                 # bob has nothing open
    if eager:
        assert fs.swap_in_pid(1) == 6 and fs.resume_need(1) == 0 and free(fs) == before
    got = [fs.pred(ALICE, h, [3]), fs.pred(ALICE, g, [3])]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(InvalidArgument):
        fs.suspend(0)


def test_suspend_with_full_host_and_disk_raises_and_changes_nothing(weights):
    fs = make_fs(weights, pages=17, host_pages=4)             # 4 host slots, no disk
    p = file_of(fs, BOB, 1, "/tmp/p", seed=2, keep_open=True)
    assert fs.suspend(2) == 1                                 # p takes a host slot: 3 left
    h = file_of(fs, ALICE, 4, seed=1, keep_open=True)
    state = lambda: ([(b.device, b.host) for b in fs.handles[h].inode.blocks], free(fs), fs.stats())
    before = state()
    with pytest.raises(NoSpace, match=r"cannot suspend process 1: its 4 device KV pages need host/disk "
                                      r"slots; 3 free .*no disk tier.*only 0 more from cache files"):
        fs.suspend(1)
    assert state() == before
    assert fs.suspend(1, partial=True) == 3 and state() != before   # partial: what the host takes
    assert fs.swap_in_pid(1) == 3 and all(d >= 0 and hs < 0 for d, hs in state()[0]) and free(fs) == before[1]
    fs.advise(BOB, p, "cache")
    fs.close(BOB, p)                                          # a closed cache file on the host ...
    assert fs.suspend(1) == 4 and not exists(fs, "/tmp/p")    # ... is deleted to make room
    assert fs.stats()["cache_drops"] == 1 and fs.stats()["suspensions"] == 3


def test_another_user_cannot_make_a_file_a_cache_file_to_get_it_deleted(weights):
    """advise("cache") lets the kernel delete a file: a reader of someone else's
    file (0644, opened read-only) may not ask for it; the file stays, normal."""
    fs = make_fs(weights, pages=16, host_pages=8)
    h = fs.create(ALICE, "/shared/notes.kv", mode=0o644)
    fs.pred(ALICE, h, toks(2 * S))
    fs.close(ALICE, h)
    r = fs.open(BOB, "/shared/notes.kv", "r")
    with pytest.raises(PermissionDenied):
        fs.advise(BOB, r, "cache")
    fs.close(BOB, r)
    fs.reclaim(free(fs) + 2)                                 # pressure: only idle swaps, no deletion
    assert exists(fs, "/shared/notes.kv") and fs.stats()["cache_drops"] == 0
    assert fs.stat(Principal("root"), "/shared/notes.kv")["advice"] == "normal"


# ------------------------------------------------------------------ NoSpace only when true

def test_a_pred_larger_than_the_pool_is_refused_with_the_numbers(weights):
    fs = make_fs(weights, pages=16)                           # 15 device pages
    h = fs.create(ALICE)
    fs.pred(ALICE, h, toks(10))
    msg = ("pred needs 18 device KV pages (the file's 10 tokens + 60 new at 4 tokens a page); "
           "the device pool holds 15 pages: 3 too many")
    with pytest.raises(NoSpace, match=re.escape(msg)):
        fs.pred(ALICE, h, toks(60, 1))
    assert fs.stat(ALICE, h)["length"] == 10
    fs.pred(ALICE, h, toks(50, 1))                            # 15 pages: fits


def test_quota_message_says_by_how_much(weights):
    fs = make_fs(weights, pages=32, user_page_quota=4)
    h = fs.create(ALICE)
    with pytest.raises(QuotaExceeded, match=r"would hold 6 KV pages, quota 4 \(2 over\)"):
        fs.pred(ALICE, h, toks(6 * S))


def test_a_dropped_durable_cache_file_is_gone_after_a_restart_too(weights, tmp_path):
    fs = make_fs(weights, pages=9, durable_dir=str(tmp_path))   # 8 device pages
    h = fs.create(ALICE, "/tmp/c")
    fs.pred(ALICE, h, toks(3 * S))
    fs.advise(ALICE, h, "cache")
    fs.sync(ALICE, h)
    fs.close(ALICE, h)
    assert len(list(tmp_path.glob("*.kvf"))) == 1
    again = make_fs(weights, pages=9, durable_dir=str(tmp_path))   # restored: still a cache file
    assert again.stat(ALICE, "/tmp/c")["advice"] == "cache" and again.stats()["cache_files"] == 1
    fs.pred(BOB, fs.create(BOB), toks(8 * S))                  # the whole pool: the file is deleted
    assert not exists(fs, "/tmp/c") and list(tmp_path.glob("*.kvf")) == []
    assert not exists(make_fs(weights, pages=9, durable_dir=str(tmp_path)), "/tmp/c")


def test_the_host_tier_grows_on_demand_up_to_host_pages(weights):
    from symphony.kvfs.pager import HOST_CHUNK
    fs = make_fs(weights, pages=2 * HOST_CHUNK + 8, host_pages=HOST_CHUNK + 8)   # 72 host pages at most
    assert fs.pager.host_capacity == 0 and fs.stats()["host_slots_free"] == HOST_CHUNK + 8
    a = file_of(fs, ALICE, 3, seed=1, keep_open=True)
    b = file_of(fs, BOB, HOST_CHUNK // 2, seed=2, keep_open=True)      # the tiny model's context
    b2 = file_of(fs, BOB, HOST_CHUNK // 2 + 5, seed=4, keep_open=True)  # is 64 pages: two files
    data = lambda *hs: [fs.pager.read(x) for h in hs for x in fs.handles[h].inode.blocks]
    before = data(a, b, b2)
    assert fs.suspend(1) == 3 and fs.pager.host_capacity == HOST_CHUNK       # one chunk, not the tier
    assert fs.suspend(2) == HOST_CHUNK + 5 and fs.pager.host_capacity == HOST_CHUNK + 8   # 2 chunks
    st = fs.stats()
    assert st["host_slots_free"] == 0 and st["host_slots_made"] == HOST_CHUNK + 8
    assert fs.swap_in_pid(1) == 3 and fs.stats()["host_slots_free"] == 3
    file_of(fs, ALICE, 1, seed=3, keep_open=True)
    with pytest.raises(NoSpace, match="3 free \\(host 3 of 72, no disk tier"):
        fs.suspend(1)                                                    # 4 pages, 3 slots
    assert fs.swap_in_pid(2) == HOST_CHUNK + 5
    assert all(torch.equal(x, y) for x, y in zip(data(a, b, b2), before))
