"""The page allocator of the paged KV cache: which device pages are free.

Pure Python, no torch: it hands out page *ids*; the tensors live in
`kv_cache.KVPool`.  Page 0 is the reserved null page: it is never handed out,
so padding entries of a page table can point at it harmlessly.

    alloc = PageAllocator(num_pages=8)
    a = alloc.allocate(2)        # [1, 2]
    alloc.free(a)                # back on the free list

A page has ONE owner.  Sharing a page between files (fork, copy-on-write) is
KVFS's business: its `Block` carries the one reference count, and it frees the
page when the last reference goes.  The free list is a stack: allocate and free
are O(1), and a page freed most recently is reused first (it is the one most
likely still in cache).
"""
from __future__ import annotations

from typing import Iterable

NULL_PAGE = 0


def pages_for(n_slots: int, page_size: int) -> int:
    """Pages needed to hold ``n_slots`` KV slots (ceil(n_slots / page_size))."""
    return -(-n_slots // page_size)


class OutOfPages(MemoryError):
    """Not enough free pages for the request; nothing was allocated."""


class PageError(ValueError):
    """A page id that is out of range or not allocated (double free)."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is reserved), got {num_pages!r}")
        self.num_pages = num_pages
        self._used = [False] * num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() yields 1, 2, 3, ...

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def is_allocated(self, page: int) -> bool:
        self._check_id(page)
        return self._used[page]

    # ------------------------------------------------------------------ updates
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages, or `OutOfPages` and nothing taken."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"page count must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, only {len(self._free)} of {self.capacity} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give pages back.  Validated as a whole first: a page that is not
        allocated, or named twice, raises `PageError` and changes nothing."""
        pages = list(pages)
        seen = set()
        for p in pages:
            self._check_id(p)
            if p == NULL_PAGE:
                raise PageError("page 0 is the reserved null page")
            if not self._used[p] or p in seen:
                raise PageError(f"page {p} is not allocated (double free)")
            seen.add(p)
        for p in pages:
            self._used[p] = False
            self._free.append(p)

    # ------------------------------------------------------------------ helpers
    def _check_id(self, page: int) -> None:
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < self.num_pages:
            raise PageError(f"page id {page!r} out of range [0, {self.num_pages})")
