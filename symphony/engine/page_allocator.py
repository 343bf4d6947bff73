"""Reference-counted page allocator for the paged KV cache.

Pure Python, no torch: it hands out page *ids*; the tensors live in
`kv_cache.KVPool`.  Page 0 is the reserved null page: it is never handed out,
so padding entries of a page table can point at it harmlessly.

    alloc = PageAllocator(num_pages=8)
    a = alloc.allocate(2)        # [1, 2]     refcounts 1
    alloc.incref(a)              # a fork shares them: refcounts 2
    alloc.decref(a)              # []         nothing freed yet
    alloc.decref(a)              # [1, 2]     back on the free list

The free list is a stack: allocate and free are O(1), and a page freed most
recently is reused first (it is the one most likely still in cache).
"""
from __future__ import annotations

from typing import Iterable

NULL_PAGE = 0


class OutOfPages(MemoryError):
    """Not enough free pages for the request; nothing was allocated."""


class PageError(ValueError):
    """A page id that is out of range or not allocated (double free)."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is reserved), got {num_pages!r}")
        self.num_pages = num_pages
        self._ref = [0] * num_pages
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

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._ref[page]

    # ------------------------------------------------------------------ updates
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with refcount 1, or `OutOfPages` and nothing taken."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"page count must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, only {len(self._free)} of {self.capacity} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Share allocated pages (fork): each refcount + 1."""
        pages = list(pages)
        for p in pages:
            self._check_live(p)
        for p in pages:
            self._ref[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference to each page; return the pages that became free.

        Validated as a whole first: a double free raises `PageError` and changes
        nothing.
        """
        pages = list(pages)
        need: dict[int, int] = {}
        for p in pages:
            self._check_live(p)
            need[p] = need.get(p, 0) + 1
        for p, k in need.items():
            if k > self._ref[p]:
                raise PageError(f"page {p} released {k} times but has refcount {self._ref[p]}")
        freed = []
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed

    # ------------------------------------------------------------------ helpers
    def _check_id(self, page: int) -> None:
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise PageError(f"page id {page!r} out of range [0, {self.num_pages})")

    def _check_live(self, page: int) -> None:
        self._check_id(page)
        if page == NULL_PAGE:
            raise PageError("page 0 is the reserved null page")
        if self._ref[page] == 0:
            raise PageError(f"page {page} is not allocated")
