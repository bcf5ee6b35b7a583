"""Paged latent KV cache for MLA. The byte layout is documented in `kv_pool.py`; prefix caching
(pages found again by their tokens) in `prefix_cache.py`."""

from mlaserve.kv_cache.kv_pool import MLAKVPool
from mlaserve.kv_cache.page_allocator import OutOfPagesError, PageAllocator
from mlaserve.kv_cache.prefix_cache import PageKey, PrefixCache, page_keys

__all__ = ["MLAKVPool", "OutOfPagesError", "PageAllocator", "PageKey", "PrefixCache", "page_keys"]
