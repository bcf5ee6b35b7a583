"""Prefix caching on a CUDA GPU (issue 43): cache on against cache off with the GPU's
defaults (CUDA graphs, piecewise prefill graphs, overlap scheduling, FP8 KV), shared prefixes at page boundaries (page 64), n > 1 and a pool
small enough to preempt. In fp32 (bf16-free KV) and in the deterministic mode the outputs must
be equal token for token; in the default bf16 + FP8-KV path a cached-prefix prefill runs other
kernels than a fresh one (the prefix path, not the one-graph fresh prefill), so a bf16 near-tie
may flip, and the test accepts a divergence only where cache-off's top-1 minus top-2 logprob is a
near-tie (`tests/engine/greedy_agreement.py`).

Run on the GPU host with `python -m pytest -m gpu tests/engine/test_prefix_cache_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.spec.spec_policy import FORCED_SPEC
from tests.engine.greedy_agreement import NEAR_TIE, divergence_margins

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    # 2 pages of 64; the longest prompt (228) + max_tokens stays in the checkpoint's 256 positions
    prefix = [rng.randrange(10, vocab) for _ in range(128)]
    out = [prefix, prefix[:-1]]
    for extra in (1, 63, 64, 65, 100):
        out.append(prefix + [rng.randrange(10, vocab) for _ in range(extra)])
    return out


def top_margins(outputs: list) -> list[list[float]]:
    """Each step's top-1 minus top-2 logprob of these completions (sampled with logprobs=2)."""
    return [
        [(lambda t: t[0] - t[1])(sorted((x.logprob for x in d.values()), reverse=True))
         for d in o.logprobs]
        for o in outputs
    ]  # fmt: skip


def one_by_one(llm: LLM, ps: list[list[int]], params=PARAMS) -> list[list[int]]:
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in ps]


@pytest.mark.parametrize(
    "kw",
    [
        {"dtype": "float32", "kv_cache_dtype": "auto"},
        {"deterministic_inference": True},
    ],
    ids=["fp32", "deterministic"],
)
def test_cuda_cache_on_equals_off(checkpoint, kw: dict) -> None:
    path = str(checkpoint("v3_moe"))
    off = LLM(path, device="cuda", enable_prefix_caching=False, **kw)
    on = LLM(path, device="cuda", enable_prefix_caching=True, **kw)
    ps = prompts(off.engine.model_config.vocab_size)
    expected = one_by_one(off, ps)
    assert one_by_one(on, ps) == expected
    assert on.engine.get_stats().prefix_cache_hits > 0
    n4 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=4)
    got = on.generate([ps[-1]], n4, use_tqdm=False)[0]
    want = off.generate([ps[-1]], n4, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    on.engine.allocator.check()
    assert on.engine.allocator.num_referenced_pages == 0


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_cuda_preemption_and_concurrency(checkpoint, deterministic: bool) -> None:
    """The prefix being written while its sharers arrive, in a pool that preempts. The
    deterministic mode must give the same tokens; the default path may flip a bf16 near-tie
    (its cached-prefix prefill runs other kernels), and only a near-tie: each continuation that
    parts from cache-off does so where cache-off's top-1 minus top-2 is under NEAR_TIE."""
    path = str(checkpoint("v3_moe"))
    kw = {"num_pages": 12, "max_num_seqs": 8, "deterministic_inference": deterministic}
    # 4 pages hold the longest request
    off = LLM(path, device="cuda", enable_prefix_caching=False, **kw)
    on = LLM(path, device="cuda", enable_prefix_caching=True, **kw)
    ps = prompts(off.engine.model_config.vocab_size)
    batch = [*ps, *ps]
    scored = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    want_out = [o.outputs[0] for o in off.generate(batch, scored, use_tqdm=False)]
    want = [list(o.token_ids) for o in want_out]
    got = [list(o.outputs[0].token_ids) for o in on.generate(batch, scored, use_tqdm=False)]
    assert on.engine.get_stats().num_preemptions > 0
    assert on.engine.get_stats().prefix_cache_hits > 0
    on.engine.allocator.check()
    assert on.engine.allocator.num_referenced_pages == 0
    if deterministic:
        assert got == want
        return
    margins = top_margins(want_out)
    ties = divergence_margins(got, want, margins)
    print(f"{len(batch) - len(ties)}/{len(batch)} identical; margins where they part: {ties}")
    assert all(t < NEAR_TIE for t in ties), ties


def test_cuda_speculation_caches_mtp_kv_exactly(checkpoint) -> None:
    """MTP k = 2 in the deterministic mode (batch-invariant kernels): greedy outputs and the
    accepted drafts are equal with the cache on and off, and hits are real."""
    path = str(checkpoint("v3_mtp"))
    kw = {"deterministic_inference": True, "num_speculative_tokens": 2}
    off = LLM(path, device="cuda", enable_prefix_caching=False, **kw)
    on = LLM(path, device="cuda", enable_prefix_caching=True, **kw)
    # Speculate every step: the cost policy may turn a step plain on a fast GPU, which leaves
    # that request's MTP rows unwritten and its pages unregistered (by design), and this test
    # is about what speculating steps cache.
    for llm in (off, on):
        llm.engine.spec_decoder.policy.forced = FORCED_SPEC
    ps = prompts(off.engine.model_config.vocab_size)

    def run(llm: LLM) -> tuple[list[list[int]], list[int]]:
        outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in ps]
        return [o.outputs[0].token_ids for o in outs], [o.metrics.num_accepted_tokens for o in outs]

    assert run(on) == run(off)
    assert on.engine.get_stats().prefix_cache_hits > 0
    on.engine.allocator.check()
    assert on.engine.allocator.num_referenced_pages == 0


def test_cuda_long_hits_take_the_absorbed_form_and_part_only_at_near_ties(monkeypatch) -> None:
    """The shipped model (4096 positions, the GPU defaults: FP8 KV, graphs) on real source: hits
    of 1-100 new tokens over a 2048-token cached prefix are attended by FlashMLA in the absorbed
    form (`kernels_adapter/absorbed_hit.py`, its query e4m3 as decode's), one of 200 in the MHA
    form; cache-off prefills each prompt whole. Each continuation may part from cache-off's only
    at a near-tie (module docstring)."""
    from mlaserve.kernels_adapter.flashmla import FlashMLABackend, flashmla_available
    from tests.engine.test_long_prompts_gpu import code_tokens

    if not flashmla_available():
        pytest.skip("needs an SM90 GPU and sgl-flash-mla")
    monkeypatch.delenv("MLASERVE_ABSORBED_HIT", raising=False)  # on by default
    decided: dict[tuple[int, ...], bool] = {}
    attends_absorbed = FlashMLABackend.attends_absorbed

    def spy(self, q_lens: tuple[int, ...], seq_lens: tuple[int, ...]) -> bool:
        decided[q_lens] = attends_absorbed(self, q_lens, seq_lens)
        return decided[q_lens]

    monkeypatch.setattr(FlashMLABackend, "attends_absorbed", spy)
    off = LLM(enable_prefix_caching=False)
    on = LLM(enable_prefix_caching=True)
    assert on.engine.runner.attn_backend.name == "flashmla" and on.engine.graphs.use_graphs
    extras = (1, 16, 64, 100, 200)
    text = code_tokens(on, 2048 + 200 * len(extras))
    # The prefix, then a suffix from its own stretch of the text: no prompt hits another's.
    prompts = [text[:2048] + text[2048 + 200 * i :][:e] for i, e in enumerate(extras)]
    scored = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    want_out = [off.generate([p], scored, use_tqdm=False)[0].outputs[0] for p in prompts]
    on.generate([text[:2048]], PARAMS, use_tqdm=False)  # its 32 pages: 31 cached (one computed)
    decided.clear()
    outs = [on.generate([p], scored, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [2048] * len(extras)
    assert [decided.get((e,)) for e in extras] == [True, True, True, True, False], decided
    want = [list(o.token_ids) for o in want_out]
    got = [list(o.outputs[0].token_ids) for o in outs]
    margins = top_margins(want_out)
    ties = divergence_margins(got, want, margins)
    print(f"{len(prompts) - len(ties)}/{len(prompts)} identical; margins where they part: {ties}")
    assert all(t < NEAR_TIE for t in ties), ties
    on.engine.allocator.check()
    assert on.engine.allocator.num_referenced_pages == 0
