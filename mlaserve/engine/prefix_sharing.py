"""The scheduler's side of prefix caching: lookup at admission, registration of committed pages.

`kv_cache/prefix_cache.py` holds the keys and says why a hash chain; this file applies it to
requests:

  * `lookup` at admission (a request with no pages: new, or preempted and coming back): the
    keys of its full pages, the longest cached prefix of them, capped so that at least one of
    its tokens is computed (there must be logits to sample from): at most
    (num_tokens - 1) // page_size pages. A request with `prompt_logprobs` looks nothing up (it
    needs the logits of every prompt token) but still registers what it computes. If the next
    page after the hit is being computed by another running request (a pending key), the
    request waits (None): n > 1 siblings and concurrent shared prefixes prefill once.
  * `attach` gives the request the hit pages (one more reference each) and starts it at
    num_computed_tokens = hit tokens, the state a later prefill chunk starts from; `detach`
    undoes it when the rest does not fit.
  * `commit` registers the full pages of the tokens a resolved step computed (called by the
    engine once the host has waited on that step, never for one in flight; only tokens whose ids
    are on the host).
  * `release` when the request's pages go (finish, abort, preemption): its pending keys are
    dropped; the pages themselves return through `PageAllocator.free` (cached ones become
    evictable and a preempted request finds them again when readmitted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlaserve.config import EngineConfig
from mlaserve.engine.request import Request
from mlaserve.kv_cache import PageAllocator, PageKey, PrefixCache, page_keys

__all__ = ["Hit", "PrefixSharing"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Hit:
    pages: list[int]  # the cached pages of the request's prefix, in order
    keys: list[PageKey]  # keys of every full page of its tokens (the hit's first)


class PrefixSharing:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        if allocator.cache is None:
            raise ValueError("PrefixSharing: the allocator has no prefix cache")
        if allocator.cache.page_size != page_size:
            raise ValueError(
                f"page_size: the prefix cache's {allocator.cache.page_size} != {page_size}"
            )
        self.allocator = allocator
        self.cache: PrefixCache = allocator.cache
        self.page_size = page_size

    @classmethod
    def build(
        cls, config: EngineConfig, num_pages: int
    ) -> tuple[PageAllocator, PrefixSharing | None]:
        """The engine's allocator, and its prefix sharing when `enable_prefix_caching` is on.

        Bypassed (None, with a warning) under speculative decoding: the MTP layer's KV lives in
        the same pages (layer id num_hidden_layers of the pool), but its KV at a page's last
        position was computed from the token after the page, which the page's key does not
        hold, and pages written by plain (draft-free) steps hold no MTP KV at all. Outputs
        would stay exact (verification is lossless) while acceptance silently dropped."""
        if not config.enable_prefix_caching:
            return PageAllocator(num_pages), None
        if config.speculative is not None:
            logger.warning(
                "enable_prefix_caching: bypassed with speculative decoding (the MTP layer's KV "
                "of a cached page is not keyed by what it was computed from)"
            )
            return PageAllocator(num_pages), None
        allocator = PageAllocator(num_pages, PrefixCache(config.page_size))
        return allocator, cls(allocator, config.page_size)

    def lookup(self, request: Request) -> Hit | None:
        """The request's cached prefix (maybe empty), or None when it should wait for a page
        another running request is computing."""
        ps = self.page_size
        keys = page_keys(request.tokens(0, request.num_tokens), ps, None, request.cache_salt)
        if request.params.prompt_logprobs is not None:
            return Hit([], keys)
        cap = (request.num_tokens - 1) // ps
        pages = self.cache.match(keys[:cap])
        if len(pages) < cap:
            owner = self.cache.pending_owner(keys[len(pages)])
            if owner is not None and owner != request.request_id:
                return None
        return Hit(pages, keys)

    def attach(self, request: Request, hit: Hit) -> None:
        if request.pages or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id}: attach to a request holding pages")
        self.allocator.acquire(hit.pages)
        request.pages = list(hit.pages)
        request.page_keys = hit.keys[: len(hit.pages)]
        request.num_computed_tokens = len(hit.pages) * self.page_size

    def detach(self, request: Request) -> None:
        """Undo `attach` (the rest of the request did not fit)."""
        self.allocator.free(request.pages)
        request.pages = []
        request.page_keys = []
        request.num_computed_tokens = 0

    def admitted(self, request: Request, hit: Hit) -> None:
        """The request was admitted with `hit`: count the query, and mark the pages it will
        compute as pending (others wait for them instead of computing them too)."""
        num_hit = len(hit.pages) * self.page_size
        if request.params.prompt_logprobs is None:
            self.cache.record_query(request.num_tokens, num_hit)
        m = request.metrics
        if m is not None and m.first_scheduled_time is None:  # its first admission
            m.num_cached_tokens = num_hit
        self.cache.add_pending(request.request_id, hit.keys[len(hit.pages) :])

    def commit(self, request: Request, num_tokens: int) -> None:
        """Register the full pages among the request's first `num_tokens` tokens (computed by
        steps the host has waited on, their ids on the host) not registered yet."""
        ps = self.page_size
        full = min(num_tokens // ps, len(request.pages))
        done = len(request.page_keys)
        if full <= done:
            return
        parent = request.page_keys[-1] if done else None
        keys = page_keys(request.tokens(done * ps, full * ps), ps, parent, request.cache_salt)
        for i, key in enumerate(keys, done):
            self.cache.register(key, request.pages[i])
        request.page_keys.extend(keys)

    def release(self, request: Request) -> None:
        self.cache.drop_pending(request.request_id)
        request.page_keys = []
