"""The engine on a CUDA GPU: exact greedy parity in fp32, the default bf16 + fp8-KV path, and
no device->host synchronisation inside a decode forward.

Run on the GPU host with `python -m pytest -m gpu`; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from tests.checkpoints import VARIANTS, make_reference_model
from tests.engine.test_engine_parity import GREEDY, NEW_TOKENS, hf_greedy, prompts_for, token_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cuda_fp32_greedy_matches_transformers(checkpoint, variant: str) -> None:
    path = checkpoint(variant)
    reference = make_reference_model(path)
    prompts = prompts_for(reference.config.vocab_size)
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_dtype="auto", page_size=64)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
def test_cuda_bf16_default_path_runs_and_frees_pages(checkpoint, kv_cache_dtype: str) -> None:
    path = checkpoint("v3_moe")
    llm = LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    prompts = prompts_for(llm.engine.model_config.vocab_size)
    results = llm.generate(prompts, GREEDY)
    assert all(len(t) == NEW_TOKENS for t in token_ids(results))
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages


def test_decode_forward_never_syncs_with_host(checkpoint) -> None:
    """A DECODE forward (the CUDA-graph shape) must not read device memory on the host."""
    llm = LLM(
        str(checkpoint("v3_moe")),
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype="fp8_e4m3",
    )
    engine = llm.engine
    for i, p in enumerate(prompts_for(engine.model_config.vocab_size)[:4]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    scheduled = engine.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in scheduled.scheduled)
    runner = engine.runner
    batch = runner.make_batch(runner.build_host_batch(scheduled.scheduled))
    assert batch.is_decode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape[0] == 4
