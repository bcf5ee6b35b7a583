"""Engine-side hardening seen through a real `LLMEngine` on CPU: NaN/inf logits become a
per-request error (never a token), DELTA outputs are O(new tokens) and add up to the cumulative
output, and aborts do not scan the queues."""

from __future__ import annotations

import time

import pytest
import torch

from mlaserve.llm_engine import LLMEngine
from mlaserve.sampling_params import SamplingParams

POISON = 7  # a token id whose embedding the NaN test overwrites


def _run(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_logits_fail_only_their_request(small_engine: LLMEngine, bad: float) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, min_tokens=3)
    small_engine.add_request("ref", [1, 2, 3, 4], greedy)
    reference = _run(small_engine)["ref"][-1].outputs[0].token_ids
    weight = small_engine.runner.model.model.embed_tokens.weight
    saved = weight[POISON].clone()
    try:
        with torch.no_grad():
            weight[POISON] = bad  # a numerical fault in one request's activations only
        small_engine.add_request("clean", [1, 2, 3, 4], greedy)
        small_engine.add_request("poisoned", [1, POISON, 3, 4], greedy)
        outs = _run(small_engine)
    finally:
        with torch.no_grad():
            weight[POISON] = saved
    (failed,) = outs["poisoned"]  # one output: the error, no token
    assert failed.finished and failed.error is not None and "NaN or infinite" in failed.error
    assert failed.outputs[0].finish_reason == "error"
    assert failed.outputs[0].token_ids == [] and failed.num_new_tokens == 0
    clean = outs["clean"][-1].outputs[0]
    assert clean.finish_reason == "length" and clean.token_ids == reference
    assert small_engine.allocator.num_free_pages == small_engine.allocator.num_usable_pages


def test_delta_outputs_add_up_to_the_cumulative_output(small_engine: LLMEngine) -> None:
    from mlaserve.sampling_params import RequestOutputKind  # new in issue 13

    base = dict(max_tokens=24, temperature=0.8, seed=3, logprobs=2, stop=["e", "("])
    small_engine.add_request("cum", [1, 2, 3], SamplingParams(**base))
    small_engine.add_request(
        "delta", [1, 2, 3], SamplingParams(**base, output_kind=RequestOutputKind.DELTA)
    )
    small_engine.add_request(
        "final", [1, 2, 3], SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)
    )
    outs = _run(small_engine)
    whole = outs["cum"][-1].outputs[0]
    deltas = [o.outputs[0] for o in outs["delta"]]
    assert all(len(d.token_ids) == 1 for d in deltas)  # one token per step, never the history
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [e for d in deltas for e in d.logprobs] == whole.logprobs
    assert deltas[-1].finish_reason == whole.finish_reason
    (final,) = outs["final"]
    assert final.finished and final.outputs[0].text == whole.text
    assert final.outputs[0].token_ids == whole.token_ids


def test_aborts_are_constant_time(small_engine: LLMEngine) -> None:
    """Aborting n queued requests costs O(n), not O(n^2): 16x the requests take < 100x the
    time (list/deque removal: ~256x)."""
    params = SamplingParams(max_tokens=1)

    def abort_all(n: int) -> float:
        ids = [f"abort-{n}-{i}" for i in range(n)]
        for rid in ids:
            small_engine.add_request(rid, [1, 2], params)
        t0 = time.perf_counter()
        for rid in reversed(ids):  # the newest first: the worst case for list.remove
            small_engine.abort_request(rid)
        elapsed = time.perf_counter() - t0
        assert (
            small_engine.get_stats().num_waiting == 0 and not small_engine.has_unfinished_requests()
        )
        small_engine.step()  # drops the finished entries
        assert not small_engine.scheduler.waiting
        return elapsed

    abort_all(500)  # warm-up
    small = min(abort_all(1_000) for _ in range(3))
    large = min(abort_all(16_000) for _ in range(3))
    assert large < 100 * small, (small, large)
