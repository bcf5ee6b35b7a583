"""The whole /metrics exposition after a fixed script of engine events, compared byte for byte
with `metrics_exposition.txt`: names, types, labels, help strings, buckets and the order of the
families are what dashboards and alerts read, so a change to any of them must be deliberate
(rewrite the file from `render()` when it is)."""

from __future__ import annotations

from pathlib import Path

from mlaserve.llm_engine import EngineStats
from mlaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mlaserve.service.metrics import Metrics

EXPECTED = Path(__file__).with_name("metrics_exposition.txt")


def _output(rid: str, arrival: float, first: float, last: float, num_tokens: int, new: int,
            finished: str | None = None) -> RequestOutput:  # fmt: skip
    metrics = RequestMetrics(
        arrival_time=arrival, first_scheduled_time=arrival + 0.5, first_token_time=first,
        last_token_time=last, finished_time=last if finished else None, num_prompt_tokens=3,
    )  # fmt: skip
    completion = CompletionOutput(index=0, text="x" * num_tokens, token_ids=[7] * num_tokens,
                                  finish_reason=finished)  # fmt: skip
    return RequestOutput(rid, None, [1, 2, 3], [completion], finished is not None, metrics, new)


def _stats(steps: int, recent: tuple[int, ...], **totals) -> EngineStats:
    return EngineStats(num_running=2, num_waiting=1, num_free_pages=6, num_total_pages=8,
                       num_steps=steps, recent_step_num_tokens=recent, **totals)  # fmt: skip


def test_exposition_is_unchanged() -> None:
    """Every family gets at least one sample (times are multiples of 1/4: exact sums)."""
    m = Metrics()
    m.on_refused("not_ready")  # before the model is known: held, then counted at binding
    m.bind_model("m")
    m.on_refused("queue_full")
    m.on_refused("not_ready")
    m.on_added(["a", "b", "c"])
    m.on_outputs([_output("a", 100.0, 101.0, 101.0, 1, 1)], now=101.0)
    m.on_outputs(
        [_output("a", 100.0, 101.0, 101.25, 2, 1), _output("b", 100.0, 100.5, 100.5, 1, 1)],
        now=101.25,
    )
    m.on_outputs([_output("a", 100.0, 101.0, 102.0, 5, 3)], now=102.0)
    m.on_outputs([_output("a", 100.0, 101.0, 102.25, 6, 1, finished="length")], now=102.25)
    m.on_outputs([_output("b", 100.0, 100.5, 103.0, 3, 2, finished="stop")], now=103.0)
    m.on_aborted(["c", "never-added"])
    # after warm-up: a baseline only, and the start-up phases
    m.on_stats(_stats(3, (16, 16, 16), startup_seconds={"weight_read": 0.5, "other": 0.25}))
    totals = dict(
        num_graph_replays=4, num_piecewise_replays=1, num_eager_steps={"extend": 2, "graphs_off": 1},
        num_compiles_while_serving=1, num_preemptions=2, spec_num_drafts=5,
        spec_num_draft_tokens=10, spec_accepted_per_pos=[4, 2],
        spec_accept_lengths={1: 1, 2: 2, 3: 2}, spec_decisions={"on:pays": 3, "off:cap": 1},
        spec_accept_length_estimate=2.25, spec_break_even={1: 1.5, 4: 2.5},
        prefix_cache_queries=48, prefix_cache_hits=32,
    )  # fmt: skip
    m.on_stats(_stats(6, (16, 16, 16, 40, 2, 2), **totals))
    m.on_spec_decode(2, 4, [1, 1], [2, 3])
    assert m.render().decode() == EXPECTED.read_text()
