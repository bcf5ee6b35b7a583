"""The scheduler's side of prefix caching: lookup at admission, registration of committed pages.

`kv_cache/prefix_cache.py` holds the keys and says why a hash chain; this file applies it to
requests:

  * `lookup` at admission (a request with no pages: new, or preempted and coming back): the
    keys of its full pages, the longest cached prefix of them, capped so that at least one of
    its tokens is computed (there must be logits to sample from): at most
    (num_tokens - 1) // page_size pages. A request with `prompt_logprobs` looks nothing up (it
    needs the logits of every prompt token) but still registers what it computes. If the next
    page after the hit is being computed by another running request (a pending key), the
    request waits (None): n > 1 siblings and concurrent shared prefixes prefill once. A waiting
    request is looked up again every step (the scheduler admits those behind it meanwhile), so
    its page keys are kept from its first lookup until it is admitted or released.
  * `attach` gives the request the hit pages (one more reference each) and starts it at
    num_computed_tokens = hit tokens, the state a later prefill chunk starts from; `detach`
    undoes it when the rest does not fit.
  * `commit` registers the full pages of the tokens a resolved step computed (called by the
    engine once the host has waited on that step, never for one in flight; only tokens whose ids
    are on the host).
  * under speculative decoding page keys hold the token after the page (`lookahead` 1) and
    `commit` registers nothing while the request's draft cache is stale: a cached page carries
    the MTP layer's KV whole (`kv_cache/prefix_cache.py`), and `attach` marks the request's
    draft cache valid.
  * `release` when the request's pages go (finish, abort, preemption): its pending keys are
    dropped; the pages themselves return through `PageAllocator.free` (cached ones become
    evictable and a preempted request finds them again when readmitted).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlaserve.config import EngineConfig
from mlaserve.engine.request import Request
from mlaserve.kv_cache import PageAllocator, PageKey, PrefixCache, page_keys

__all__ = ["Hit", "PrefixSharing"]


@dataclass(frozen=True, slots=True)
class Hit:
    pages: list[int]  # the cached pages of the request's prefix, in order
    keys: list[PageKey]  # keys of every full page of its tokens (the hit's first)


class PrefixSharing:
    def __init__(self, allocator: PageAllocator, page_size: int, lookahead: int = 0) -> None:
        """`lookahead`: 1 under speculative decoding (page keys hold the token after the page:
        `kv_cache/prefix_cache.py`), else 0."""
        if allocator.cache is None:
            raise ValueError("PrefixSharing: the allocator has no prefix cache")
        if allocator.cache.page_size != page_size:
            raise ValueError(
                f"page_size: the prefix cache's {allocator.cache.page_size} != {page_size}"
            )
        self.allocator = allocator
        self.cache: PrefixCache = allocator.cache
        self.page_size = page_size
        self.lookahead = lookahead
        # request id -> (its num_tokens then, the keys of its full pages): a waiting request's
        # keys, hashed once however many steps it waits (an 8k-token prompt: ~1 ms a lookup)
        self._keys: dict[str, tuple[int, list[PageKey]]] = {}

    @classmethod
    def build(
        cls, config: EngineConfig, num_pages: int
    ) -> tuple[PageAllocator, PrefixSharing | None]:
        """The engine's allocator, and its prefix sharing when `enable_prefix_caching` is on
        (under speculative decoding with one token of lookahead in the page keys)."""
        if not config.enable_prefix_caching:
            return PageAllocator(num_pages), None
        allocator = PageAllocator(num_pages, PrefixCache(config.page_size))
        lookahead = 0 if config.speculative is None else 1
        return allocator, cls(allocator, config.page_size, lookahead)

    def lookup(self, request: Request) -> Hit | None:
        """The request's cached prefix (maybe empty), or None when it should wait for a page
        another running request is computing."""
        ps = self.page_size
        memo = self._keys.get(request.request_id)
        if memo is not None and memo[0] == request.num_tokens:
            keys = memo[1]
        else:
            keys = page_keys(
                request.tokens(0, request.num_tokens), ps, None, request.cache_salt, self.lookahead
            )
            self._keys[request.request_id] = (request.num_tokens, keys)
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
        # Cached pages were registered only with their MTP KV whole, and the rest is computed
        # from here: the draft cache is as valid as a fresh request's (also after preemption).
        request.draft_cache_valid = True

    def detach(self, request: Request) -> None:
        """Undo `attach` (the rest of the request did not fit)."""
        self.allocator.free(request.pages)
        request.pages = []
        request.page_keys = []
        request.num_computed_tokens = 0

    def admitted(self, request: Request, hit: Hit) -> None:
        """The request was admitted with `hit`: count the query, and mark the pages it will
        compute as pending (others wait for them instead of computing them too)."""
        self._keys.pop(request.request_id, None)
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
        ps, ahead = self.page_size, self.lookahead
        if ahead and not request.draft_cache_valid:  # a plain step left MTP rows unwritten
            return
        # Under speculation a page's key needs the token after it (on the host by now: the
        # step that computed the page's last position also emitted or read it).
        full = min(num_tokens // ps, len(request.pages), (request.num_tokens - ahead) // ps)
        done = len(request.page_keys)
        if full <= done:
            return
        parent = request.page_keys[-1] if done else None
        tokens = request.tokens(done * ps, full * ps + ahead)
        keys = page_keys(tokens, ps, parent, request.cache_salt, ahead)
        for i, key in enumerate(keys, done):
            self.cache.register(key, request.pages[i])
        request.page_keys.extend(keys)

    def release(self, request: Request) -> None:
        self._keys.pop(request.request_id, None)
        self.cache.drop_pending(request.request_id)
        request.page_keys = []
