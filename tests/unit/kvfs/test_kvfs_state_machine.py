"""A hypothesis state machine drives random sequences of every KVFS operation
by several users and processes, and checks after each step that refcounts
equal page-table references, no page leaks in any tier, page and inode quotas
hold, and permissions (default modes and the umask included) are enforced as a
simple independent model predicts."""
from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from conftest import tiny_config
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine, PredError
from symphony.kvfs import (KVFS, KVFSConfig, KVFSError, NoSpace, NotFound, PermissionDenied,
                                  Principal, QuotaExceeded)
from symphony.engine.weights import random_weights

PROCS = [Principal("alice", 1), Principal("alice", 2), Principal("bob", 3), Principal("carol", 4)]
NAMES = ["/shared/a.kv", "/shared/b.kv", "/tmp/t.kv", "/home/alice/x.kv", "/home/bob/y.kv",
         "/home/carol/z.kv"]
MODES = [None, 0o600, 0o644, 0o666]                  # None: the default mode
USER_QUOTA, PROC_QUOTA, USER_INODES = 30, 20, 2
WEIGHTS = random_weights(tiny_config(max_context=128), seed=0)


def effective(mode) -> int:
    """The mode a file gets: default 0600, umask 022."""
    return (0o600 if mode is None else mode) & ~0o022


def allowed(who: Principal, owner: str, mode: int, want: str) -> bool:
    bit = 4 if want == "r" else 2
    return bool(mode & (bit << (6 if who.user == owner else 0)))


class KVFSMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        import tempfile
        self.tmp = tempfile.TemporaryDirectory()
        eng = Engine(WEIGHTS, None, EngineConfig(page_size=4, num_pages=17))   # 16 device pages
        self.fs = KVFS(eng, KVFSConfig(host_pages=6, swap_dir=self.tmp.name, disk_pages=200,
                                       user_page_quota=USER_QUOTA, process_page_quota=PROC_QUOTA,
                                       user_inode_quota=USER_INODES))
        self.files: dict[str, tuple[str, int]] = {}      # model: path -> (owner, mode)
        self.handles: list[tuple[int, Principal, bool]] = []
        self.rng = torch.Generator().manual_seed(0)

    def teardown(self):
        self.fs.close_all()
        self.tmp.cleanup()

    # ------------------------------------------------------------------ rules
    @initialize(modes=st.lists(st.sampled_from(MODES), min_size=4, max_size=4),
                sizes=st.lists(st.integers(1, 14), min_size=4, max_size=4))
    def seed_files(self, modes, sizes):
        """Every run starts with one named file per user and one anonymous
        file per process, holding tokens, so pages run short early."""
        for who, path, mode, n in zip(PROCS, ["/shared/a.kv", None, "/home/bob/y.kv", "/tmp/t.kv"],
                                      modes, sizes):
            self.create(who, path, mode)
            h = self.handles[-1][0]
            self.fs.pred(who, h, list(range(1, n + 1)))

    @rule(who=st.sampled_from(PROCS), path=st.sampled_from(NAMES + [None]), mode=st.sampled_from(MODES))
    def create(self, who, path, mode):
        expect_ok = path is None or (path not in self.files and self._may_create(who, path))
        try:
            h = self.fs.create(who, path, mode)
        except KVFSError as e:
            assert not expect_ok, f"create {path} by {who} refused: {e}"
            return
        assert expect_ok, f"create {path} by {who} should have been refused"
        if path:
            self.files[path] = (who.user, effective(mode))
        self.handles.append((h, who, True))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), path=st.sampled_from(NAMES), mode=st.sampled_from(MODES))
    def fork_named(self, i, path, mode):
        h, who, _ = self.handles[i % len(self.handles)]
        expect_ok = path not in self.files and self._may_create(who, path)
        try:
            g = self.fs.fork(who, h, path, mode)           # a fork costs no page: only names can fail
        except KVFSError as e:
            assert not expect_ok, f"fork to {path} by {who} refused: {e}"
            return
        assert expect_ok, f"fork to {path} by {who} should have been refused"
        self.files[path] = (who.user, effective(mode))
        self.handles.append((g, who, True))

    @rule(who=st.sampled_from(PROCS), path=st.sampled_from(NAMES), rw=st.booleans())
    def open(self, who, path, rw):
        if path not in self.files:
            with pytest.raises(NotFound):
                self.fs.open(who, path, "rw" if rw else "r")
            return
        owner, mode = self.files[path]
        ok = allowed(who, owner, mode, "r") and (not rw or allowed(who, owner, mode, "w"))
        try:
            h = self.fs.open(who, path, "rw" if rw else "r")
        except PermissionDenied:
            assert not ok
            return
        assert ok, f"{who} opened {path} ({oct(mode)}, owner {owner}) for {'rw' if rw else 'r'}"
        self.handles.append((h, who, rw))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99))
    def close(self, i):
        h, who, _ = self.handles.pop(i % len(self.handles))
        self.fs.close(who, h)

    @rule(who=st.sampled_from(PROCS), path=st.sampled_from(NAMES))
    def remove(self, who, path):
        if path not in self.files:
            with pytest.raises(NotFound):
                self.fs.remove(who, path)
            return
        owner, _ = self.files[path]
        top = path.split("/")[1]
        ok = who.user == owner if top in ("shared", "tmp") else path.split("/")[2] == who.user
        try:
            self.fs.remove(who, path)
        except PermissionDenied:
            assert not ok
            return
        assert ok, f"{who} removed {path} owned by {owner}"
        del self.files[path]

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), n=st.integers(1, 9))
    def pred(self, i, n):
        h, who, rw = self.handles[i % len(self.handles)]
        toks = torch.randint(0, 101, (n,), generator=self.rng).tolist()
        try:
            out = self.fs.pred(who, h, toks)
        except (QuotaExceeded, NoSpace, PredError):
            return
        except KVFSError as e:
            assert not rw and e.code == "EROFS", e
            return
        assert rw and out.shape == (101,) and torch.isfinite(out).all()

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        h, who, _ = self.handles[i % len(self.handles)]
        try:
            self.handles.append((self.fs.fork(who, h), who, True))
        except (QuotaExceeded, NoSpace):
            pass

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def truncate(self, i, frac):
        h, who, rw = self.handles[i % len(self.handles)]
        n = int(self.fs.handles[h].inode.length * frac)
        try:
            self.fs.truncate(who, h, n)
        except KVFSError as e:
            assert not rw and e.code == "EROFS"

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), a=st.floats(0, 1), b=st.floats(0, 1))
    def extract(self, i, a, b):
        h, who, _ = self.handles[i % len(self.handles)]
        length = self.fs.handles[h].inode.length
        lo, hi = sorted((int(a * length), int(b * length)))
        try:
            self.handles.append((self.fs.extract(who, h, [[lo, hi]]), who, True))
        except KVFSError as e:
            assert lo == hi or e.code in ("EDQUOT", "ENOSPC"), e

    @precondition(lambda self: len(self.handles) >= 2)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def merge(self, i, j):
        h1, who, _ = self.handles[i % len(self.handles)]
        mine = [h for h, w, _ in self.handles if w == who]
        h2 = mine[j % len(mine)]
        try:
            self.handles.append((self.fs.merge(who, [h1, h2]), who, True))
        except KVFSError as e:
            assert e.code in ("EDQUOT", "ENOSPC", "EINVAL"), e

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99))
    def swap_out(self, i):
        h, _, _ = self.handles[i % len(self.handles)]
        try:
            self.fs.pager.swap_out(list({b.id: b for b in self.fs.handles[h].inode.blocks}.values()))
        except NoSpace:
            pass

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 99), hint=st.sampled_from(["keep", "drop_first", "normal"]))
    def advise(self, i, hint):
        h, who, _ = self.handles[i % len(self.handles)]
        try:
            self.fs.advise(who, h, hint)
        except PermissionDenied:
            inode = self.fs.handles[h].inode
            assert who.user != inode.owner and not allowed(who, inode.owner, inode.mode, "w")

    @rule(who=st.sampled_from(PROCS))
    def exit_process(self, who):
        self.fs.exit_process(who.pid)
        self.handles = [x for x in self.handles if x[1].pid != who.pid]

    # ------------------------------------------------------------------ invariants
    @invariant()
    def refcounts_and_no_leaks(self):
        fs = self.fs
        refs, blocks = Counter(), {}
        for inode in fs.inodes.values():
            assert inode.linked or inode.handles > 0, "an unreachable inode was kept"
            assert len(inode.blocks) == -(-inode.length // fs.page_size)
            for b in inode.blocks:
                refs[b.id] += 1
                blocks[b.id] = b
        for bid, b in blocks.items():
            assert b.ref == refs[bid], f"{b}: ref {b.ref} but {refs[bid]} page-table references"
        tiers = Counter(b.tier for b in blocks.values())
        alloc = fs.engine.kv.allocator
        assert alloc.num_used == tiers["device"], "device page leak"
        devs = [b.device for b in blocks.values() if b.device >= 0]
        assert len(set(devs)) == len(devs) and all(alloc.is_allocated(p) for p in devs)
        p = fs.pager
        assert p.host_capacity - len(p.host_free) == tiers["host"], "host slot leak"
        assert p.disk_next - len(p.disk_free) == tiers["disk"], "disk slot leak"
        assert all(h in fs.handles for h, _, _ in self.handles), "a handle vanished"
        assert len(fs.handles) == len(self.handles), "a handle leaked"

    @invariant()
    def quotas_hold(self):
        """Charges, holders and page references match the page tables.  A user's
        charge may pass the quota only by a recharge: a page another user made
        that only this user's files still map."""
        fs = self.fs
        by_user, refs, held = Counter(), Counter(), {}
        for inode in fs.inodes.values():
            refs[inode.owner] += len(inode.blocks)
            for b in inode.blocks:
                held.setdefault(b.id, (b, Counter()))[1][inode.owner] += 1
        for b, owners in held.values():
            by_user[b.user] += 1
            assert b.holders == dict(owners), f"{b}: holders {b.holders}, its files' owners {dict(owners)}"
        for user in ("alice", "bob", "carol"):
            assert fs.quotas.by_user[user] == by_user[user]
            assert fs.quotas.refs_by_user[user] == refs[user]
            made = sum(1 for b, _ in held.values() if b.user == user and b.pid != 0)
            assert made <= USER_QUOTA
        for pid, n in fs.quotas.by_pid.items():
            assert n <= PROC_QUOTA

    @invariant()
    def inodes_and_modes_match_the_model(self):
        owned = Counter(owner for owner, _ in self.files.values())
        for user in ("alice", "bob", "carol"):
            assert self.fs.quotas.inodes_by_user[user] == owned[user] <= USER_INODES
        for path, (owner, mode) in self.files.items():
            st_ = self.fs.stat(PROCS[0], path)
            assert (st_["owner"], st_["mode"]) == (owner, mode), path

    def _may_create(self, who, path):
        parts = path.split("/")
        if sum(1 for owner, _ in self.files.values() if owner == who.user) >= USER_INODES:
            return False                                    # the inode quota
        if parts[1] == "home":
            return parts[2] == who.user
        return True


KVFSMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_kvfs_state_machine = KVFSMachine.TestCase
