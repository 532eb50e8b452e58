"""Host-side KV page allocator: page ids with reference counts.

Page size equals block size, so one page holds the KV of one block. Page 0 is the trash page: it
is never handed out, padded rows of the device page table point at it, and padded writes land in
it, so the device code never needs a "no page" branch.

A page is free (refcount 0), or held by one or more owners (a running request, the radix index);
the refcount is the number of holders. Misuse (freeing a page nobody holds) raises `PageError`
before anything changes, so a bug never leaves the pool half-updated.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterable

import numpy as np

__all__ = ["OutOfPages", "PageError", "TRASH_PAGE", "PageAllocator", "pad_page_table"]

TRASH_PAGE = 0


class OutOfPages(RuntimeError):
    """An allocation cannot be satisfied now; the scheduler catches it (evict, wait or retract)."""


class PageError(RuntimeError):
    """Misuse of pages or locks (freeing a page not held, unlocking below zero, ...): a bug."""


class PageAllocator:
    """Reference-counted page ids 1..num_pages-1 (page 0 is `TRASH_PAGE`).

    Allocation hands out the lowest free ids first (a heap), so runs are reproducible.
    """

    def __init__(self, num_pages: int):
        if int(num_pages) != num_pages or num_pages < 2:
            raise ValueError(f"num_pages must be an integer >= 2 (page 0 is reserved), got {num_pages!r}")
        self.num_pages = int(num_pages)
        self._refcounts = [0] * self.num_pages  # index = page id; entry 0 (trash) stays 0
        self._free_heap = list(range(1, self.num_pages))  # sorted, hence already a heap

    # -- sizes -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Allocatable pages (all but the trash page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free_heap)

    def refcount(self, page: int) -> int:
        self._check_id(page)
        return self._refcounts[page]

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free_heap)

    # -- operations --------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """n pages with refcount 1; raises OutOfPages (state untouched) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_heap):
            raise OutOfPages(f"need {n} pages, {len(self._free_heap)} free of {self.capacity}")
        pages = [heapq.heappop(self._free_heap) for _ in range(n)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add a holder to each page (repeats count twice). Only held pages can gain holders:
        a free page has no contents anyone could share."""
        pages = list(pages)
        for page in pages:
            self._check_id(page)
            if self._refcounts[page] == 0:
                raise PageError(f"incref of page {page}, which is free")
        for page in pages:
            self._refcounts[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder from each page (repeats count twice); a page reaching 0 becomes free.

        Validates the whole call first: a page that is the trash page, out of range, or would go
        below zero raises PageError naming it, and nothing is applied.
        """
        pages = list(pages)
        if not pages:
            return
        if len(pages) == 1:
            page = pages[0]
            self._check_id(page)
            if self._refcounts[page] == 0:
                raise PageError(f"free of page {page}, which is not held (refcount 0): double free?")
        else:
            for page, times in Counter(pages).items():
                self._check_id(page)
                if self._refcounts[page] < times:
                    raise PageError(
                        f"free of page {page} x{times}, but its refcount is {self._refcounts[page]}: double free?"
                    )
        for page in pages:
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                heapq.heappush(self._free_heap, page)

    # -- helpers -----------------------------------------------------------------------------
    def _check_id(self, page: int) -> None:
        if page == TRASH_PAGE:
            raise PageError(f"page {TRASH_PAGE} is the trash page; it is never allocated, held or freed")
        if not (0 < page < self.num_pages):
            raise PageError(f"page {page} is out of range 1..{self.num_pages - 1}")

    def free_pages(self) -> list[int]:
        """The free page ids, sorted (for tests and debugging; O(n log n))."""
        return sorted(self._free_heap)

    def check_invariants(self) -> None:
        """Recompute the free list from the refcounts and compare (tests; O(num_pages))."""
        if self._refcounts[TRASH_PAGE] != 0:
            raise AssertionError("trash page has a refcount")
        free_by_count = [p for p in range(1, self.num_pages) if self._refcounts[p] == 0]
        if sorted(self._free_heap) != free_by_count:
            raise AssertionError("free list disagrees with the refcounts (a page freed twice or leaked)")
        if any(c < 0 for c in self._refcounts):
            raise AssertionError("negative refcount")

    def __repr__(self) -> str:
        return f"PageAllocator(capacity={self.capacity}, free={self.num_free})"


def pad_page_table(rows: list[list[int]], width: int) -> np.ndarray:
    """Rows of page ids as an int32 [len(rows), width] array, padded with TRASH_PAGE.

    Padding points at the trash page so padded reads are harmless and padded writes land there.
    """
    table = np.full((len(rows), width), TRASH_PAGE, dtype=np.int32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} pages, more than the table width {width}")
        if len(row):
            table[i, : len(row)] = row
    return table
