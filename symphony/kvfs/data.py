"""KVFS data operations: pred, fork, truncate, extract, merge.

Mixed into `fs.KVFS`.  Invariants kept by every operation:
  * a block's ``ref`` equals the number of page-table entries pointing at it;
  * a block shared by two files is never written: a write into a shared
    partial last block first copies it (copy-on-write);
  * full blocks are shared, never copied, by fork, and by extract/merge
    wherever source and destination are page-aligned.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from symphony.engine.engine import PredRequest
from symphony.engine.kv_cache import KVSequence
from .errors import InvalidArgument, ReadOnlyHandle
from .namespace import Block, Inode, Principal


@dataclass
class KVPred:
    """One pred() call through KVFS."""

    who: Principal
    handle: int
    tokens: Sequence[int]
    positions: Optional[Sequence[int]] = None
    all_logits: bool = False


class DataOps:
    # ------------------------------------------------------------------ pred
    def pred(self, who: Principal, hid: int, tokens, positions=None, *, all_logits: bool = False):
        return self.pred_batch([KVPred(who, hid, tokens, positions, all_logits)])[0]

    def pred_batch(self, calls: Sequence[KVPred]) -> list[torch.Tensor]:
        """Append tokens to files and run ONE forward pass for all calls."""
        self._tick()
        if not calls:
            return []
        inodes = []
        for c in calls:
            h = self._handle(c.who, c.handle)
            if not h.writable:
                raise ReadOnlyHandle(f"KV handle {c.handle} is read-only (fork it to write)")
            inodes.append(h.inode)
        if len({i.ino for i in inodes}) != len(inodes):
            raise InvalidArgument("the same KV file appears twice in one pred batch")
        eng, S = self.engine, self.page_size
        # validate every call before anything moves
        checked = []
        for i, (c, inode) in enumerate(zip(calls, inodes)):
            probe = KVSequence([], inode.positions)
            checked.append(eng.validate(i, PredRequest(probe, c.tokens, c.positions, c.all_logits)))
        cow = [i.length % S != 0 and i.blocks[-1].ref > 1 for i in inodes]
        new_pages = [-(-(i.length + len(t)) // S) - len(i.blocks) for i, (t, _) in zip(inodes, checked)]
        need = Counter()
        for c, n, w in zip(calls, new_pages, cow):
            need[(c.who.user, c.who.pid)] += n + w
        self.quotas.check(need)
        self._make_resident(inodes, extra=sum(new_pages) + sum(cow))
        for inode, w, c in zip(inodes, cow, calls):
            if w:
                self._copy_on_write(inode, c.who)
        seqs = [KVSequence([b.device for b in i.blocks], i.positions) for i in inodes]
        out = eng.pred_batch([PredRequest(s, t, p, c.all_logits)
                              for s, (t, p), c in zip(seqs, checked, calls)], checked=checked)
        for inode, seq, c in zip(inodes, seqs, calls):
            for page in seq.pages[len(inode.blocks):]:
                inode.blocks.append(Block(page, c.who.user, c.who.pid))
                self.quotas.charge(c.who.user, c.who.pid)
            inode.mtime = inode.atime = _now()
            self._lru_touch(inode)
        return out

    def check_pred(self, who: Principal, hid: int, tokens, positions=None, all_logits: bool = False) -> None:
        """Raise what pred() would raise for this whole call, changing nothing
        (the scheduler checks a long prompt once before feeding it in chunks)."""
        h = self._handle(who, hid)
        if not h.writable:
            raise ReadOnlyHandle(f"KV handle {hid} is read-only (fork it to write)")
        inode = h.inode
        toks, _ = self.engine.validate(0, PredRequest(KVSequence([], inode.positions), tokens, positions,
                                                      all_logits))
        S = self.page_size
        new = -(-(inode.length + len(toks)) // S) - len(inode.blocks)
        cow = int(inode.length % S != 0 and inode.blocks[-1].ref > 1)
        self.quotas.check({(who.user, who.pid): new + cow})

    # ------------------------------------------------------------------ fork / truncate
    def fork(self, who: Principal, hid: int, path: Optional[str] = None, mode: Optional[int] = None) -> int:
        """A copy-on-write clone (anonymous unless ``path``; ``mode`` as in
        `create`), opened read-write.  Shares every block; costs no page until
        one side writes."""
        src = self._handle(who, hid).inode
        new = self.create(who, path, mode)
        inode = self.handles[new].inode
        for b in src.blocks:
            b.ref += 1
        inode.blocks = list(src.blocks)
        inode.positions = list(src.positions)
        inode.advice = src.advice if src.advice != "keep" else "normal"
        self._lru_touch(inode)
        return new

    def truncate(self, who: Principal, hid: int, n: int) -> None:
        """Keep the first ``n`` tokens (undo, speculative rollback)."""
        h = self._handle(who, hid)
        if not h.writable:
            raise ReadOnlyHandle(f"KV handle {hid} is read-only")
        inode = h.inode
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= inode.length:
            raise InvalidArgument(f"truncate length must be an int in [0, {inode.length}], got {n!r}")
        keep = -(-n // self.page_size)
        self._drop_blocks(inode.blocks[keep:])
        del inode.blocks[keep:]
        del inode.positions[n:]
        inode.mtime = _now()

    # ------------------------------------------------------------------ extract / merge
    def extract(self, who: Principal, hid: int, ranges, path: Optional[str] = None,
                mode: Optional[int] = None) -> int:
        """A new file holding token ranges ``[(start, end), ...]`` (half-open,
        increasing, non-overlapping) of this one, at their original positions."""
        src = self._handle(who, hid).inode
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

    def merge(self, who: Principal, hids: Sequence[int], path: Optional[str] = None,
              mode: Optional[int] = None) -> int:
        """A new file: the files' tokens one after another, each at its own positions
        (modular attention reuse, as in Prompt Cache)."""
        if not isinstance(hids, (list, tuple)) or not hids:
            raise InvalidArgument("merge needs a non-empty list of handles")
        segs = [(self._handle(who, h).inode, 0, self._handle(who, h).inode.length) for h in hids]
        return self._assemble(who, [s for s in segs if s[2] > 0], path, mode)

    # ------------------------------------------------------------------ helpers
    def _make_resident(self, inodes: list[Inode], extra: int = 0) -> None:
        """Swap in every block of ``inodes`` and leave ``extra`` free device pages."""
        protect = {b.id for i in inodes for b in i.blocks}
        missing = [b for i in inodes for b in i.blocks if b.device < 0]
        missing = list({b.id: b for b in missing}.values())
        self.pager.make_room(len(missing) + extra, self._victims(protect))
        self.pager.swap_in(missing)

    def _copy_on_write(self, inode: Inode, who: Principal) -> None:
        old = inode.blocks[-1]
        [page] = self.engine.kv.allocator.allocate(1)
        self.engine.kv.copy_page(old.device, page, inode.length % self.page_size)
        inode.blocks[-1] = Block(page, who.user, who.pid)
        self.quotas.charge(who.user, who.pid)
        self._drop_blocks([old])

    def _assemble(self, who: Principal, segs, path: Optional[str], mode: Optional[int]) -> int:
        S = self.page_size
        total = sum(e - a for _, a, e in segs)
        if total > self.engine.max_seq_len:
            raise InvalidArgument(f"result would hold {total} tokens, more than {self.engine.max_seq_len}")
        self._new_mode(mode, 0)                              # fail on a bad mode or path before any work
        if path is not None:
            self._parent_for_create(who, path)
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
        sources = list({b.id: b for p in plan if isinstance(p, list) for b, _ in p}.values())
        protect = {b.id for p in plan for b in ([p] if isinstance(p, Block) else [x for x, _ in p])}
        missing = [b for b in sources if b.device < 0]
        self.pager.make_room(len(missing) + fresh, self._victims(protect))
        self.pager.swap_in(missing)
        pages = self.engine.kv.allocator.allocate(fresh)
        src_p, src_o, dst_p, dst_o = [], [], [], []
        it = iter(pages)
        blocks = []
        for p in plan:
            if isinstance(p, Block):
                p.ref += 1
                blocks.append(p)
            else:
                page = next(it)
                for off, (b, o) in enumerate(p):
                    src_p.append(b.device), src_o.append(o), dst_p.append(page), dst_o.append(off)
                blocks.append(Block(page, who.user, who.pid))
                self.quotas.charge(who.user, who.pid)
        if src_p:
            pool = self.engine.kv.pool                      # [L, 2, pages, S, H, D]
            dev = pool.device
            t = lambda x: torch.tensor(x, device=dev)
            pool[:, :, t(dst_p), t(dst_o)] = pool[:, :, t(src_p), t(src_o)]
        try:
            hid = self.create(who, path, mode)
        except BaseException:
            self._drop_blocks(blocks)
            raise
        inode = self.handles[hid].inode
        inode.blocks, inode.positions = blocks, positions
        return hid


def _now() -> float:
    import time
    return time.time()
