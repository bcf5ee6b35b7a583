"""Prefix caching at the scheduler, on the host alone: hits at admission, the cap that leaves a
token to compute, siblings that wait for a shared prompt, preemption, and a churn of 1,000
requests whose page accounting must add up after every step."""

from __future__ import annotations

import random

from mlaserve.engine.prefix_sharing import PrefixSharing
from mlaserve.engine.request import Request, RequestStatus
from mlaserve.engine.scheduler import Scheduler
from mlaserve.kv_cache import PageAllocator, PrefixCache
from mlaserve.sampling_params import SamplingParams


def make(rid: str, prompt: list[int], max_tokens: int = 3, **kw) -> Request:
    return Request(
        request_id=rid,
        prompt=None,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, **kw),
        seed=0,
        max_tokens=max_tokens,
    )


def scheduler(num_pages: int = 64, page_size: int = 4, **kw) -> Scheduler:
    alloc = PageAllocator(num_pages, PrefixCache(page_size))
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(alloc, page_size, prefix=PrefixSharing(alloc, page_size), **kw)


def run_step(sched: Scheduler, token: int = 7):
    """Schedule, pretend the forward ran and was waited on (commit), sample, finish."""
    out = sched.schedule()
    sched.after_step(out)
    sched.commit(out)
    for r in out.sampled_requests:
        r.output_token_ids.append(token)
        if r.num_output_tokens >= r.max_tokens:
            sched.finish(r)
    sched.allocator.check()
    return out


def drain(sched: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        run_step(sched)
    raise AssertionError(f"still unfinished after {max_steps} steps")


def first_chunk(out, rid: str) -> tuple[int, int]:
    s = next(s for s in out.scheduled if s.request.request_id == rid)
    return s.request.num_computed_tokens - s.num_new_tokens, s.num_new_tokens


def test_hit_starts_at_the_cached_pages_and_leaves_a_token_to_compute() -> None:
    sched = scheduler()
    base = list(range(100, 112))  # 3 full pages
    sched.add(make("a", base))
    drain(sched)
    for rid, n, hit in (("at", 12, 8), ("under", 11, 8), ("over", 13, 12), ("one", 4, 0)):
        r = make(rid, base[:n] if n <= 12 else [*base, 5])
        sched.add(r)
        out = run_step(sched)
        assert first_chunk(out, rid) == (hit, n - hit), rid
        assert r.metrics is None or r.metrics.num_cached_tokens == hit
        drain(sched)
    alloc = sched.allocator
    assert alloc.num_referenced_pages == 0 and alloc.num_free_pages == alloc.num_usable_pages


def test_speculation_registers_pages_only_with_their_next_token_and_a_whole_draft_cache() -> None:
    """lookahead 1: a page is registered once the token after it is on the host, a request whose
    draft cache went stale (a plain step: no MTP KV written) registers nothing more, and a hit
    makes the request's draft cache whole again."""
    alloc = PageAllocator(64, PrefixCache(4))
    sched = Scheduler(alloc, 4, prefix=PrefixSharing(alloc, 4, lookahead=1), max_num_seqs=8,
                      max_num_batched_tokens=64)  # fmt: skip
    base = list(range(100, 108))  # 2 full pages
    a = make("a", base, max_tokens=2)
    sched.add(a)
    run_step(sched)
    # Page 1's next token is a's first output, not on the host when its step was committed.
    assert len(a.page_keys) == 1 and alloc.cache.num_cached_pages == 1
    a.draft_cache_valid = False  # a plain step came next
    run_step(sched)
    assert a.is_finished and alloc.cache.num_cached_pages == 1
    # With a's first output (7) after page 1, b would hit both pages had a stayed whole.
    b = make("b", [*base, 7, 1])
    b.draft_cache_valid = False
    sched.add(b)
    out = run_step(sched)
    assert first_chunk(out, "b") == (4, 6) and b.draft_cache_valid
    drain(sched)
    assert alloc.num_referenced_pages == 0 and alloc.num_free_pages == alloc.num_usable_pages


def test_siblings_wait_for_the_first_to_compute_the_shared_prompt() -> None:
    sched = scheduler()
    prompt = list(range(200, 218))  # 4 full pages + 2
    reqs = [make(f"s{i}", prompt) for i in range(3)]
    for r in reqs:
        sched.add(r)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["s0"]  # the others wait
    out = run_step(sched)
    # s0 decodes; its 4 prompt pages are registered: the siblings take them, compute 2 tokens.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("s0", 1), ("s1", 2), ("s2", 2),
    ]  # fmt: skip
    shared = reqs[0].pages[:4]
    assert reqs[1].pages[:4] == shared == reqs[2].pages[:4]
    assert all(sched.allocator.refcount(p) == 3 for p in shared)
    drain(sched)
    sched.allocator.check()
    assert sched.allocator.num_referenced_pages == 0


def test_a_waiting_sibling_holds_its_place_but_not_the_queue() -> None:
    """Requests behind a sibling that waits for the shared prompt's pages are admitted meanwhile
    (they used to wait behind it); the sibling keeps its place: admitted first once the pages
    are registered, ahead of requests that came after it."""
    sched = scheduler(max_num_seqs=4)
    prompt = list(range(200, 218))  # 4 full pages + 2
    s0, s1 = make("s0", prompt), make("s1", prompt)
    other = make("other", list(range(500, 506)))
    for r in (s0, s1, other):
        sched.add(r)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["s0", "other"]  # s1 waits
    assert [r.request_id for r in sched.waiting] == ["s1"]
    late = make("late", list(range(600, 606)))
    sched.add(late)
    out = run_step(sched)
    # s0's prompt pages are registered: s1 takes them (2 tokens left), before `late`
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("s0", 1), ("other", 1), ("s1", 2), ("late", 6),
    ]  # fmt: skip
    drain(sched)
    assert sched.allocator.num_referenced_pages == 0
    assert sched.prefix is not None and sched.prefix._keys == {}  # no key memo outlives it


def test_requests_behind_a_waiting_sibling_keep_fcfs_among_themselves() -> None:
    """Past a waiting sibling, the first request that does not fit still stops admission: the
    smaller one behind it is not admitted ahead of it."""
    sched = scheduler(num_pages=9, max_num_seqs=4)  # 8 usable pages of 4 tokens
    prompt = list(range(200, 210))  # 2 full pages + 2: s0 takes 3 pages
    s0, s1 = make("s0", prompt), make("s1", prompt)
    big, small = make("big", list(range(700, 724))), make("small", [1, 2, 3])  # 6 pages, 1
    for r in (s0, s1, big, small):
        sched.add(r)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["s0"]
    assert [r.request_id for r in sched.waiting] == ["s1", "big", "small"]


def test_a_waiting_sibling_goes_ahead_when_the_writer_is_aborted() -> None:
    sched = scheduler(max_num_batched_tokens=8)
    prompt = list(range(300, 324))
    a, b = make("a", prompt), make("b", prompt)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)  # a's first chunk (8 tokens, 2 pages); b waits for page 3
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    sched.finish(a)
    out = run_step(sched)
    assert first_chunk(out, "b") == (8, 8)  # a's two committed pages, then computes on


def test_prompt_logprobs_requests_look_nothing_up_but_register() -> None:
    sched = scheduler()
    prompt = list(range(400, 409))
    scored = make("scored", prompt, prompt_logprobs=1)
    sched.add(scored)
    drain(sched)
    again = make("again", prompt, prompt_logprobs=1)
    sched.add(again)
    assert first_chunk(run_step(sched), "again") == (0, 9)
    drain(sched)
    plain = make("plain", prompt)
    sched.add(plain)
    assert first_chunk(run_step(sched), "plain") == (8, 1)


def test_a_preempted_request_finds_its_own_pages_again() -> None:
    sched = scheduler(num_pages=6, page_size=2)  # 5 usable pages of 2 tokens
    a, b = make("a", [1, 2, 3, 4, 5], max_tokens=3), make("b", [9, 8, 7], max_tokens=4)
    sched.add(a)
    sched.add(b)
    preempted, pages = None, []
    for _ in range(6):
        pages = list(b.pages)
        out = run_step(sched)
        if out.preempted:
            preempted = out.preempted[0]
            break
    assert preempted is b and b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0 and not b.pages
    for _ in range(10):  # until a finishes and b comes back, finding its own full pages
        out = run_step(sched)
        if any(s.request is b for s in out.scheduled):
            break
    start, _ = first_chunk(out, "b")
    # a took one page while b waited: LRU evicted the tail of b's chain, its head is found.
    assert start == 2 and b.pages[0] == pages[0]
    drain(sched)
    assert sched.allocator.num_referenced_pages == 0


def test_churn_of_1000_requests_with_shared_prefixes_keeps_exact_counts() -> None:
    rng = random.Random(0)
    sched = scheduler(num_pages=16, page_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    added = hits = 0
    kv = {p: [None] * 4 for p in range(16)}  # page -> the token whose KV each row holds
    for _ in range(100_000):
        if added == 1000 and not sched.has_unfinished():
            break
        while added < 1000 and sched.num_waiting < 4:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(6))]
            salt = rng.choice([None, None, "tenant"])
            r = make(f"r{added}", prompt or [1], max_tokens=rng.randrange(1, 12))
            r.cache_salt = salt
            sched.add(r)
            added += 1
        if sched.running and rng.random() < 0.03:  # an abort now and then
            victim = rng.choice(sched.running)
            if not victim.is_finished:
                sched.finish(victim)
        out = sched.schedule()
        # What the forward would write, then read: every scheduled request's KV positions
        # 0..end must hold its own tokens (a hit's shared pages included; a page another
        # request still references is never handed out and overwritten).
        for s in out.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            for pos in range(start, start + s.num_new_tokens):
                kv[r.pages[pos // 4]][pos % 4] = r.token_at(pos)
        for s in out.scheduled:
            r, end = s.request, s.request.num_computed_tokens + s.num_new_tokens
            assert [kv[r.pages[p // 4]][p % 4] for p in range(end)] == r.tokens(0, end)
            if r in out.admitted and r.num_computed_tokens > 0:
                hits += 1
        sched.after_step(out)
        sched.commit(out)
        for r in out.sampled_requests:
            r.output_token_ids.append(rng.randrange(1000))
            if r.num_output_tokens >= r.max_tokens:
                sched.finish(r)
        sched.allocator.check()
    alloc = sched.allocator
    alloc.check()
    assert alloc.num_referenced_pages == 0
    assert alloc.num_free_pages == alloc.num_usable_pages
    assert sched.num_preemptions > 0 and hits > 100
    cache = alloc.cache
    assert 0 < cache.num_hit_tokens < cache.num_queried_tokens
