"""References to KV pages and who pays for them: the one place a `Block`'s
``ref``, ``holders`` and charge change.

    refs.new(who, holder, n)      n fresh device pages, charged to ``who``, each an
                                  entry of a file of user ``holder``
    refs.hold(blocks, holder)     one entry more on each (a fork, a merge); holder
                                  None: the kernel's own (a sync copying them out)
    refs.drop(blocks, holder)     one entry less on each: a page no one maps is
                                  freed and uncharged; a page its charged user no
                                  longer maps while other users' files do is
                                  charged to the user mapping it most

Every entry of a user's files also counts in that user's page references
(`Quotas.refs_by_user`, bounded by ``user_refs``).
"""
from __future__ import annotations

from typing import Optional

from .namespace import Block, Principal


class BlockRefs:
    """Page references and charges of one KVFS (its pager and quotas)."""

    def __init__(self, pager, quotas, allocator):
        self.pager, self.quotas, self.allocator = pager, quotas, allocator

    def new(self, who: Principal, holder: str, n: int) -> list[Block]:
        """``n`` fresh device pages (the caller made room), charged to ``who``."""
        blocks = [Block(page, who.user, who.pid, holder) for page in self.allocator.allocate(n)]
        self.quotas.charge(who.user, who.pid, n)
        self.quotas.refs_by_user[holder] += n
        return blocks

    def hold(self, blocks: list[Block], holder: Optional[str] = None) -> None:
        for b in blocks:
            b.ref += 1
            if holder is not None:
                b.holders[holder] = b.holders.get(holder, 0) + 1
        if holder is not None:
            self.quotas.refs_by_user[holder] += len(blocks)

    def drop(self, blocks: list[Block], holder: Optional[str] = None) -> None:
        for b in blocks:
            b.ref -= 1
            if holder is not None:
                left = b.holders.get(holder, 0) - 1
                if left > 0:
                    b.holders[holder] = left
                else:
                    b.holders.pop(holder, None)
            if b.ref == 0:
                self.pager.release(b)
                self.quotas.uncharge(b.user, b.pid)
            elif b.user not in b.holders and b.holders:
                self._recharge(b)
        if holder is not None:
            self.quotas.refs_by_user[holder] -= len(blocks)

    def _recharge(self, b: Block) -> None:
        """``b``'s charged user maps it no more: charge the user whose files map it most."""
        new = max(b.holders, key=lambda u: (b.holders[u], u))
        self.quotas.uncharge(b.user, b.pid)
        b.user, b.pid = new, 0
        self.quotas.charge(new, 0)
