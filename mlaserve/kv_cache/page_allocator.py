"""Host-side bookkeeping of which KV pages are free. Page 0 is reserved as the dummy page.

With prefix caching (`prefix_cache.PrefixCache`) pages are reference-counted: a page may sit in
several requests' page tables (a shared cached prefix). Every usable page is in exactly one of
three states (the invariant `check` verifies):

    free         on the free list (refcount 0, no key)
    referenced   refcount >= 1 (cached or not)
    evictable    refcount 0 and cached: in the prefix cache's LRU, handed out by `allocate`
                 (its key dropped) only when the free list is empty

`num_free_pages` counts free + evictable pages: both can be allocated (admission counts cached
pages as free-able). Without a prefix cache no page is ever evictable and every refcount is 0
or 1: the allocator behaves as a plain free list.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.kv_cache.prefix_cache import PrefixCache

__all__ = ["OutOfPagesError", "PageAllocator"]


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than are free."""


class PageAllocator:
    def __init__(self, num_pages: int, cache: PrefixCache | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self.cache = cache
        self._free: deque[int] = deque(range(1, num_pages))
        self._is_free = [False] + [True] * (num_pages - 1)
        self._refs = [0] * num_pages  # per page: the page tables holding it
        self._num_referenced = 0

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages `allocate` can hand out: free ones and evictable cached ones."""
        cache = self.cache
        return len(self._free) + (cache.num_evictable_pages if cache is not None else 0)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_referenced_pages(self) -> int:
        return self._num_referenced

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_pages

    def allocate(self, n: int) -> list[int]:
        """n pages, each referenced once: free pages first, then the least recently released
        evictable cached pages (their keys dropped)."""
        if n > self.num_free_pages:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free_pages} free")
        take = min(n, len(self._free))
        pages = [self._free.popleft() for _ in range(take)]
        for p in pages:
            self._is_free[p] = False
        if take < n:
            pages += self.cache.evict(n - take)  # type: ignore[union-attr]
        for p in pages:
            self._refs[p] = 1
        self._num_referenced += n
        return pages

    def acquire(self, pages: list[int]) -> None:
        """One more reference to each of `pages` (cached pages a lookup found)."""
        cache = self.cache
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._is_free[p]:
                raise ValueError(f"page {p} is not a cached or allocated page")
            if self._refs[p] == 0:
                if cache is None or not cache.is_evictable(p):
                    raise ValueError(f"page {p} has no reference and is not cached")
                cache.on_referenced(p)
                self._num_referenced += 1
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each of `pages`; a page left unreferenced becomes evictable
        when cached, else free."""
        cache = self.cache
        for p in pages:
            if p <= 0 or p >= self.num_pages or self._refs[p] <= 0:
                raise ValueError(f"page {p} is not an allocated page (double free?)")
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            self._num_referenced -= 1
            if cache is not None and cache.is_cached(p):
                cache.on_unreferenced(p)
            else:
                self._is_free[p] = True
                self._free.append(p)

    def reset_cache(self) -> int:
        """Drop every key of the prefix cache; its evictable pages join the free list. -> how
        many pages were freed."""
        if self.cache is None:
            return 0
        freed = self.cache.reset()
        for p in freed:
            self._is_free[p] = True
            self._free.append(p)
        return len(freed)

    def check(self) -> None:
        """The invariant free + evictable + referenced == usable, and no page in two states.
        Raises RuntimeError (an engine bug) when broken; tests call it."""
        cache = self.cache
        evictable = cache.num_evictable_pages if cache is not None else 0
        referenced = sum(1 for r in self._refs if r > 0)
        total = len(self._free) + evictable + referenced
        if total != self.num_usable_pages or referenced != self._num_referenced:
            raise RuntimeError(
                f"page accounting broken: {len(self._free)} free + {evictable} evictable + "
                f"{referenced} referenced (counted {self._num_referenced}) != "
                f"{self.num_usable_pages} usable"
            )
        for p in range(1, self.num_pages):
            states = (
                self._is_free[p]
                + (cache is not None and cache.is_evictable(p))
                + (self._refs[p] > 0)
            )
            if states != 1:
                raise RuntimeError(f"page {p} is in {states} states (refcount {self._refs[p]})")
