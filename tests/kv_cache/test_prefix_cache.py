"""The prefix cache's keys and LRU, and the reference-counted allocator around it."""

from __future__ import annotations

import pytest

from mlaserve.kv_cache import OutOfPagesError, PageAllocator, PrefixCache, page_keys


def test_keys_chain_over_full_pages_only_and_depend_on_the_prefix() -> None:
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, None)
    assert len(a) == 2  # the partial third page has no key
    assert page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, None) == a
    # Same second page, different first page: a different second key.
    b = page_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, None)
    assert b[0] != a[0] and b[1] != a[1]
    # Keys from a parent continue the chain.
    assert page_keys([5, 6, 7, 8], 4, a[0]) == a[1:]


def test_lookahead_keys_hold_the_token_after_each_page() -> None:
    """Speculation: a page's key also holds the first token after it, and a page without that
    token in the sequence has no key."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = page_keys(tokens, 4, None, lookahead=1)
    assert len(a) == 2
    assert len(page_keys(tokens[:8], 4, None, lookahead=1)) == 1  # token 8 unknown: page 1 waits
    assert a[0] != page_keys(tokens, 4, None)[0]
    other = page_keys([1, 2, 3, 4, 0, 6, 7, 8, 9], 4, None, lookahead=1)
    assert other[0] != a[0]  # same first page, another token after it: no match
    assert page_keys(tokens[4:], 4, a[0], lookahead=1) == a[1:]


def test_cache_salt_changes_every_key() -> None:
    tokens = list(range(12))
    plain, salted, other = (page_keys(tokens, 4, None, s) for s in (None, "t1", "t2"))
    assert len({plain[0], salted[0], other[0]}) == 3
    assert len({plain[2], salted[2], other[2]}) == 3  # through the chain


def _cached(alloc: PageAllocator, keys: list[bytes]) -> list[int]:
    pages = alloc.allocate(len(keys))
    for k, p in zip(keys, pages):
        assert alloc.cache.register(k, p)
    return pages


def test_released_cached_pages_are_evictable_and_found_again() -> None:
    cache = PrefixCache(4)
    alloc = PageAllocator(5, cache)  # 4 usable
    keys = page_keys(list(range(8)), 4, None)
    pages = _cached(alloc, keys)
    assert cache.match(keys) == pages
    alloc.free(pages)
    alloc.check()
    assert (cache.num_evictable_pages, alloc.num_free_pages, alloc.num_referenced_pages) == (
        2,
        4,
        0,
    )
    alloc.acquire(cache.match(keys))  # a hit takes them back out of the LRU
    alloc.check()
    assert (cache.num_evictable_pages, alloc.num_referenced_pages) == (0, 2)
    assert alloc.refcount(pages[0]) == 1
    alloc.acquire(pages)  # a second request shares them
    assert alloc.refcount(pages[0]) == 2
    alloc.free(pages)
    alloc.free(pages)
    alloc.check()
    assert cache.num_evictable_pages == 2


def test_allocate_evicts_least_recently_released_first_and_never_a_referenced_page() -> None:
    cache = PrefixCache(2)
    alloc = PageAllocator(5, cache)  # 4 usable
    old = _cached(alloc, page_keys([1, 1], 2, None))
    new = _cached(alloc, page_keys([2, 2], 2, None))
    held = _cached(alloc, page_keys([3, 3], 2, None))
    alloc.free(old)
    alloc.free(new)
    assert alloc.num_free_pages == 3  # 1 free + 2 evictable
    got = alloc.allocate(2)  # the free page, then the oldest evictable
    assert old[0] in got and new[0] not in got and held[0] not in got
    assert cache.match(page_keys([1, 1], 2, None)) == []  # its key went with it
    assert cache.match(page_keys([2, 2], 2, None)) == new
    alloc.check()
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)  # only `new` is free-able; `held` is referenced
    assert alloc.allocate(1) == new
    alloc.check()


def test_register_keeps_the_first_page_of_a_key() -> None:
    cache = PrefixCache(2)
    alloc = PageAllocator(4, cache)
    key = page_keys([5, 5], 2, None)[0]
    a, b = alloc.allocate(2)
    assert cache.register(key, a)
    assert not cache.register(key, b)  # computed twice at once: the second stays private
    alloc.free([a, b])
    alloc.check()
    assert cache.num_evictable_pages == 1 and alloc.num_free_pages == 3


def test_reset_frees_unreferenced_pages_and_forgets_every_key() -> None:
    cache = PrefixCache(2)
    alloc = PageAllocator(6, cache)
    keys = page_keys([1, 2, 3, 4, 5, 6], 2, None)
    pages = _cached(alloc, keys)
    alloc.free(pages[:2])  # pages[2] is still referenced
    assert alloc.reset_cache() == 2
    alloc.check()
    assert cache.match(keys) == [] and cache.num_cached_pages == 0
    alloc.free(pages[2:])  # released after the reset: uncached, straight to the free list
    alloc.check()
    assert alloc.num_free_pages == 5 and cache.num_evictable_pages == 0


def test_errors_name_the_page() -> None:
    alloc = PageAllocator(4, PrefixCache(2))
    with pytest.raises(ValueError, match="page 0"):
        alloc.acquire([0])
    with pytest.raises(ValueError, match="page 1 is not a cached or allocated"):
        alloc.acquire([1])  # free, not cached
    (p,) = alloc.allocate(1)
    alloc.free([p])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([p])


def test_pending_keys_have_one_owner_until_registered_or_dropped() -> None:
    cache = PrefixCache(2)
    keys = page_keys([1, 2, 3, 4], 2, None)
    cache.add_pending("a", keys)
    cache.add_pending("b", keys)  # already pending for a: b owns nothing
    assert [cache.pending_owner(k) for k in keys] == ["a", "a"]
    cache.register(keys[0], 1)
    assert cache.pending_owner(keys[0]) is None
    cache.drop_pending("a")
    assert cache.pending_owner(keys[1]) is None
