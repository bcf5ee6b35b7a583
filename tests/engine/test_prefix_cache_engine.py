"""Prefix caching through the whole engine on the CPU: greedy outputs with the cache equal those
without it (page boundaries, n > 1, preemption, chunked prefill, concurrent writers, overlap
scheduling, speculation with the MTP layer's KV in the cached pages), hits are real (fewer
tokens computed), and no page leaks."""

from __future__ import annotations

import random

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.spec.spec_policy import FORCED_PLAIN

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE = 4


@pytest.fixture(scope="module")
def path(checkpoint):
    return str(checkpoint("v3_moe"))


def make_llm(path: str, cache: bool, **kw) -> LLM:
    kw.setdefault("page_size", PAGE)
    return LLM(
        path, device="cpu", dtype="float32", kv_cache_dtype="auto",
        enable_prefix_caching=cache, max_model_len=128, **kw,
    )  # fmt: skip


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def assert_no_leak(llm: LLM) -> None:
    alloc = llm.engine.allocator
    alloc.check()
    assert alloc.num_referenced_pages == 0
    assert alloc.num_free_pages == alloc.num_usable_pages


def shared_prompts(seed: int = 0, prefix_len: int = 12) -> list[list[int]]:
    """One prefix of 3 pages, then suffixes so that prompts end at, just under and just over
    page boundaries (12, 11 via a shorter prefix, 13, 15, 16, 17)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 250) for _ in range(prefix_len)]
    out = [prefix, prefix[:-1]]
    for extra in (1, 3, 4, 5):
        out.append(prefix + [rng.randrange(1, 250) for _ in range(extra)])
    return out


def one_by_one(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [token_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_equal_at_page_boundaries_and_hits_are_real(path, overlap: bool) -> None:
    prompts = shared_prompts()
    off = make_llm(path, False, overlap_schedule=overlap)
    on = make_llm(path, True, overlap_schedule=overlap)
    # The warm-up request is not served traffic: nothing cached or counted from it.
    assert on.engine.allocator.cache.num_cached_pages == 0
    assert on.engine.get_stats().prefix_cache_queries == 0
    expected = one_by_one(off, prompts)
    assert one_by_one(on, prompts) == expected
    assert on.engine.num_scheduled_tokens < off.engine.num_scheduled_tokens
    # The same prompt again: cached_tokens reported, fewer tokens computed.
    before = on.engine.num_scheduled_tokens
    out = on.generate([prompts[3]], GREEDY, use_tqdm=False)[0]
    assert token_ids([out])[0] == expected[3]
    hit = (len(prompts[3]) - 1) // PAGE * PAGE
    assert out.num_cached_tokens == hit == 12
    # prefill: 16 - 12 prompt tokens, then 5 decodes (the 6th token is sampled, not computed)
    assert on.engine.num_scheduled_tokens - before == len(prompts[3]) - hit + 5
    stats = on.engine.get_stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    assert off.engine.get_stats().prefix_cache_queries == 0
    assert_no_leak(on)


def test_n_siblings_share_one_prefill(path) -> None:
    prompt = shared_prompts(seed=1)[5]  # 17 tokens: 4 full pages
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=4)
    off, on = make_llm(path, False), make_llm(path, True)
    start_off, start_on = off.engine.num_scheduled_tokens, on.engine.num_scheduled_tokens
    expected = token_ids(off.generate([prompt], params, use_tqdm=False))
    assert token_ids(on.generate([prompt], params, use_tqdm=False)) == expected
    # Off: 4 x 17 prompt tokens. On: 17 once, then 1 per sibling over the shared 16 (plus
    # 4 decodes per sibling either way).
    prefill_off = off.engine.num_scheduled_tokens - start_off - 4 * 4
    prefill_on = on.engine.num_scheduled_tokens - start_on - 4 * 4
    assert (prefill_off, prefill_on) == (4 * 17, 17 + 3 * 1)
    assert_no_leak(on)


def test_concurrent_writers_chunked_prefill_and_preemption(path) -> None:
    """All shared-prefix prompts at once (their prefix being written while they arrive), in
    8-token chunks, in a pool too small for all of them (preemption)."""
    prompts = shared_prompts(seed=2) + shared_prompts(seed=3, prefix_len=20)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_batched_tokens=8, num_pages=16, max_num_seqs=6)
    off, on = make_llm(path, False, **kw), make_llm(path, True, **kw)
    expected = token_ids(off.generate(prompts, params, use_tqdm=False))
    assert token_ids(on.generate(prompts, params, use_tqdm=False)) == expected
    assert on.engine.get_stats().num_preemptions > 0
    assert on.engine.get_stats().prefix_cache_hits > 0
    assert_no_leak(on)


def test_staggered_churn_equals_cache_off(path) -> None:
    """Requests arriving every other step, random shared prefixes, a small pool, some with
    prompt_logprobs (they bypass the lookup) and aborts."""
    rng = random.Random(4)
    prefixes = [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 25))] for _ in range(4)]
    jobs = []
    for i in range(40):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 250) for _ in range(rng.randrange(4))]
        logprobs = 1 if i % 7 == 0 else None
        jobs.append((prompt, SamplingParams(
            max_tokens=rng.randrange(1, 8), temperature=0.0, ignore_eos=True,
            prompt_logprobs=logprobs,
        )))  # fmt: skip

    def run(cache: bool) -> dict[str, list[int]]:
        engine = make_llm(path, cache, num_pages=20, max_num_seqs=5).engine
        pending, done, step = list(enumerate(jobs)), {}, 0
        while pending or engine.has_unfinished_requests():
            if pending and step % 2 == 0:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(str(i), prompt, params)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            step += 1
        engine.drain()
        alloc = engine.allocator
        alloc.check()
        assert alloc.num_referenced_pages == 0
        if cache:
            assert engine.get_stats().prefix_cache_hits > 0
        return done

    assert run(True) == run(False)


def test_cache_salt_isolates_and_reset_forgets(path) -> None:
    llm = make_llm(path, True)
    engine = llm.engine
    prompt = shared_prompts(seed=5)[5]

    def cached(rid: str, salt: str | None) -> int:
        engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out if out.finished else final
        return final.num_cached_tokens

    assert cached("a", "tenant-a") == 0
    assert cached("b", "tenant-b") == 0  # same prompt, another salt: no hit
    assert cached("c", None) == 0
    assert cached("d", "tenant-a") == 16
    assert engine.reset_prefix_cache() > 0
    assert engine.allocator.cache.num_cached_pages == 0
    assert cached("e", "tenant-a") == 0
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("f", prompt, GREEDY, cache_salt=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", [False, True])
def test_speculative_engine_caches_and_stays_exact(overlap: bool) -> None:
    """MTP k = 2 on the default model: greedy outputs with the cache equal those without it
    (speculation is lossless either way), hits are real, and the drafts are as good: the cached
    pages carry their MTP KV, so the accepted drafts match one for one."""
    head = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    prompts = [head + "    return fib", head + "    return fibonacci(n - 1) +", head]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = {"num_speculative_tokens": 2, "overlap_schedule": overlap, "page_size": 16}
    off = LLM(device="cpu", enable_prefix_caching=False, **kw)
    on = LLM(device="cpu", enable_prefix_caching=True, **kw)
    assert on.engine.scheduler.prefix is not None and on.engine.scheduler.prefix.lookahead == 1

    def run(llm: LLM) -> tuple[list[list[int]], list[int]]:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        return token_ids(outs), [o.metrics.num_accepted_tokens for o in outs]

    expected, accepted_off = run(off)
    got, accepted_on = run(on)
    assert got == expected
    assert accepted_on == accepted_off
    assert on.engine.num_scheduled_tokens < off.engine.num_scheduled_tokens
    assert on.engine.get_stats().prefix_cache_hits > 0
    assert_no_leak(on)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompts_register_when_speculation_does_not_pay(overlap: bool) -> None:
    """The cost policy keeps every step plain (speculation does not pay on this hardware): the
    prompt's own pages still register, because an EXTEND step runs the draft over its rows
    when the cache is on (without it a plain EXTEND leaves the MTP rows unwritten and nothing of
    the request can be cached), and the outputs equal cache-off's."""
    head = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    prompts = [head + "    return fib", head + "    return fibonacci(n - 1) +"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = {"num_speculative_tokens": 2, "overlap_schedule": overlap, "page_size": 16}
    runs = {}
    for cache in (False, True):
        llm = LLM(device="cpu", enable_prefix_caching=cache, **kw)
        llm.engine.spec_decoder.policy.forced = FORCED_PLAIN
        runs[cache] = token_ids([llm.generate([p], params, use_tqdm=False)[0] for p in prompts])
        if cache:
            assert llm.engine.get_stats().prefix_cache_hits > 0
            assert llm.engine.spec_decoder.stats.num_drafts == 0  # it never speculated
            assert_no_leak(llm)
    assert runs[True] == runs[False]


def _mtp_rows(engine, request_id: str) -> torch.Tensor:
    """The MTP layer's KV rows [num_computed, dim] of a running request, read from its pages."""
    request = next(r for r in engine.scheduler.running if r.request_id == request_id)
    pool = engine.runner.kv_pool
    rows = pool.kv_buffers[-1][request.pages]  # the MTP layer's: id num_hidden_layers, the last
    return rows.reshape(-1, pool.dim)[: request.num_computed_tokens].clone()


@pytest.mark.parametrize("same_next_token", [False, True])
def test_a_hit_brings_exact_mtp_kv(checkpoint, same_next_token: bool) -> None:
    """The MTP row at a page's last position was computed from the token after the page. A
    request that shares two pages with an earlier one but not the token after them hits one
    page; sharing that token too, it hits both. Either way the MTP KV it runs on equals that of
    a fresh prefill of its prompt (fp32, no overlap: same kernels up to the batch's shape)."""
    path = str(checkpoint("v3_mtp"))
    kw = {"num_speculative_tokens": 2, "overlap_schedule": False}
    on = make_llm(path, True, **kw)
    off = make_llm(path, False, **kw)
    rng = random.Random(3)
    first = [rng.randrange(3, 250) for _ in range(13)]
    second = [*first[:8], first[8] if same_next_token else first[8] % 240 + 5]
    second += [rng.randrange(3, 250) for _ in range(4)]
    on.generate([first], GREEDY, use_tqdm=False)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rows = {}
    for name, llm in (("on", on), ("off", off)):
        llm.engine.add_request("b", second, params)
        llm.engine.step()  # the prefill and the MTP's pass over it
        rows[name] = _mtp_rows(llm.engine, "b")
        cached = llm.engine.scheduler.running[0].metrics.num_cached_tokens
        if name == "on":
            assert cached == (8 if same_next_token else 4)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert rows["on"].shape == rows["off"].shape == (len(second), rows["on"].shape[1])
    torch.testing.assert_close(rows["on"], rows["off"], rtol=1e-5, atol=1e-5)
    assert_no_leak(on)


def test_pages_are_registered_only_once_their_step_is_waited_on(path) -> None:
    """Overlap scheduling: a launched step's pages are not findable until the host has waited
    on it (the next step resolves it)."""
    engine = make_llm(path, True, overlap_schedule=True).engine
    cache = engine.allocator.cache
    before = cache.num_cached_pages
    engine.add_request("a", list(range(50, 63)), GREEDY)  # 13 tokens: 3 full pages
    engine.step()  # the prefill is launched and stays in flight
    assert engine._inflight is not None
    assert cache.num_cached_pages == before
    engine.step()  # launches the first decode, then resolves the prefill
    assert cache.num_cached_pages == before + 3
    while engine.has_unfinished_requests():
        engine.step()
    engine.drain()
    engine.allocator.check()
    assert engine.allocator.num_referenced_pages == 0


def test_offline_cache_salt_and_structured_output(path) -> None:
    llm = make_llm(path, True)
    prompt = shared_prompts(seed=6)[5]
    outs = [
        llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, GREEDY, use_tqdm=False)[0]
        for salt in ("x", "y", "x")
    ]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 16]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    pytest.importorskip("xgrammar")
    from mlaserve.sampling_params import StructuredOutputsParams

    params = SamplingParams(
        max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    off = make_llm(path, False)
    expected = token_ids(off.generate([prompt, prompt], params, use_tqdm=False))
    assert token_ids(llm.generate([prompt, prompt], params, use_tqdm=False)) == expected
    assert_no_leak(llm)
