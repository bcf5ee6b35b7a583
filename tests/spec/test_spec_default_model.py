"""The shipped default model has a trained MTP layer: speculation is lossless on it and its
drafts are really accepted (an accept length stuck at 1.0 would mean a bug, not bad drafting)."""

from __future__ import annotations

import pytest

from mlaserve import LLM, SamplingParams

PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "class Foo:"]


PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return [r.outputs[0].token_ids for r in LLM(device="cpu").generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("k", [1, 3])
def test_default_model_greedy_lossless_with_real_acceptance(expected, k: int) -> None:
    params = PARAMS
    llm = LLM(device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": k})
    got = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    assert got == expected
    stats = llm.engine.get_stats()
    mean = sum(n * c for n, c in stats.spec_accept_lengths.items()) / stats.spec_num_drafts
    # Measured on CPU fp32: 1.45 (k=1) and 1.79 (k=3) over a wider prompt set.
    assert mean > 1.25, stats.spec_accept_lengths
    assert stats.num_free_pages == stats.num_total_pages
