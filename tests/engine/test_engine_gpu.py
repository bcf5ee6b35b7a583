"""The engine on a CUDA GPU: exact greedy parity in fp32, the default bf16 + fp8-KV path, and
no device->host synchronisation inside a decode forward.

Run on the GPU host with `python -m pytest -m gpu`; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.kernels_adapter.flashmla import flashmla_available
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


@pytest.mark.parametrize("backend", ["reference", "flashmla"])
def test_decode_forward_never_syncs_with_host(checkpoint, backend: str) -> None:
    """A DECODE forward (the CUDA-graph shape) must not read device memory on the host."""
    if backend == "flashmla" and not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    llm = LLM(
        None if backend == "flashmla" else str(checkpoint("v3_moe")),  # flashmla: 512/64 dims
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype="fp8_e4m3",
        attention_backend=backend,
    )
    engine = llm.engine
    for i, p in enumerate(prompts_for(engine.model_config.vocab_size)[:4]):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    scheduled = engine.scheduler.schedule()
    assert all(s.num_new_tokens == 1 for s in scheduled.scheduled)
    runner = engine.runner
    batch = runner.make_batch(runner.build_host_batch(scheduled))
    assert batch.mode is ForwardMode.DECODE
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape[0] == 4


def test_flashmla_engine_agrees_with_reference() -> None:
    """The default model (DeepSeek's 512/64 dims) decodes through FlashMLA when `auto` finds
    it, and its greedy tokens follow the reference backend's (bf16 rounding inside the kernel
    may flip a near-tie late in a sequence, hence the agreement bound rather than equality)."""
    if not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    prompts = ["def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:", "for i in"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    runs = {}
    for backend in ("auto", "reference"):
        llm = LLM(device="cuda", dtype="bfloat16", kv_cache_dtype="bf16", attention_backend=backend)
        runs[llm.engine.runner.attn_backend.name] = token_ids(llm.generate(prompts, params))
    assert set(runs) == {"flashmla", "reference"}, "auto should pick flashmla on SM90"
    pairs = [(a, b) for fa, fr in zip(runs["flashmla"], runs["reference"]) for a, b in zip(fa, fr)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"flashmla vs reference greedy agreement: {agreement:.3f}")
    assert agreement >= 0.9
