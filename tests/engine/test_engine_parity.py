"""The whole engine against transformers, token for token, and invariant to how it batches.

Oracle: greedy decoding with transformers' own DeepseekV2/V3ForCausalLM in fp32, re-running the
full sequence each step (no cache), so nothing about paging or batching can leak into it.
"""

from __future__ import annotations

import pytest

from mlaserve import LLM, SamplingParams
from tests.checkpoints import VARIANTS, make_reference_model
from tests.engine.greedy_oracle import GREEDY, NEW_TOKENS, hf_greedy, prompts_for, token_ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_matches_transformers(checkpoint, variant: str) -> None:
    path = checkpoint(variant)
    reference = make_reference_model(path)
    prompts = prompts_for(reference.config.vocab_size)
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]

    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", page_size=4)
    got = token_ids(llm.generate(prompts, GREEDY))  # all 8 batched together
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) diverged"
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages


@pytest.fixture(scope="module")
def moe_checkpoint(checkpoint):
    return checkpoint("v3_moe")


def make_llm(path, **kw) -> LLM:
    kw.setdefault("page_size", 4)
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", **kw)


def test_batching_invariance(moe_checkpoint) -> None:
    llm = make_llm(moe_checkpoint)
    prompts = prompts_for(llm.engine.model_config.vocab_size, seed=1)[:6]
    together = token_ids(llm.generate(prompts, GREEDY))
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]
    assert alone == together

    # Chunked prefill: a 48-token prompt through a 16-token budget, mixed with decodes.
    chunked = make_llm(moe_checkpoint, max_num_batched_tokens=16)
    assert token_ids(chunked.generate(prompts, GREEDY)) == together

    # Staggered arrival: a new request every other step.
    engine = make_llm(moe_checkpoint).engine
    pending = list(enumerate(prompts))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [done[str(i)] for i in range(len(prompts))] == together


def test_preemption_recomputes_identically(moe_checkpoint) -> None:
    roomy = make_llm(moe_checkpoint)
    prompts = prompts_for(roomy.engine.model_config.vocab_size, seed=2)[:6]
    reference = token_ids(roomy.generate(prompts, GREEDY))
    # 6 requests of up to 80 tokens need ~60 pages of 4; give the pool 24.
    llm = make_llm(moe_checkpoint, num_pages=25)
    results = llm.generate(prompts, GREEDY)
    assert token_ids(results) == reference
    assert sum(r.metrics.num_preemptions for r in results) > 0, "the pool was meant to run out"
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages


def test_pages_all_free_after_finish_and_abort(moe_checkpoint) -> None:
    engine = make_llm(moe_checkpoint).engine
    prompts = prompts_for(engine.model_config.vocab_size, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, temperature=0.8, seed=i))
    for _ in range(4):
        engine.step()
    assert engine.get_stats().num_free_pages < engine.get_stats().num_total_pages
    for i in range(0, len(prompts), 2):
        engine.abort_request(str(i))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
    assert stats.num_running == stats.num_waiting == 0


def test_seeded_sampling_is_batch_invariant(moe_checkpoint) -> None:
    llm = make_llm(moe_checkpoint)
    prompts = prompts_for(llm.engine.model_config.vocab_size, seed=4)[:4]
    params = [
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(4)
    ]
    together = token_ids(llm.generate(prompts, params))
    alone = [token_ids(llm.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    assert together == alone
    other_seed = token_ids(llm.generate(prompts[:1], [params[0].replace(seed=999)]))[0]
    assert other_seed != together[0]
