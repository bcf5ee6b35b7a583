"""Speculative decoding on a CUDA GPU: VERIFY, DRAFT_EXTEND and the draft chain replayed from CUDA
graphs, lossless against speculation off, padded and shrinking batches over NaN-poisoned pages,
graph-pool sharing between target and draft graphs, and one host wait per step.

Run on the GPU host with `python -m pytest -m gpu tests/spec`; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve import LLM, SamplingParams
from mlaserve.kernels_adapter.flashmla import flashmla_available
from mlaserve.spec.mtp_drafter import target_mode
from mlaserve.spec.spec_policy import FORCED_SPEC
from tests.graph_runner.harness import poison_kv
from tests.spec.spec_prompts import prompts_for, token_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SIZES = (1, 2, 4, 8)
FP32 = {
    "device": "cuda",
    "dtype": "float32",
    "kv_cache_dtype": "auto",
    "num_pages": 256,  # explicit: several engines live in one process
    "attention_backend": "reference",
    "cuda_graph_batch_sizes": SIZES,
    "max_num_seqs": 8,
}


def _run(llm: LLM, prompts, params=GREEDY) -> tuple[list[list[int]], int, int]:
    """-> token ids, engine steps, host waits."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    waits0, steps, out = engine.runner.num_host_waits, 0, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = list(o.outputs[0].token_ids)  # cumulative outputs
        steps += 1
    return [out[str(i)] for i in range(len(prompts))], steps, engine.runner.num_host_waits - waits0


def _mean_accept(llm: LLM) -> float:
    stats = llm.engine.get_stats()
    return sum(n * c for n, c in stats.spec_accept_lengths.items()) / max(stats.spec_num_drafts, 1)


@pytest.fixture(scope="module")
def v3_mtp(checkpoint) -> str:
    return str(checkpoint("v3_mtp"))


@pytest.fixture(scope="module")
def fp32_expected(v3_mtp) -> tuple[list[list[int]], list[list[int]]]:
    prompts = prompts_for(512)
    llm = LLM(v3_mtp, **FP32)
    return prompts, token_ids(llm.generate(prompts, GREEDY))


def test_fp32_graphs_lossless_and_one_wait_per_step(v3_mtp, fp32_expected) -> None:
    """Every forward of a speculative step graphed (target VERIFY/DECODE, DRAFT_EXTEND, the
    draft chain): greedy outputs equal speculation off, one host wait per engine step. On the
    GPU a VERIFY GEMM has M = bs*(k+1) rows where a decode has bs, so cuBLAS may pick another
    kernel and round differently: a near-tie argmax of this random model may flip (at most one
    sequence here; the CPU tests prove exact equality with the same code)."""
    prompts, expected = fp32_expected
    for k in (1, 3):
        llm = LLM(v3_mtp, num_speculative_tokens=k, **FP32)
        llm.engine.spec_decoder.policy.forced = FORCED_SPEC  # speculate in every step
        drafter = llm.engine.spec_decoder.drafter
        assert len(drafter.graphs) == 3 * len(SIZES)  # extend q=1, extend q=k+1, draft
        replays = drafter.num_replays
        got, steps, waits = _run(llm, prompts)
        same = sum(g == e for g, e in zip(got, expected, strict=True))
        print(f"fp32 reference, k={k}: {same}/{len(prompts)} identical")
        assert same >= len(prompts) - 1, (k, got, expected)
        assert waits == steps
        assert llm.engine.graphs.num_replays > 0 and drafter.num_replays > replays
        assert llm.engine.get_stats().spec_num_drafts > 0


@pytest.mark.parametrize("k", [2, 3])
def test_padded_shrinking_growing_batches_over_poisoned_pages(v3_mtp, fp32_expected, k) -> None:
    """64 steps; requests arrive while others run (batch 1 -> 8) and finish mid-window (8 -> 1),
    so verify and draft-extend replay at every captured size and at sizes between. Every KV page
    starts NaN: a read of a slot nobody wrote (target or MTP layer) would surface as NaN logits
    (an error) or a NaN draft state."""
    prompts, expected = fp32_expected
    llm = LLM(v3_mtp, num_speculative_tokens=k, **FP32)
    engine, drafter = llm.engine, llm.engine.spec_decoder.drafter
    engine.spec_decoder.policy.forced = FORCED_SPEC  # speculate in every step
    poison_kv(engine)
    params = [
        SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    pending = list(enumerate(prompts))
    out: dict[str, list[int]] = {}
    sizes_seen: set[int] = set()
    for step in range(64):
        if pending and step % 2 == 0:  # growing: a new request every other step
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params[i])
        running = engine.scheduler.num_running
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] = list(o.outputs[0].token_ids)  # cumulative outputs
        sizes_seen.add(running)
        n = max(running, 1)
        assert torch.isfinite(drafter.sel_hidden[:n]).all(), step
        if not pending and not engine.has_unfinished_requests():
            break
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = list(o.outputs[0].token_ids)  # cumulative outputs
    same = sum(out[str(i)] == e[: 20 + 3 * i] for i, e in enumerate(expected))
    print(f"padded/poisoned, k={k}: {same}/{len(expected)} identical, sizes {sorted(sizes_seen)}")
    assert same >= len(expected) - 1
    assert set(SIZES) <= sizes_seen and sizes_seen - set(SIZES), sizes_seen
    stats = engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
    assert drafter.num_replays > 0


def test_draft_graphs_never_overwrite_target_outputs(v3_mtp) -> None:
    """Target and draft graphs share one memory pool, the draft's captured after every target
    graph: replaying a size's DRAFT_EXTEND and DRAFT graphs leaves that size's target logits and
    hidden states (still read after the draft, for logprobs) bit for bit."""
    k = 3
    llm = LLM(v3_mtp, num_speculative_tokens=k, **FP32)
    graphs, drafter = llm.engine.graphs, llm.engine.spec_decoder.drafter
    for size in SIZES:
        for q in (1, k + 1):
            entry = graphs.graphs[(target_mode(q), q, size)]
            graphs.dummy_batch(target_mode(q), q, size)
            entry.graph.replay()
            logits, hidden = entry.logits.clone(), entry.hidden.clone()
            drafter.graphs[("extend", q, size)].graph.replay()
            drafter.graphs[("draft", 1, size)].graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(entry.logits, logits) and torch.equal(entry.hidden, hidden)


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8_e4m3"])
def test_default_model_flashmla_lossless_without_host_syncs(kv_cache_dtype: str) -> None:
    """The default model on FlashMLA, all graphed. bf16: a verify row (q_len k+1) and a decode
    row reduce in different orders, so a near-tie argmax may flip late in a sequence; most
    sequences must match token for token, and the MTP drafts must really be accepted. Decode
    steps run under sync debug mode "error": no host sync but the accounted read-back (an
    event on a pinned copy, which that mode does not see; the runner counts it)."""
    if not flashmla_available():
        pytest.skip("flashmla needs an SM90 GPU and sgl-flash-mla")
    texts = ["def fibonacci(n):", "The capital of France is", "import os\n", "class Foo:"] * 8
    sizes = (1, 2, 4, 8, 16, 32)
    kw = {
        "kv_cache_dtype": kv_cache_dtype,
        "max_num_seqs": 32,
        "num_pages": 1024,
        "cuda_graph_batch_sizes": sizes,
    }
    base = LLM(**kw)
    prompts = [[*base.tokenizer.encode(t), 100 + i] for i, t in enumerate(texts)]
    expected = token_ids(base.generate(prompts, GREEDY))
    del base
    torch.cuda.empty_cache()
    llm = LLM(num_speculative_tokens=3, **kw)
    engine = llm.engine
    policy = engine.spec_decoder.policy
    # the start-up cost measurement's throwaway steps teach the estimate nothing
    assert policy.accept_length_estimate == pytest.approx(policy.prior)
    costs = engine.spec_costs
    if costs is not None:
        even = {b: round(costs.break_even(b), 2) for b in costs.plain_s}
        print(f"{kv_cache_dtype}: the policy's measured break-even accept length {even}")
    engine.spec_decoder.policy.forced = FORCED_SPEC  # speculate in every step
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    engine.step()  # the prefill (eager EXTEND) and its drafts
    out: dict[str, list[int]] = {}
    waits, steps = engine.runner.num_host_waits, 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] = list(o.outputs[0].token_ids)  # cumulative outputs
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.runner.num_host_waits - waits == steps
    got = [out[str(i)] for i in range(len(prompts))]
    same = sum(g == e for g, e in zip(got, expected, strict=True))
    mean = _mean_accept(llm)
    print(f"{kv_cache_dtype}: {same}/{len(prompts)} identical, mean accept length {mean:.2f}")
    assert same >= len(prompts) - 4, (same, len(prompts))
    assert mean > 1.25
    stats = engine.get_stats()
    assert stats.num_graph_replays > 0 and stats.num_free_pages == stats.num_total_pages
    assert engine.spec_decoder.drafter.num_replays > 0


def test_replay_step_times_on_real_rows(v3_mtp) -> None:
    """bench/spec.py's device-time measurement (`replay_step_times`) at every captured size:
    it admits real requests (distinct random prompts), times the graphs on the rows their steps
    left in the buffers, and leaves the engine as it found it (no request, every page free)."""
    from mlaserve.spec.step_timer import replay_step_times

    llm = LLM(v3_mtp, num_speculative_tokens=3, **FP32)
    engine = llm.engine
    for size in SIZES:
        times = replay_step_times(engine, size, iters=3, prompt_len=24)
        assert set(times) == {"decode", "spec", "draft", "draft_extend"}
        assert all(t > 0 for t in times.values()), times
        assert not engine.requests and not engine.has_unfinished_requests()
        stats = engine.get_stats()
        assert stats.num_free_pages == stats.num_total_pages
    with pytest.raises(ValueError, match="batch size 3"):
        replay_step_times(engine, 3, iters=1)
