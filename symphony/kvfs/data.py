"""KVFS data operations: pred, fork, truncate, extract, merge.

`Data` is a part of `fs.KVFS` (``fs.data``; KVFS's methods of the same names
call it), given the namespace and its `memory.Memory`.  KVFS owns page sharing: a `Block`'s ``ref`` is the one
reference count of a page, and the copy-on-write below (`_place`) the one
copy-on-write.  Invariants kept by every operation:
  * a block's ``ref`` equals the number of page-table entries pointing at it;
  * a block shared by two files is never written: a write into a shared
    partial last block first copies it (copy-on-write);
  * full blocks are shared, never copied, by fork, and by extract/merge
    wherever source and destination are page-aligned.

pred: `check_pred` validates a whole call once, when it is submitted.  A
step of (already checked) calls is two calls here around the runner, which
KVFS never calls itself in the kernel:

    plan = fs.prepare(calls)          # page tables: swap-ins, copy-on-write, fresh pages charged
    out = engine.runner.run(plan.step)
    results = fs.commit(plan, out)    # commit what succeeded, undo what failed (fs.undo: all)

`commit` keeps the books: a call that succeeded is committed to its inode
(blocks, positions), a call that failed gives its fresh pages back and, if
earlier steps had already fed chunks of it (``KVPred.fed``), those are
truncated away, so the file is as it was before the call.  `pred` and
`pred_batch` are the same walk in-process, all or nothing (`run_planned`).
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import time
from typing import Callable, Optional, Sequence

import torch

from symphony.engine.engine import PredError
from symphony.engine.page_allocator import pages_for
from symphony.engine.runner import CallResult, ModelStep, StepCall, StepOutput, Want, run_planned
from .errors import InvalidArgument, NoSpace, QuotaExceeded, ReadOnlyHandle
from .namespace import Block, Inode, Principal


@dataclass
class KVPred:
    """One pred() call (or one chunk of one) through KVFS."""

    who: Principal
    handle: int
    tokens: Sequence[int]
    positions: Optional[Sequence[int]] = None
    all_logits: bool = False
    want: Want = Want()             # what it gets back (logits by default)
    fed: int = 0                    # tokens of the same call earlier steps appended (undone on failure)


@dataclass
class Placement:
    """One call's page table for a step, not yet committed to its inode."""

    inode: Inode
    blocks: list[Block]             # the inode's blocks after the call
    fresh: list[Block]              # blocks made for it (given back on failure)
    replaced: Optional[Block]       # the shared last block it copied (dropped on success)
    call: StepCall


@dataclass
class StepPlan:
    """What `prepare` made of a step's calls: the `ModelStep` to run, and per
    call its `Placement` (or the error that refused it) for `commit`."""

    calls: Sequence[KVPred]
    inodes: list[Optional[Inode]]
    placed: list                    # per call: a Placement, or the exception
    step: ModelStep                 # the placed calls, in order
    atomic: bool = False            # all or nothing: commit raises the first error


class Data:
    """pred, fork, truncate, extract, merge on KVFS's files.  Given the
    namespace (``fs``: handles, files) and its `Memory` (room for new pages)."""

    def __init__(self, fs, memory):
        self.fs, self.memory, self.handles = fs, memory, fs.handles
        self.engine, self.page_size = fs.engine, fs.page_size
        self.quotas, self.refs, self.pager = fs.quotas, fs.refs, fs.pager

    # ------------------------------------------------------------------ pred
    def pred(self, who: Principal, hid: int, tokens, positions=None, *, all_logits: bool = False):
        return self.pred_batch([KVPred(who, hid, tokens, positions, all_logits)])[0]

    def pred_batch(self, calls: Sequence[KVPred]) -> list[torch.Tensor]:
        """Append tokens to files and run ONE forward pass for all calls; each
        call's logits ([vocab], or [n, vocab] with all_logits).  All or nothing:
        the first error is raised and no file changes.  (In-process: the
        kernel's step calls `prepare` and `commit` itself.)"""
        if not calls:
            return []
        checked = [self.check_pred(c.who, c.handle, c.tokens, c.positions, c.all_logits) for c in calls]
        inodes = [self.handles.of(c.who, c.handle).inode for c in calls]
        if len({i.ino for i in inodes}) != len(inodes):
            raise InvalidArgument("the same KV file appears twice in one pred batch")
        calls = [KVPred(c.who, c.handle, t, p, c.all_logits, c.want, c.fed)
                 for c, (t, p) in zip(calls, checked)]
        out = run_planned(_Atomic(self), self.engine.runner, calls)
        return [r.value if c.all_logits else r.value[0] for c, r in zip(calls, out)]

    def check_pred(self, who: Principal, hid: int, tokens, positions=None,
                   all_logits: bool = False) -> tuple[list[int], Optional[list[int]]]:
        """Validate a whole pred call, changing nothing: the handle (open,
        writable), tokens against the vocabulary, positions against the
        context, the file's length limit and the caller's quota.  Returns
        (tokens, positions) as lists (positions None: continue the file); a
        long prompt is then fed in chunks by `prepare` without re-checking.
        Over the user's page quota, their unopened cache files are deleted
        first (`make_quota_room`), as the memory manager may delete them at
        any time."""
        h = self.handles.of(who, hid)
        if not h.writable:
            raise ReadOnlyHandle(f"KV handle {hid} is read-only (fork it to write)")
        inode = h.inode
        toks, pos = self.engine.check_call(tokens, positions, length=inode.length,
                                           next_position=_next_position(inode), all_logits=all_logits)
        S = self.page_size
        new, cow = append_growth(inode, len(toks), S)
        need, cap = len(inode.blocks) + new + cow, self.engine.kv.allocator.capacity
        if need > cap:
            raise NoSpace(f"pred needs {need} device KV pages (the file's {inode.length} tokens + "
                          f"{len(toks)} new at {S} tokens a page); the device pool holds {cap} pages: "
                          f"{need - cap} too many")
        try:
            self.quotas.check_one(who.user, who.pid, new + cow)
        except QuotaExceeded:                      # the user's own cache files go first
            if not self.memory.make_quota_room(who.user, new + cow):
                raise
            self.quotas.check_one(who.user, who.pid, new + cow)
        self.quotas.check_refs(inode.owner, new)
        return toks, pos

    def device_need(self, who: Principal, hid: int, n_tokens: int) -> int:
        """Device pages a checked call appending ``n_tokens`` to handle ``hid``
        takes when it runs now: its file's blocks not on the device, the new
        pages, and one more if it copies a shared partial last page.  Exactly
        what `prepare` then allocates or swaps in; changes nothing."""
        inode = self.handles.of(who, hid).inode
        new, cow = append_growth(inode, n_tokens, self.page_size)
        missing = len({b.id for b in inode.blocks if b.device < 0})
        return missing + new + cow

    def passes(self, calls: Sequence[KVPred]) -> list[list[int]]:
        """The calls' indexes split into steps that each write a file once: a
        call on a file an earlier call of the list also writes goes to a
        following pass (their order matters)."""
        out, todo = [], list(range(len(calls)))
        while todo:
            seen, now, later = set(), [], []
            for i in todo:
                h = self.handles.get(calls[i].handle)
                ino = h.inode.ino if h is not None else None
                (later if ino is not None and ino in seen else now).append(i)
                seen.add(ino)
            out.append(now)
            todo = later
        return out

    def prepare(self, calls: Sequence[KVPred], atomic: bool = False) -> StepPlan:
        """Plan a step of checked calls (tokens and positions as `check_pred`
        returned them, or slices of them), each on a different file (`passes`):
        each call's blocks swapped in, a shared partial last page copied, fresh
        pages allocated and charged.  A call that cannot be placed is refused
        with its error (``atomic``: everything planned is undone and the error
        raised).  Nothing is committed to a file until `commit`."""
        inodes: list[Optional[Inode]] = []
        for c in calls:
            try:
                inodes.append(self.handles.of(c.who, c.handle).inode)
            except Exception:
                inodes.append(None)
        # the blocks no placement may evict: every call's (made only if a placement must evict)
        protect = functools.cache(lambda: {b.id for i in inodes if i is not None for b in i.blocks})
        placed: list = []
        for c, inode in zip(calls, inodes):
            try:
                if inode is None:
                    self.handles.of(c.who, c.handle)             # raises the handle's error
                placed.append(self._place(c, inode, protect))
            except Exception as e:
                if atomic:
                    self._undo_placed([p for p in placed if isinstance(p, Placement)])
                    raise
                placed.append(e)
        step = ModelStep([p.call for p in placed if isinstance(p, Placement)])
        return StepPlan(calls, inodes, placed, step, atomic)

    def commit(self, plan: StepPlan, out: StepOutput) -> list[CallResult]:
        """Keep the books after the runner ran ``plan.step``: a call that
        succeeded is committed to its file (blocks, positions); a call that
        failed gives its fresh pages back and, if earlier steps had already fed
        chunks of it (``KVPred.fed``), those are truncated away, so the file is
        as it was before the call.  A result or an error per call."""
        it = iter(out.results)
        results = [CallResult(error=p) if isinstance(p, BaseException) else next(it) for p in plan.placed]
        if plan.atomic:
            err = next((r.error for r in results if r.error is not None), None)
            if err is not None:
                self.undo(plan)
                raise err
        for c, inode, p, r in zip(plan.calls, plan.inodes, plan.placed, results):
            if r.error is None:
                self._commit(p)
                continue
            if isinstance(p, Placement):
                self._undo_placed([p])
            if c.fed > 0 and inode is not None:               # undo the call's earlier chunks
                self._cut(inode, max(inode.length - c.fed, 0))
        return results

    def undo(self, plan: StepPlan) -> None:
        """Give back every page ``plan`` took (the step did not run)."""
        self._undo_placed([p for p in plan.placed if isinstance(p, Placement)])

    def _place(self, c: KVPred, inode: Inode, protect: Callable[[], set]) -> Placement:
        """The call's page table: its blocks resident, a shared partial last
        block copied (copy-on-write), fresh blocks for the new slots, charged to
        the caller.  Raises (changing nothing) when pages or quota run out."""
        toks = c.tokens if type(c.tokens) is list else list(c.tokens)   # (a call's chunk: a list of its own)
        n, length, S = len(toks), inode.length, self.page_size
        if c.positions is None:
            start = _next_position(inode)
            pos = list(range(start, start + n))
        else:
            pos = list(c.positions)
        # the file may have grown since the call was checked (earlier calls on it)
        if length + n > self.engine.max_seq_len or pos[-1] >= self.engine.model_config.max_context:
            raise PredError(f"pred: the KV file would hold {length + n} tokens up to position "
                            f"{pos[-1]}, past the limit {self.engine.max_seq_len}")
        new, cow = append_growth(inode, n, S)
        who = c.who
        self.quotas.check_one(who.user, who.pid, new + cow)
        self.quotas.check_refs(inode.owner, new)
        self._make_resident([inode], extra=new + cow, protect=protect)
        fresh = self.refs.new(who, inode.owner, new + cow) if new + cow else []
        # a decode within its last page keeps the page table as it is: no copy of its blocks
        blocks, replaced = list(inode.blocks) if fresh else inode.blocks, None
        if cow:
            replaced = blocks[-1]
            self.engine.kv.copy_page(replaced.device, fresh[0].device, length % S)
            blocks[-1] = fresh[0]
        blocks.extend(fresh[cow:])
        call = StepCall([b.device for b in blocks], length, toks, pos, c.all_logits, c.want)
        return Placement(inode, blocks, fresh, replaced, call)

    def _commit(self, p: Placement) -> None:
        inode = p.inode
        inode.blocks = p.blocks
        if p.replaced is not None:
            self.refs.drop([p.replaced], inode.owner)
        inode.positions.extend(p.call.positions)
        inode.mtime = inode.atime = _now()
        self.memory.touch(inode)

    def _undo_placed(self, placed: list[Placement]) -> None:
        for p in placed:
            self.refs.drop(p.fresh, p.inode.owner)

    # ------------------------------------------------------------------ fork / truncate
    def fork(self, who: Principal, hid: int, path: Optional[str] = None, mode: Optional[int] = None) -> int:
        """A copy-on-write clone (anonymous unless ``path``; ``mode`` as in
        `create`), opened read-write.  Shares every block; costs no page until
        one side writes."""
        src = self.handles.of(who, hid).inode
        self.quotas.check_refs(who.user, len(src.blocks))
        new = self.fs.create(who, path, mode)
        inode = self.handles[new].inode
        self.refs.hold(src.blocks, inode.owner)
        inode.blocks = list(src.blocks)
        inode.positions = list(src.positions)
        inode.advice = src.advice if src.advice not in ("keep", "cache") else "normal"
        self.memory.touch(inode)
        return new

    def truncate(self, who: Principal, hid: int, n: int) -> None:
        """Keep the first ``n`` tokens (undo, speculative rollback)."""
        h = self.handles.of(who, hid)
        if not h.writable:
            raise ReadOnlyHandle(f"KV handle {hid} is read-only")
        inode = h.inode
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= inode.length:
            raise InvalidArgument(f"truncate length must be an int in [0, {inode.length}], got {n!r}")
        self._cut(inode, n)

    # ------------------------------------------------------------------ extract / merge
    def extract(self, who: Principal, hid: int, ranges, path: Optional[str] = None,
                mode: Optional[int] = None) -> int:
        """A new file holding token ranges ``[(start, end), ...]`` (half-open,
        increasing, non-overlapping) of this one, at their original positions."""
        src = self.handles.of(who, hid).inode
        segs = []
        last = 0
        if not isinstance(ranges, (list, tuple)) or not ranges:
            raise InvalidArgument("ranges must be a non-empty list of [start, end) pairs")
        for r in ranges:
            if not (isinstance(r, (list, tuple)) and len(r) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
                raise InvalidArgument(f"bad range {r!r}: expected [start, end) ints")
            a, e = r
            if not last <= a < e <= src.length:
                raise InvalidArgument(f"range {list(r)} is empty, out of order, overlapping or "
                                      f"past the file's length {src.length}")
            segs.append((src, a, e))
            last = e
        return self._assemble(who, segs, path, mode)

    def prefix(self, who: Principal, src: Inode, n: int, path: Optional[str] = None,
               mode: Optional[int] = None) -> int:
        """A new file holding the first ``n`` tokens of ``src`` (the caller
        checked it may read it): `extract` of [0, n) without a handle."""
        return self._assemble(who, [(src, 0, n)], path, mode)

    def merge(self, who: Principal, hids: Sequence[int], path: Optional[str] = None,
              mode: Optional[int] = None) -> int:
        """A new file: the files' tokens one after another, each at its own positions
        (modular attention reuse, as in Prompt Cache)."""
        if not isinstance(hids, (list, tuple)) or not hids:
            raise InvalidArgument("merge needs a non-empty list of handles")
        segs = [(self.handles.of(who, h).inode, 0, self.handles.of(who, h).inode.length) for h in hids]
        return self._assemble(who, [s for s in segs if s[2] > 0], path, mode)

    # ------------------------------------------------------------------ helpers
    def _cut(self, inode: Inode, n: int) -> None:
        """Keep the first ``n`` tokens of the file."""
        keep = pages_for(n, self.page_size)
        self.refs.drop(inode.blocks[keep:], inode.owner)
        del inode.blocks[keep:]
        del inode.positions[n:]
        inode.mtime = _now()
        if inode.chain is not None:
            self.fs.chains.cut(inode, n)

    def _make_resident(self, inodes: list[Inode], extra: int = 0,
                       protect: Optional[Callable[[], set]] = None) -> None:
        """Swap in every block of ``inodes`` and leave ``extra`` free device pages,
        evicting no block in ``protect()`` (by default: the blocks of ``inodes``)."""
        if extra <= self.pager.alloc.num_free and self.pager.all_resident():
            return                                  # nothing to swap in, room enough: the common case
        protect = {b.id for i in inodes for b in i.blocks} if protect is None else protect()
        missing = [b for i in inodes for b in i.blocks if b.device < 0]
        missing = list({b.id: b for b in missing}.values())
        self.memory.make_room(len(missing) + extra, protect)
        self.pager.swap_in(missing)

    def _assemble(self, who: Principal, segs, path: Optional[str], mode: Optional[int]) -> int:
        S = self.page_size
        total = sum(e - a for _, a, e in segs)
        if total > self.engine.max_seq_len:
            raise InvalidArgument(f"result would hold {total} tokens, more than {self.engine.max_seq_len}")
        self.fs._new_mode(mode, 0)                              # fail on a bad mode or path before any work
        if path is not None:
            self.fs._parent_for_create(who, path)
        plan: list = []          # per destination block: a shared Block, or a list of (Block, offset)
        positions: list[int] = []
        n = 0
        for k, (inode, a, e) in enumerate(segs):
            j = a
            last_seg = k == len(segs) - 1
            while j < e:
                bi = j // S
                aligned = n % S == 0 and j % S == 0
                if aligned and (j + S <= e or (last_seg and e == inode.length)):
                    plan.append(inode.blocks[bi])
                    step = min(S, e - j)
                else:
                    if n % S == 0:
                        plan.append([])
                    plan[-1].append((inode.blocks[bi], j % S))
                    step = 1
                j += step
                n += step
            positions.extend(inode.positions[a:e])
        fresh = sum(1 for p in plan if isinstance(p, list))
        self.quotas.check({(who.user, who.pid): fresh})
        self.quotas.check_refs(who.user, len(plan))
        sources = list({b.id: b for p in plan if isinstance(p, list) for b, _ in p}.values())
        protect = {b.id for p in plan for b in ([p] if isinstance(p, Block) else [x for x, _ in p])}
        missing = [b for b in sources if b.device < 0]
        self.memory.make_room(len(missing) + fresh, protect)
        self.pager.swap_in(missing)
        it = iter(self.refs.new(who, who.user, fresh))
        src_p, src_o, dst_p, dst_o = [], [], [], []
        blocks = []
        for p in plan:
            if isinstance(p, Block):
                self.refs.hold([p], who.user)
                blocks.append(p)
            else:
                nb = next(it)
                for off, (b, o) in enumerate(p):
                    src_p.append(b.device), src_o.append(o), dst_p.append(nb.device), dst_o.append(off)
                blocks.append(nb)
        if src_p:
            self.engine.kv.copy_slots(src_p, src_o, dst_p, dst_o)
        try:
            hid = self.fs.create(who, path, mode)
        except BaseException:
            self.refs.drop(blocks, who.user)
            raise
        inode = self.handles[hid].inode
        inode.blocks, inode.positions = blocks, positions
        return hid


class _Atomic:
    """KVFS as an all-or-nothing `PageOwner` (`pred_batch`)."""

    def __init__(self, fs):
        self.fs = fs

    def prepare(self, calls):
        return self.fs.prepare(calls, atomic=True)

    def commit(self, plan, out):
        return self.fs.commit(plan, out)

    def undo(self, plan):
        self.fs.undo(plan)


def append_growth(inode: Inode, n: int, page_size: int) -> tuple[int, int]:
    """Pages appending ``n`` tokens to ``inode`` makes: (new pages, 1 if its
    shared partial last page must be copied first else 0)."""
    new = pages_for(inode.length + n, page_size) - len(inode.blocks)
    cow = int(inode.length % page_size != 0 and inode.blocks[-1].ref > 1)
    return new, cow


def _next_position(inode: Inode) -> int:
    """Default position of the next token appended to the file."""
    return inode.positions[-1] + 1 if inode.positions else 0


_now = time.time
