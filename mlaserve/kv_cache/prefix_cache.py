"""Prefix caching: full KV pages of earlier requests, found again by their tokens.

Design: vLLM's hash chain, not SGLang's radix tree. Every FULL page of a request's tokens has a
key, `blake2b(parent key, the page's token ids[, the request's cache_salt for the first page])`;
the cache maps keys to page ids. Why a chain:

  * page ids are decided on rank 0 alone and broadcast to the tensor-parallel workers with each
    step (`engine/step_broadcast.py`), so the keys only ever live on rank 0's host: no tree has
    to be mirrored or kept consistent anywhere else;
  * a key is O(1) per page (it depends on its parent's key and its own page_size tokens), a
    lookup walks the chain from the first page and stops at the first miss, and nothing needs
    maintenance when a page is evicted (a child whose parent was evicted can never be reached
    again, since lookups start at page 0, and ages out of the LRU like any other page).

The cached prefix ends at a page boundary (no copy-on-write of a partial page): a partial last
page is recomputed.

Speculative decoding: the MTP layer's KV lives in the same pages (layer id num_hidden_layers of
the pool), so a cached page brings it along; no MTP KV is rebuilt, so a hit costs the draft
nothing. Its row at position p was computed from the target's hidden state at p AND the token
at p + 1, so under speculation a page's key also holds the first token after the page
(`lookahead`): a request whose next token differs does not match that page (its last MTP row
would be another request's), and a page is registered only once that token is known and while
its request's draft cache is valid (`Request.draft_cache_valid`: a plain step wrote no MTP KV).

Which pages are registered (`register`): full pages whose tokens are all committed, i.e. their
KV was written by a step the host has already waited on (`LLMEngine._resolve`), never one still
in flight; with a key already cached (two requests computed the same prefix at once) the newer
page is not registered and goes back to the free list when its request releases it.

Page states (the allocator's reference counts, `PageAllocator`), each page in exactly one:

    free            on the allocator's free list, holds nothing anyone will look up
    referenced      in the page table of >= 1 request (refcount >= 1), cached or not
    evictable       cached (has a key) and referenced by no request: in this LRU, oldest first

so `free + evictable + referenced == usable pages` at every moment (checked by
`PageAllocator.check`). A referenced page is never evicted; evictable pages are handed out by
`allocate` (oldest first, their keys dropped) only when the free list is empty.

Pending keys (`n > 1` and concurrent shared prefixes): when a request is admitted with a miss,
the keys of its not-yet-cached full prompt pages are recorded as pending, owned by it. A later
request whose next page is pending waits in the queue until the owner registers it (then it
hits) or releases it, so a shared prompt is prefilled once, not once per sibling
(`Scheduler.schedule`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PageKey", "PrefixCache", "page_keys"]

PageKey = bytes  # 16-byte blake2b digest


def _key(parent: PageKey | None, tokens: Sequence[int], salt: str | None) -> PageKey:
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    elif salt is not None:
        h.update(b"salt:" + salt.encode("utf-8") + b"\x00")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def page_keys(
    tokens: Sequence[int],
    page_size: int,
    parent: PageKey | None,
    salt: str | None = None,
    lookahead: int = 0,
) -> list[PageKey]:
    """Keys of the full pages of `tokens`, which start at a page boundary: the page after the
    one keyed `parent` (None: page 0, whose key mixes in `salt`). A partial last page has none.
    `lookahead` > 0: each key also holds the page's next `lookahead` tokens, and a page without
    them in `tokens` has no key (speculation: the MTP layer's KV at a page's last position was
    computed from the token after the page)."""
    keys: list[PageKey] = []
    for i in range((len(tokens) - lookahead) // page_size):
        parent = _key(parent, tokens[i * page_size : (i + 1) * page_size + lookahead], salt)
        keys.append(parent)
    return keys


class PrefixCache:
    """Keys of cached pages, their LRU of unreferenced ones, and the pending keys."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.page_size = page_size
        self._page_of: dict[PageKey, int] = {}  # cached key -> page
        self._key_of: dict[int, PageKey] = {}  # cached page -> key
        # Cached pages no request references, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._pending: dict[PageKey, str] = {}  # key -> the request computing it
        self._pending_by: dict[str, list[PageKey]] = {}
        # Totals since start-up (vLLM's prefix_cache_queries / _hits: tokens).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # ----- sizes -----
    @property
    def num_cached_pages(self) -> int:
        return len(self._page_of)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def is_cached(self, page: int) -> bool:
        return page in self._key_of

    # ----- lookup -----
    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """The cached pages of the longest cached prefix of `keys` (a chain from page 0)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def pending_owner(self, key: PageKey) -> str | None:
        return self._pending.get(key)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def reset_stats(self) -> None:
        self.num_queried_tokens = self.num_hit_tokens = 0

    # ----- registration -----
    def register(self, key: PageKey, page: int) -> bool:
        """Cache `page` (referenced by its writer) under `key`; False when the key is already
        cached (another page holds the same tokens) or the page already holds a key."""
        self._drop_pending(key)
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def add_pending(self, request_id: str, keys: Sequence[PageKey]) -> None:
        """`request_id` will compute the pages of `keys` (not cached, pending for nobody)."""
        mine = self._pending_by.setdefault(request_id, [])
        for key in keys:
            if key not in self._page_of and key not in self._pending:
                self._pending[key] = request_id
                mine.append(key)

    def drop_pending(self, request_id: str) -> None:
        """The request released its pages (finished, aborted, preempted): its pending keys will
        not be computed by it."""
        for key in self._pending_by.pop(request_id, ()):
            if self._pending.get(key) == request_id:
                del self._pending[key]

    def _drop_pending(self, key: PageKey) -> None:
        owner = self._pending.pop(key, None)
        if owner is not None:
            keys = self._pending_by.get(owner)
            if keys is not None:
                keys.remove(key)

    # ----- the allocator's side: referenced <-> evictable, eviction -----
    def on_unreferenced(self, page: int) -> None:
        """A cached page's last reference went: it becomes evictable (most recent last)."""
        self._evictable[page] = None

    def on_referenced(self, page: int) -> None:
        """An evictable page was taken by a lookup hit: no longer evictable."""
        self._evictable.pop(page, None)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def evict(self, n: int) -> list[int]:
        """Up to n evictable pages, least recently released first, their keys dropped."""
        out = []
        while len(out) < n and self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            out.append(page)
        return out

    def reset(self) -> list[int]:
        """Forget every key; -> the evictable pages, now plain free pages. Referenced cached
        pages stay with their requests, uncached (they return to the free list when
        released)."""
        freed = list(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._key_of.clear()
        self._pending.clear()
        self._pending_by.clear()
        return freed
