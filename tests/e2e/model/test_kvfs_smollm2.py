"""KVFS on the real SmolLM2-135M: every data operation against a fresh
recomputation, and fork sharing measured in device pages.

Each equivalence test compares logits of a KVFS file after fork / truncate /
extract / merge / swap-out+in / restart with a plain engine sequence fed the
same tokens at the same positions in one pass: max |logit diff| <= SMOLLM_ATOL.
Every test shares the session engine's page pool with the other tests, so it
closes (and unlinks) everything it creates and checks that the pool's page
count is back where it started.
"""
import pytest

from conftest import SMOLLM_ATOL
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.kvfs import KVFS, KVFSConfig, KVPred, Principal

ALICE, BOB = Principal("alice", 11), Principal("bob", 12)
S = 16                                   # the smollm fixture's page size

COLORS = ("red", "green", "blue", "amber", "violet", "silver", "golden")
PLACES = ("harbour", "library", "market", "observatory", "garden")


def document(tok, n, seed=0):
    """``n`` tokens of deterministic plain English (no special tokens)."""
    paras = []
    i = seed
    while True:
        for _ in range(40):
            paras.append(f"Note {i}: the {COLORS[i % 7]} robot number {i * 37 % 101} walked to the "
                         f"{PLACES[i % 5]} and counted {i * i % 97} stars before sunrise.")
            i += 1
        ids = tok.encode(" ".join(paras))
        if len(ids) >= n:
            return ids[:n]


def used(eng):
    return eng.kv.allocator.num_used


_FRESH = {}


def fresh(eng, tokens, n_last):
    """Logits of the last ``n_last`` of ``tokens`` (at positions 0..len-1) from a plain
    engine sequence: the prefix in one pass, then the last ``n_last`` with all logits.
    Deterministic, so memoized per engine (several tests compare against the same one)."""
    key = (id(eng), tuple(tokens), n_last)
    if key not in _FRESH:
        seq = eng.new_sequence()
        try:
            if len(tokens) > n_last:
                eng.pred(seq, tokens[:-n_last])
            _FRESH[key] = eng.pred(seq, tokens[-n_last:], all_logits=True)
        finally:
            eng.release(seq)
    return _FRESH[key]


def check(got, want, what):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    d = float((got - want).abs().max())
    assert d <= SMOLLM_ATOL, f"{what}: max |logit diff| {d:.3g} > {SMOLLM_ATOL}"
    return d


@pytest.fixture
def kvfs(smollm):
    """Factory of KVFS instances on the session engine; tears down leftovers
    (handles, named files, swap files) even when a test fails part-way."""
    made = []

    def make(eng=None, **cfg):
        cfg.setdefault("host_pages", 0)          # the host tier is a real tensor: keep it small
        fs = KVFS(eng or smollm, KVFSConfig(**cfg), restore=eng is not None)
        made.append(fs)
        return fs

    yield make
    for fs in made:
        for hid, h in list(fs.handles.items()):
            fs.close(Principal(h.user, h.pid), hid)
        for inode in [i for i in fs.inodes.values() if i.linked]:
            fs._unlink(inode.parent, inode.name)
        fs.close_all()


@pytest.fixture
def doc(smollm):
    return document(smollm.tokenizer, 200)


@pytest.fixture
def conts(smollm):
    tok = smollm.tokenizer
    return (tok.encode(" Question: which robot reached the observatory first?"),
            tok.encode(" Meanwhile, in the kitchen, a kettle began to whistle."),
            tok.encode(" 1, 2, 3, 4, 5"))


# ------------------------------------------------------------------ fork

def test_fork_parent_and_child_both_match_fresh(smollm, kvfs, doc, conts):
    start = used(smollm)
    fs = kvfs()
    P, (A, B, C) = doc[:150], conts                       # 150 = 9 full pages + 6 slots
    f = fs.create(ALICE)
    fs.pred(ALICE, f, P)
    assert used(smollm) == start + 10
    c = fs.fork(ALICE, f)
    assert used(smollm) == start + 10                     # fork: no page
    check(fs.pred(ALICE, f, A, all_logits=True), fresh(smollm, P + A, len(A)), "parent after fork")
    check(fs.pred(ALICE, c, B, all_logits=True), fresh(smollm, P + B, len(B)), "child after fork")
    # 9 full pages shared; each side has its own pages past them (the parent's first one
    # is its copy of the shared partial page, the child keeps the original)
    pages = lambda n: -(-n // S)
    assert used(smollm) == start + 9 + (pages(150 + len(A)) - 9) + (pages(150 + len(B)) - 9)
    fi, ci = fs.handles[f].inode, fs.handles[c].inode
    assert fi.blocks[:9] == ci.blocks[:9] and fi.blocks[9] is not ci.blocks[9]
    # a grandchild, forked from the child, and all three appending again
    g = fs.fork(ALICE, c)
    lg = fs.pred(ALICE, g, C, all_logits=True)
    lc = fs.pred(ALICE, c, A, all_logits=True)
    lf = fs.pred(ALICE, f, C, all_logits=True)
    check(lg, fresh(smollm, P + B + C, len(C)), "grandchild")
    check(lc, fresh(smollm, P + B + A, len(A)), "child, second append")
    check(lf, fresh(smollm, P + A + C, len(C)), "parent, second append")
    for h in (f, c, g):
        fs.close(ALICE, h)
    assert used(smollm) == start


def test_fork_batch_of_forks_in_one_pred_batch(smollm, kvfs, doc, conts):
    """Forks of one file appending in one forward pass (pred_batch), each
    copying the shared partial page."""
    start = used(smollm)
    fs = kvfs()
    P = doc[:150]
    f = fs.create(ALICE)
    fs.pred(ALICE, f, P)
    forks = [fs.fork(ALICE, f) for _ in conts]
    outs = fs.pred_batch([KVPred(ALICE, h, t, all_logits=True) for h, t in zip(forks, conts)])
    for o, t in zip(outs, conts):
        check(o, fresh(smollm, P + t, len(t)), "batched fork")
    check(fs.pred(ALICE, f, conts[0], all_logits=True), fresh(smollm, P + conts[0], len(conts[0])),
          "parent after batched forks")
    for h in forks + [f]:
        fs.close(ALICE, h)
    assert used(smollm) == start


# ------------------------------------------------------------------ truncate

def test_truncate_then_append_matches_fresh(smollm, kvfs, doc, conts):
    start = used(smollm)
    fs = kvfs()
    P, X, (A, B, C) = doc[:150], doc[150:180], conts
    f = fs.create(ALICE)
    fs.pred(ALICE, f, P + X)                              # 180 tokens, 12 pages
    # truncate a fork back to P (the kept partial page is shared with f: copy-on-write)
    t = fs.fork(ALICE, f)
    fs.truncate(ALICE, t, len(P))
    assert fs.stat(ALICE, t)["length"] == 150 and fs.stat(ALICE, t)["pages"] == 10
    check(fs.pred(ALICE, t, A, all_logits=True), fresh(smollm, P + A, len(A)), "fork truncated to 150")
    check(fs.pred(ALICE, f, C, all_logits=True), fresh(smollm, P + X + C, len(C)),
          "original after its fork was truncated and appended")
    # truncate the original itself, to an unaligned point inside pages shared with t
    fs.truncate(ALICE, f, 100)
    check(fs.pred(ALICE, f, B, all_logits=True), fresh(smollm, P[:100] + B, len(B)), "truncated to 100")
    check(fs.pred(ALICE, t, C, all_logits=True), fresh(smollm, P + A + C, len(C)), "fork, untouched by it")
    # to a page boundary, and to nothing
    fs.truncate(ALICE, f, 96)
    check(fs.pred(ALICE, f, A, all_logits=True), fresh(smollm, P[:96] + A, len(A)), "truncated to 96")
    fs.truncate(ALICE, f, 0)
    assert fs.stat(ALICE, f)["pages"] == 0
    check(fs.pred(ALICE, f, C, all_logits=True), fresh(smollm, C, len(C)), "truncated to 0")
    for h in (f, t):
        fs.close(ALICE, h)
    assert used(smollm) == start


# ------------------------------------------------------------------ extract / merge

def test_extract_prefixes_and_split_match_fresh(smollm, kvfs, doc, conts):
    start = used(smollm)
    fs = kvfs()
    P, (A, B, C) = doc, conts                             # 200 tokens = 12 full pages + 8 slots
    f = fs.create(ALICE)
    fs.pred(ALICE, f, P)
    fb = fs.handles[f].inode.blocks
    base = used(smollm)
    assert base == start + 13
    # [[0, 77], [77, 200]] is the whole file: one page (slots 64..79) is copied, the rest shared
    e1 = fs.extract(ALICE, f, [[0, 77], [77, 200]])
    i1 = fs.handles[e1].inode
    assert i1.positions == list(range(200))
    assert used(smollm) == base + 1
    assert i1.blocks[:4] == fb[:4] and i1.blocks[5:] == fb[5:] and i1.blocks[4] is not fb[4]
    check(fs.pred(ALICE, e1, A, all_logits=True), fresh(smollm, P + A, len(A)), "extract [0,77)+[77,200)")
    # an aligned prefix shares every page
    n = used(smollm)
    e2 = fs.extract(ALICE, f, [[0, 96]])
    assert fs.handles[e2].inode.blocks == fb[:6] and used(smollm) == n
    check(fs.pred(ALICE, e2, B, all_logits=True), fresh(smollm, P[:96] + B, len(B)), "extract [0,96)")
    # an unaligned prefix copies its partial last page
    n = used(smollm)
    e3 = fs.extract(ALICE, f, [[0, 77]])
    assert used(smollm) == n + 1
    check(fs.pred(ALICE, e3, C, all_logits=True), fresh(smollm, P[:77] + C, len(C)), "extract [0,77)")
    # the whole file shares even the partial last page; appending copies it
    e4 = fs.extract(ALICE, f, [[0, 200]])
    assert fs.handles[e4].inode.blocks == fb
    check(fs.pred(ALICE, e4, B, all_logits=True), fresh(smollm, P + B, len(B)), "extract [0,200)")
    check(fs.pred(ALICE, f, C, all_logits=True), fresh(smollm, P + C, len(C)), "source after extracts")
    for h in (f, e1, e2, e3, e4):
        fs.close(ALICE, h)
    assert used(smollm) == start


def test_split_with_extract_then_merge_matches_original(smollm, kvfs, doc, conts):
    start = used(smollm)
    fs = kvfs()
    P, (A, _, C) = doc, conts
    f = fs.create(ALICE)
    fs.pred(ALICE, f, P)
    o = fs.fork(ALICE, f)
    lo = fs.pred(ALICE, o, A, all_logits=True)
    want = fresh(smollm, P + A, len(A))
    check(lo, want, "original vs fresh")
    for cut in ([96], [77], [40, 130]):                   # page-aligned, unaligned, three parts
        bounds = [0] + cut + [len(P)]
        parts = [fs.extract(ALICE, f, [[a, b]]) for a, b in zip(bounds, bounds[1:])]
        for h, a, b in zip(parts, bounds, bounds[1:]):
            assert fs.handles[h].inode.positions == list(range(a, b))     # original positions kept
        n = used(smollm)
        m = fs.merge(ALICE, parts)
        mi = fs.handles[m].inode
        assert mi.positions == list(range(len(P)))
        if cut == [96]:                                   # page-aligned all the way: all shared
            assert used(smollm) == n and mi.blocks == fs.handles[f].inode.blocks
        lm = fs.pred(ALICE, m, A, all_logits=True)
        check(lm, want, f"merge of split at {cut} vs fresh")
        check(lm, lo, f"merge of split at {cut} vs original")
        check(fs.pred(ALICE, m, C, all_logits=True), fresh(smollm, P + A + C, len(C)),
              f"merge of split at {cut}, second append")
        for h in parts + [m]:
            fs.close(ALICE, h)
    for h in (f, o):
        fs.close(ALICE, h)
    assert used(smollm) == start


# ------------------------------------------------------------------ tiers

def test_swap_out_to_host_and_back(smollm, kvfs, doc, conts):
    start = used(smollm)
    fs = kvfs(host_pages=32)
    P, (A, B, _) = doc, conts
    f = fs.create(ALICE, "/tmp/doc.kv")
    fs.pred(ALICE, f, P)                                  # 13 pages
    c = fs.fork(ALICE, f)                                 # shares all 13 blocks
    blocks = [b for b in fs.handles[f].inode.blocks if b.device >= 0]
    fs.pager.swap_out(blocks)
    assert fs.stat(ALICE, "/tmp/doc.kv")["residency"] == {"device": 0, "host": 13, "disk": 0}
    assert fs.stat(ALICE, c)["residency"] == {"device": 0, "host": 13, "disk": 0}
    assert used(smollm) == start
    check(fs.pred(ALICE, c, A, all_logits=True), fresh(smollm, P + A, len(A)), "fork after host swap-in")
    assert fs.stat(ALICE, f)["residency"] == {"device": 13, "host": 0, "disk": 0}     # shared blocks came back
    assert fs.pager.stats.swap_ins == 13 and fs.pager.stats.disk_reads == 0
    check(fs.pred(ALICE, f, B, all_logits=True), fresh(smollm, P + B, len(B)), "parent after host swap-in")
    fs.close(ALICE, c)
    fs.close(ALICE, f)
    fs.remove(ALICE, "/tmp/doc.kv")
    assert used(smollm) == start and len(fs.pager.host_free) == 32


@pytest.mark.parametrize("host_pages", [0, 4])
def test_swap_out_to_disk_and_back(smollm, kvfs, doc, conts, tmp_path, host_pages):
    start = used(smollm)
    fs = kvfs(host_pages=host_pages, swap_dir=str(tmp_path))
    P, (A, _, C) = doc, conts
    f = fs.create(ALICE, "/tmp/doc.kv")
    fs.pred(ALICE, f, P)                                  # 13 pages
    blocks = list(fs.handles[f].inode.blocks)
    fs.pager.swap_out(blocks[:4])                         # to the host if it has room, else disk
    fs.pager.swap_out(blocks[4:])                         # the host's 4 are demoted to disk
    res = fs.stat(ALICE, "/tmp/doc.kv")["residency"]
    print(f"host_pages={host_pages}: residency after swap-out {res}, stats {fs.pager.stats}")
    assert res == {"device": 0, "host": host_pages, "disk": 13 - host_pages}
    assert fs.pager.stats.demotions == host_pages and used(smollm) == start
    check(fs.pred(ALICE, f, A, all_logits=True), fresh(smollm, P + A, len(A)), "after disk swap-in")
    assert fs.pager.stats.disk_reads == 13 - host_pages
    assert fs.stat(ALICE, f)["residency"]["device"] == fs.stat(ALICE, f)["pages"]
    check(fs.pred(ALICE, f, C, all_logits=True), fresh(smollm, P + A + C, len(C)), "second append")
    fs.close(ALICE, f)
    fs.remove(ALICE, "/tmp/doc.kv")
    assert used(smollm) == start


@pytest.mark.parametrize("host_pages", [32, 1], ids=["host", "host+disk"])
def test_pager_eviction_of_forked_files(smollm, kvfs, doc, conts, tmp_path, host_pages):
    """The pager's own eviction (make_room, LRU) of blocks that two files share:
    each shared block is evicted once, and every file still matches fresh."""
    eng = Engine(smollm.model.w, smollm.tokenizer, EngineConfig(page_size=S, num_pages=10))  # 9 pages
    fs = kvfs(eng, host_pages=host_pages, swap_dir=str(tmp_path))
    (A, B, C), P = conts, doc                             # 9, 12 and 14 tokens
    a = fs.create(ALICE)
    fs.pred(ALICE, a, P[:32])                             # 2 pages
    b = fs.fork(ALICE, a)                                 # shares them
    fs.pred(ALICE, b, P[32:48])                           # + 1 page of its own; 6 free
    x = fs.create(BOB)
    fs.pred(BOB, x, P[:136])                              # 9 pages: evicts a's 2 (= b's) and b's own
    ra, rb = fs.stat(ALICE, a)["residency"], fs.stat(ALICE, b)["residency"]
    assert ra["device"] == 0 and rb["device"] == 0 and ra["host"] + ra["disk"] == 2
    assert rb["host"] + rb["disk"] == 3 and fs.pager.stats.swap_outs == 3 and used(eng) == 9
    check(fs.pred(ALICE, a, A, all_logits=True), fresh(smollm, P[:32] + A, len(A)), "a, swapped back in")
    check(fs.pred(ALICE, b, B, all_logits=True), fresh(smollm, P[:48] + B, len(B)), "b, swapped back in")
    # x's pages back: evicts a's 3 pages and b's own (a's shared 2 are b's: once each)
    check(fs.pred(BOB, x, P[136:140], all_logits=True), fresh(smollm, P[:140], 4), "x, swapped back in")
    check(fs.pred(ALICE, a, C, all_logits=True), fresh(smollm, P[:32] + A + C, len(C)), "a, again")
    for who, h in ((ALICE, a), (ALICE, b), (BOB, x)):
        fs.close(who, h)
    assert used(eng) == 0 and len(fs.pager.host_free) == host_pages


# ------------------------------------------------------------------ restart

def test_sync_then_restart_on_a_new_engine(smollm, kvfs, doc, conts, tmp_path):
    start = used(smollm)
    durable = str(tmp_path / "durable")
    fs = kvfs(host_pages=8, durable_dir=durable)
    P, (A, B, _) = doc, conts
    h = fs.create(ALICE, "/home/alice/doc.kv")
    fs.pred(ALICE, h, P)
    fs.pager.swap_out(fs.handles[h].inode.blocks[:5])     # sync reads every tier
    fs.sync(ALICE, h)
    fs.close(ALICE, h)
    # "restart": a second engine on the same weight tensors, a KVFS restoring durable_dir
    eng2 = Engine(smollm.model.w, smollm.tokenizer, EngineConfig(page_size=S, num_pages=64))
    fs2 = kvfs(eng2, host_pages=0, durable_dir=durable)
    assert fs2.restore_report == {"restored": ["/home/alice/doc.kv"], "refused": []}
    st = fs2.stat(ALICE, "/home/alice/doc.kv")
    assert (st["length"], st["owner"], st["next_position"]) == (200, "alice", 200)
    assert st["residency"] == {"device": 13, "host": 0, "disk": 0} and used(eng2) == 13
    r = fs2.open(ALICE, "/home/alice/doc.kv", "rw")
    check(fs2.pred(ALICE, r, A, all_logits=True), fresh(smollm, P + A, len(A)), "restored file")
    check(fs2.pred(ALICE, r, B, all_logits=True), fresh(eng2, P + A + B, len(B)), "restored, second append")
    fs2.close(ALICE, r)
    # the original is intact too
    o = fs.open(ALICE, "/home/alice/doc.kv", "rw")
    check(fs.pred(ALICE, o, B, all_logits=True), fresh(smollm, P + B, len(B)), "original after sync")
    fs.close(ALICE, o)
    fs2.remove(ALICE, "/home/alice/doc.kv")
    fs.remove(ALICE, "/home/alice/doc.kv")
    assert used(smollm) == start and used(eng2) == 0


# ------------------------------------------------------------------ fork sharing, measured

def test_fork_sharing_64_forks(smollm, kvfs, conts):
    """A 320-token file forked 64 times: no extra page; one token appended
    to each fork: one page per fork (320 % 16 == 0: a new page each).  Then
    truncated to 310 tokens and forked again: one page per fork (the shared
    partial last page copied once per fork).  perf/bench_kvfs.py measures the
    same on a 2,000-token file."""
    start = used(smollm)
    fs = kvfs()
    tok = smollm.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": tok.decode(document(tok, 400, seed=3))}])[:320]
    assert len(ids) == 320
    f = fs.create(ALICE)
    for i in range(0, 320, 128):
        fs.pred(ALICE, f, ids[i:i + 128])
    base = used(smollm) - start
    assert base == 20
    report = {}
    for n in (320, 310):
        fs.truncate(ALICE, f, n)
        file_pages = -(-n // S)
        forks = [fs.fork(ALICE, f) for _ in range(64)]
        after_fork = used(smollm) - start - file_pages
        nxt = [100 + i for i in range(64)]                # a different token for each fork
        outs = fs.pred_batch([KVPred(ALICE, h, [t]) for h, t in zip(forks, nxt)])
        after_append = used(smollm) - start - file_pages
        report[n] = (file_pages, after_fork, after_append)
        assert after_fork == 0
        assert after_append == 64
        # a batched fork's logits equal a lone fork's, and a lone fork's equal the file's own
        lone = fs.fork(ALICE, f)
        for i in (0, 63):
            check(fs.pred(ALICE, lone, [nxt[i]]), outs[i], f"{n}: batched fork {i} vs a lone fork")
            fs.truncate(ALICE, lone, n)
        fs.close(ALICE, lone)
        for h in forks:
            fs.close(ALICE, h)
        assert used(smollm) - start == file_pages
    assert report == {320: (20, 0, 64), 310: (20, 0, 64)}
    # and against a fresh computation of the whole 311-token context
    check(fs.pred(ALICE, f, [7]), fresh(smollm, ids[:310] + [7], 1)[0], "310-token file + 1 token")
    fs.close(ALICE, f)
    assert used(smollm) == start
