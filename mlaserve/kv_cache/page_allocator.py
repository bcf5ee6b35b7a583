"""Host-side bookkeeping of which KV pages are free. Page 0 is reserved as the dummy page."""

from __future__ import annotations

from collections import deque

__all__ = ["OutOfPagesError", "PageAllocator"]


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than are free."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._is_free[p]:
                raise ValueError(f"page {p} is not an allocated page (double free?)")
            self._is_free[p] = True
            self._free.append(p)
