"""Metric names follow vLLM's under `mlaserve:`, and the values follow the request timestamps."""

from __future__ import annotations

import re

import pytest

from mlaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mlaserve.service.metrics import (
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    Metrics,
)

REQUIRED = {
    "mlaserve:time_to_first_token_seconds": "histogram",
    "mlaserve:inter_token_latency_seconds": "histogram",
    "mlaserve:request_time_per_output_token_seconds": "histogram",
    "mlaserve:e2e_request_latency_seconds": "histogram",
    "mlaserve:request_queue_time_seconds": "histogram",
    "mlaserve:num_requests_running": "gauge",
    "mlaserve:num_requests_waiting": "gauge",
    "mlaserve:kv_cache_usage_perc": "gauge",
    "mlaserve:prompt_tokens_total": "counter",
    "mlaserve:generation_tokens_total": "counter",
    "mlaserve:request_success_total": "counter",
    "mlaserve:spec_decode_num_drafts_total": "counter",
    "mlaserve:spec_decode_num_draft_tokens_total": "counter",
    "mlaserve:spec_decode_num_accepted_tokens_total": "counter",
    "mlaserve:spec_decode_num_accepted_tokens_per_pos_total": "counter",
    "mlaserve:spec_decode_accept_length": "histogram",
    "mlaserve:num_preemptions_total": "counter",
    "mlaserve:request_prefill_time_seconds": "histogram",
    "mlaserve:request_decode_time_seconds": "histogram",
    "mlaserve:request_prompt_tokens": "histogram",
    "mlaserve:request_generation_tokens": "histogram",
    "mlaserve:iteration_tokens_total": "histogram",
}


def _samples(metrics: Metrics) -> dict[str, float]:
    """`name{label="v"}` -> value, without the model_name label every series carries."""
    out = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name, _, labels = key.partition("{")
            pairs = [
                p for p in re.findall(r'\w+="[^"]*"', labels) if not p.startswith("model_name=")
            ]
            out[name + ("{" + ",".join(pairs) + "}" if pairs else "")] = float(value)
    return out


def _output(rid: str, arrival: float, first: float, last: float, num_tokens: int, new: int,
            finished: str | None = None) -> RequestOutput:  # fmt: skip
    metrics = RequestMetrics(
        arrival_time=arrival, first_scheduled_time=arrival + 0.5, first_token_time=first,
        last_token_time=last, finished_time=last if finished else None, num_prompt_tokens=3,
    )  # fmt: skip
    completion = CompletionOutput(index=0, text="x" * num_tokens, token_ids=[7] * num_tokens,
                                  finish_reason=finished)  # fmt: skip
    return RequestOutput(rid, None, [1, 2, 3], [completion], finished is not None, metrics, new)


def test_names_types_and_labels() -> None:
    metrics = Metrics()
    metrics.bind_model("m")
    text = metrics.render().decode()
    for name, kind in REQUIRED.items():
        assert f"# TYPE {name} {kind}" in text, name
        if name.endswith("_per_pos_total"):
            continue  # its series appear with the first position seen
        assert re.search(
            rf"^{re.escape(name)}(_bucket|_count|_sum)?\{{[^}}]*model_name=\"m\"", text, re.M
        )
    for reason in ("stop", "length", "abort"):
        assert (
            f'mlaserve:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0'
            in text
        )
    assert "_created" not in text


def test_buckets_span_sub_millisecond_to_seconds() -> None:
    assert TOKEN_LATENCY_BUCKETS[0] <= 0.0005 and TOKEN_LATENCY_BUCKETS[-1] >= 5
    assert REQUEST_LATENCY_BUCKETS[0] <= 0.001 and REQUEST_LATENCY_BUCKETS[-1] >= 60
    assert list(TOKEN_LATENCY_BUCKETS) == sorted(set(TOKEN_LATENCY_BUCKETS))


def test_request_latencies_and_counters() -> None:
    metrics = Metrics()
    metrics.bind_model("m")
    metrics.on_added(["a"])
    # Times are multiples of 1/4 so the sums are exact in floating point.
    metrics.on_outputs([_output("a", 100.0, 101.0, 101.0, 1, 1)])  # TTFT 1 s, queue 0.5 s
    metrics.on_outputs([_output("a", 100.0, 101.0, 101.25, 2, 1)])  # one gap of 0.25 s
    metrics.on_outputs([_output("a", 100.0, 101.0, 102.0, 5, 3)])  # 3 tokens in 0.75 s: 3 x 0.25
    metrics.on_outputs([_output("a", 100.0, 101.0, 102.25, 6, 1, finished="length")])
    s = _samples(metrics)
    assert s["mlaserve:time_to_first_token_seconds_count"] == 1
    assert s["mlaserve:time_to_first_token_seconds_sum"] == pytest.approx(1.0)
    assert s["mlaserve:request_queue_time_seconds_sum"] == pytest.approx(0.5)
    assert s["mlaserve:inter_token_latency_seconds_count"] == 5
    assert s["mlaserve:inter_token_latency_seconds_sum"] == pytest.approx(1.25)
    # All five gaps were 0.25 s: every one sits in the (0.2, 0.3] bucket.
    assert s['mlaserve:inter_token_latency_seconds_bucket{le="0.2"}'] == 0
    assert s['mlaserve:inter_token_latency_seconds_bucket{le="0.3"}'] == 5
    assert s["mlaserve:request_time_per_output_token_seconds_sum"] == pytest.approx(0.25)
    assert s["mlaserve:e2e_request_latency_seconds_sum"] == pytest.approx(2.25)
    assert s["mlaserve:prompt_tokens_total"] == 3
    assert s["mlaserve:generation_tokens_total"] == 6
    assert s['mlaserve:request_success_total{finished_reason="length"}'] == 1
    # Phases: queue 0.5 s (arrival -> scheduled), prefill 0.5 s (-> first token), decode 1.25 s.
    assert s["mlaserve:request_prefill_time_seconds_sum"] == pytest.approx(0.5)
    assert s["mlaserve:request_decode_time_seconds_sum"] == pytest.approx(1.25)
    assert s["mlaserve:request_prompt_tokens_sum"] == 3
    assert s["mlaserve:request_generation_tokens_sum"] == 6
    assert s["mlaserve:request_generation_tokens_count"] == 1


def test_aborts_count_only_live_requests() -> None:
    metrics = Metrics()
    metrics.bind_model("m")
    metrics.on_added(["a", "b"])
    metrics.on_outputs([_output("b", 0.0, 1.0, 1.0, 1, 1, finished="stop")])
    metrics.on_aborted(["a", "b", "never-added"])
    s = _samples(metrics)
    assert s['mlaserve:request_success_total{finished_reason="abort"}'] == 1
    assert s['mlaserve:request_success_total{finished_reason="stop"}'] == 1


def test_spec_decode_family() -> None:
    metrics = Metrics()
    metrics.bind_model("m")
    metrics.on_spec_decode(4, 12, [3, 2, 1], accept_lengths=[4, 3, 1, 1])
    s = _samples(metrics)
    assert s["mlaserve:spec_decode_num_drafts_total"] == 4
    assert s["mlaserve:spec_decode_num_draft_tokens_total"] == 12
    assert s["mlaserve:spec_decode_num_accepted_tokens_total"] == 6
    assert s['mlaserve:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 2
    assert s["mlaserve:spec_decode_accept_length_count"] == 4
    assert s['mlaserve:spec_decode_accept_length_bucket{le="1.0"}'] == 2


def test_nothing_is_recorded_before_the_model_is_bound() -> None:
    metrics = Metrics()
    metrics.on_added(["a"])
    metrics.on_outputs([_output("a", 0.0, 1.0, 1.0, 1, 1)])
    assert "model_name" not in metrics.render().decode()


def test_iteration_tokens_and_preemptions_follow_the_engine_totals() -> None:
    """Stats arrive every few steps (the engine process sends them at most every 50 ms): every
    step since the previous stats is observed once, from the engine's recent step history."""
    from mlaserve.llm_engine import EngineStats

    metrics = Metrics()
    metrics.bind_model("m")

    def stats(steps: int, recent: tuple[int, ...], preemptions: int) -> EngineStats:
        return EngineStats(
            num_running=1, num_waiting=0, num_free_pages=9, num_total_pages=10,
            num_preemptions=preemptions, num_steps=steps, recent_step_num_tokens=recent,
        )  # fmt: skip

    metrics.on_stats(stats(3, (16, 16, 16), preemptions=0))  # after warm-up: a baseline only
    metrics.on_stats(stats(4, (16, 16, 16, 40), preemptions=1))  # a prefill step
    metrics.on_stats(stats(4, (16, 16, 16, 40), preemptions=1))  # no new step: nothing observed
    metrics.on_stats(stats(7, (16, 16, 40, 2, 2, 1), preemptions=3))  # three steps at once
    s = _samples(metrics)
    assert s["mlaserve:iteration_tokens_total_count"] == 4
    assert s["mlaserve:iteration_tokens_total_sum"] == 45
    assert s['mlaserve:iteration_tokens_total_bucket{le="2.0"}'] == 3
    assert s["mlaserve:num_preemptions_total"] == 3
