"""Paged latent KV cache for MLA. The byte layout is documented in `kv_pool.py`."""

from mlaserve.kv_cache.kv_pool import MLAKVPool
from mlaserve.kv_cache.page_allocator import OutOfPagesError, PageAllocator

__all__ = ["MLAKVPool", "OutOfPagesError", "PageAllocator"]
