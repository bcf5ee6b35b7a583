"""Prompt logprobs from the prefill forward equal transformers' log-softmax of the prompt.

Oracle: transformers' own DeepseekV3ForCausalLM in fp32 on CPU, one full forward over the prompt;
log_softmax(logits[p])[prompt[p + 1]] is the logprob of prompt token p + 1. Tolerance 1e-4
(fp32 end to end; the two implementations differ only in summation order).
"""

from __future__ import annotations

import random

import pytest
import torch

from mlaserve import LLM, SamplingParams
from tests.checkpoints import make_reference_model

TOL = 1e-4
PROMPT_LENS = [1, 2, 9, 23, 40]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("v3_moe")


@pytest.fixture(scope="module")
def reference(path):
    return make_reference_model(path)


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    rng = random.Random(7)
    vocab = reference.config.vocab_size
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] log-softmax rows; row p scores token p + 1."""
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def make_llm(path, **kw) -> LLM:
    kw.setdefault("page_size", 4)
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", **kw)


def check(outputs, prompts, reference, k: int) -> None:
    for out, prompt in zip(outputs, prompts, strict=True):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt)
        assert entries[0] is None  # no context for the first token
        expected = hf_prompt_logprobs(reference, prompt)
        for j in range(1, len(prompt)):
            row, token = expected[j - 1], prompt[j]
            entry = entries[j]
            assert abs(entry[token].logprob - float(row[token])) < TOL, (len(prompt), j)
            assert entry[token].rank == int((row >= row[token]).sum())
            top = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
            assert len(top) == k
            best = row.topk(k)
            for lp, value in zip(top, best.values.tolist()):
                assert abs(lp.logprob - value) < TOL


@pytest.mark.parametrize("budget", [2048, 8])  # whole prompts; chunked prefill (8-token chunks)
def test_prompt_logprobs_match_transformers(path, reference, prompts, budget) -> None:
    llm = make_llm(path, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    check(outputs, prompts, reference, k=3)


def test_only_requests_that_ask_get_them(path, reference, prompts) -> None:
    llm = make_llm(path)
    asking = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    params = [asking if i % 2 else plain for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for i, out in enumerate(outputs):
        if i % 2:
            check([out], [prompts[i]], reference, k=0)
        else:
            assert out.prompt_logprobs is None
    # Same tokens as a run where nobody asked: the extra logits rows leave sampling alone.
    again = llm.generate(prompts, plain)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]


def test_preemption_does_not_score_the_prompt_twice(path, reference, prompts) -> None:
    # 6 usable pages of 4 tokens: the long prompts cannot all stay resident.
    llm = make_llm(path, num_pages=14, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts[2:], params)
    assert llm.engine.scheduler.num_preemptions > 0
    check(outputs, prompts[2:], reference, k=1)
