"""The host side of a paged cache: which pool pages are free (`PageAllocator`)."""

from __future__ import annotations

__all__ = ["PageAllocator"]


class PageAllocator:
    """A free list of the pages 0..num_pages-1 of a page pool (`tfx.ops.paged`).

    Pages are handed out lowest first and a released page is the next one handed out, so a
    finished sequence's pages (still hot in cache memory) are reused first.
    """

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` free pages (taken off the free list)."""
        if count > len(self._free):
            raise ValueError(f"cannot allocate {count} pages: {len(self._free)} of "
                             f"{self.num_pages} are free")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def release(self, pages: list[int]) -> None:
        """Put `pages` back on the free list (each must be allocated, once)."""
        for page in pages:
            if not 0 <= page < self.num_pages or self._is_free[page]:
                raise ValueError(f"page {page} is not an allocated page of this pool")
            self._is_free[page] = True
        self._free.extend(reversed(pages))
