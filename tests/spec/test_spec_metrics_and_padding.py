"""Speculative steps feed the metrics, and the verify step replays padded (the graph runner's
CPU path with `use_graphs=False`: same buffers, same padding, eager forwards)."""

from __future__ import annotations

import random

from mlaserve import LLM, SamplingParams
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.graph_runner import CudaGraphRunner
from mlaserve.service.metrics import Metrics
from mlaserve.spec import StepCosts

K = 2
CPU = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto", "page_size": 4}


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def test_engine_stats_feed_the_spec_metrics(checkpoint) -> None:
    llm = LLM(str(checkpoint("v3_mtp")), num_speculative_tokens=K, **CPU)
    metrics = Metrics()
    metrics.bind_model("m")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(3), params)
    stats = llm.engine.get_stats()
    metrics.on_stats(stats)
    metrics.on_stats(stats)  # running totals: a second report of the same totals adds nothing
    text = metrics.render().decode()

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    assert stats.spec_num_drafts > 0
    assert value("mlaserve:spec_decode_num_drafts_total") == stats.spec_num_drafts
    assert value("mlaserve:spec_decode_num_draft_tokens_total") == K * stats.spec_num_drafts
    accepted = sum(stats.spec_accepted_per_pos)
    assert value("mlaserve:spec_decode_num_accepted_tokens_total") == accepted
    assert value("mlaserve:spec_decode_accept_length_count") == stats.spec_num_drafts
    emitted = sum(n * c for n, c in stats.spec_accept_lengths.items())
    assert (
        value("mlaserve:spec_decode_accept_length_sum")
        == emitted
        == stats.spec_num_drafts + accepted
    )
    assert stats.spec_break_even == {}  # CPU: no measured costs
    assert "mlaserve:spec_decode_break_even{" not in text


def test_the_live_break_even_is_a_metric(checkpoint) -> None:
    llm = LLM(str(checkpoint("v3_mtp")), num_speculative_tokens=K, **CPU)
    policy = llm.engine.spec_decoder.policy
    policy.follow_served_steps = False
    policy.costs = StepCosts(plain_s={1: 1.0, 4: 2.0}, spec_s={1: 1.5, 4: 5.0})
    llm.generate(_prompts(2), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    stats = llm.engine.get_stats()
    assert stats.spec_break_even == {1: 1.5, 4: 2.5}
    metrics = Metrics()
    metrics.bind_model("m")
    metrics.on_stats(stats)
    text = metrics.render().decode()
    assert 'mlaserve:spec_decode_break_even{batch_size="1",model_name="m"} 1.5' in text
    assert 'mlaserve:spec_decode_break_even{batch_size="4",model_name="m"} 2.5' in text


def test_padded_verify_replays_are_lossless(checkpoint) -> None:
    path = str(checkpoint("v3_mtp"))
    prompts = _prompts(7)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [r.outputs[0].token_ids for r in LLM(path, **CPU).generate(prompts, params)]

    llm = LLM(path, num_speculative_tokens=K, **CPU)
    engine = llm.engine
    graphs = CudaGraphRunner(
        engine.runner,
        (2, 4, 8),
        use_graphs=False,
        shapes=((ForwardMode.DECODE, 1), (ForwardMode.VERIFY, K + 1)),
    )
    graphs.capture()
    engine.graphs = engine.spec_decoder.graphs = graphs
    # Requests finish at different steps (max_tokens differ), so the batch shrinks across
    # padded sizes 8 -> 4 -> 2.
    got = [
        r.outputs[0].token_ids
        for r in llm.generate(
            prompts,
            [SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True) for i in range(7)],
        )
    ]
    assert got == [e[: 4 + i] for i, e in enumerate(expected)]
    assert graphs.num_eager_steps["no_graphs"] > 0  # the padded path ran
    stats = engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
