"""The engine's events, recorded into the Prometheus families of metric_families.py.

Everything here is fed on the event loop from the engine process's messages: each step's
outputs, the requests it added and aborted, and its `EngineStats` when they change (the
per-request bookkeeping is only touched there):

- latency histograms from the timestamps in `RequestOutput.metrics`: time to first token,
  inter-token latency (a step that delivers k tokens after an interval counts as k samples of
  interval / k, as SGLang does, so speculative decoding is not penalised), per-request mean time
  per output token, end-to-end latency and queue time;
- per-request phase times (vLLM's): queue (arrival -> first scheduled), prefill (first
  scheduled -> first token), decode (first token -> last token), and per-request prompt and
  generation token counts, observed when a request finishes;
- token, finished-request and preemption counters, and the tokens each engine step ran
  (`iteration_tokens_total`);
- gauges from `LLMEngine.get_stats()`;
- the speculative-decoding family, fed through `on_spec_decode` once the engine reports it;
- refused requests by reason, fed by the HTTP layer (`on_refused`, from refusal_counter.py).

Every series carries a `model_name` label, bound once the engine has loaded; nothing is
recorded before, except refusals (503 `not_ready` while loading), held and added at binding.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest

from mlaserve.service.metric_families import (
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    MetricFamilies,
)

if TYPE_CHECKING:
    from mlaserve.llm_engine import EngineStats
    from mlaserve.outputs import RequestOutput

__all__ = ["PREFIX", "REQUEST_LATENCY_BUCKETS", "TOKEN_LATENCY_BUCKETS", "Metrics"]


@dataclass
class _SpecSeen:
    """The engine's speculative totals at the last `on_stats` call."""

    num_drafts: int
    num_draft_tokens: int
    accepted_per_pos: list[int]
    accept_lengths: dict[int, int]


@dataclass(slots=True)
class _Tracked:
    """What one in-flight request has shown so far."""

    num_generation_tokens: int = 0
    last_token_time: float | None = None


class Metrics(MetricFamilies):
    """The families, fed on the event loop from the engine process's messages."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._model_name: str | None = None
        self._tracked: dict[str, _Tracked] = {}
        # The engine's running totals at the last `on_stats` call: counters advance by the rest.
        self._seen = {
            "replays": 0, "piecewise": 0, "compiles": 0, "preemptions": 0, "steps": -1,
            "pc_queries": 0, "pc_hits": 0,
        }  # fmt: skip
        self._seen_eager: dict[str, int] = {}
        self._seen_spec = _SpecSeen(0, 0, [], {})
        self._seen_decisions: dict[str, int] = {}
        # Refusals before the model is known (503 not_ready while loading): counted at binding.
        self._refused_before_bind: Counter[str] = Counter()

    # ----- lifecycle -----
    def bind_model(self, model_name: str) -> None:
        """Label every series with the served model (before this, nothing is recorded)."""
        self._model_name = model_name
        self.create_series(model_name)
        for reason, count in self._refused_before_bind.items():
            self.request_refused.labels(model_name, reason).inc(count)
        self._refused_before_bind.clear()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    # ----- fed by the HTTP layer -----
    def on_refused(self, reason: str) -> None:
        """One request refused with a 4xx or 503; `reason` is its error code."""
        if self._model_name is None:
            self._refused_before_bind[reason] += 1
        else:
            self.request_refused.labels(self._model_name, reason).inc()

    # ----- fed from the engine process's messages -----
    def on_added(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._tracked[request_id] = _Tracked()

    def on_aborted(self, request_ids: Iterable[str]) -> None:
        """Count requests that were still in flight when aborted (e.g. their client left)."""
        for request_id in request_ids:
            if self._tracked.pop(request_id, None) is not None and self._model_name is not None:
                self.request_success.labels(self._model_name, "abort").inc()

    def on_outputs(self, outputs: Iterable[RequestOutput], now: float | None = None) -> None:
        model = self._model_name
        if model is None:
            return
        now = time.time() if now is None else now
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            m = out.metrics
            num_new = out.num_new_tokens
            token_time = (m.last_token_time if m is not None else None) or now
            if num_new > 0:
                if tracked.num_generation_tokens == 0:
                    self.prompt_tokens.labels(model).inc(len(out.prompt_token_ids))
                    if m is not None:
                        first = m.first_token_time or token_time
                        self.time_to_first_token.labels(model).observe(first - m.arrival_time)
                        if m.first_scheduled_time is not None:
                            queued = m.first_scheduled_time - m.arrival_time
                            self.request_queue_time.labels(model).observe(max(queued, 0.0))
                elif tracked.last_token_time is not None:
                    per_token = max(token_time - tracked.last_token_time, 0.0) / num_new
                    itl = self.inter_token_latency.labels(model)
                    for _ in range(num_new):
                        itl.observe(per_token)
                self.generation_tokens.labels(model).inc(num_new)
                tracked.num_generation_tokens += num_new
                tracked.last_token_time = token_time
            if out.finished:
                self._on_finished(out, tracked, now)

    def _on_finished(self, out: RequestOutput, tracked: _Tracked, now: float) -> None:
        model = self._model_name
        assert model is not None
        del self._tracked[out.request_id]
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_success.labels(model, reason or "stop").inc()
        m = out.metrics
        if m is None:
            return
        finished = m.finished_time or now
        self.e2e_request_latency.labels(model).observe(max(finished - m.arrival_time, 0.0))
        num_tokens = tracked.num_generation_tokens
        self.request_prompt_tokens.labels(model).observe(m.num_prompt_tokens)
        self.request_generation_tokens.labels(model).observe(num_tokens)
        if m.first_token_time is not None:
            if m.first_scheduled_time is not None:
                prefill = m.first_token_time - m.first_scheduled_time
                self.request_prefill_time.labels(model).observe(max(prefill, 0.0))
            decode = (m.last_token_time or finished) - m.first_token_time
            self.request_decode_time.labels(model).observe(max(decode, 0.0))
        if num_tokens > 1 and m.first_token_time is not None:
            last = m.last_token_time or finished
            tpot = max(last - m.first_token_time, 0.0) / (num_tokens - 1)
            self.request_time_per_output_token.labels(model).observe(tpot)

    def on_stats(self, stats: EngineStats) -> None:
        model = self._model_name
        if model is None:
            return
        self.num_requests_running.labels(model).set(stats.num_running)
        self.num_requests_waiting.labels(model).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(model).set(stats.kv_cache_usage)
        # The engine keeps running totals; counters advance by what is new since the last call.
        if self._seen["steps"] < 0:  # the first call (after warm-up): a baseline, no sample
            self._seen["steps"] = stats.num_steps
        elif stats.num_steps > self._seen["steps"]:
            # Every step since the last call (stats arrive every few steps, not every step).
            new = stats.num_steps - self._seen["steps"]
            for n in stats.recent_step_num_tokens[-new:]:
                self.iteration_tokens.labels(model).observe(n)
            self._seen["steps"] = stats.num_steps
        for key, total, counter in (
            ("replays", stats.num_graph_replays, self.cuda_graph_replays),
            ("piecewise", stats.num_piecewise_replays, self.piecewise_graph_replays),
            ("compiles", stats.num_compiles_while_serving, self.compiles_while_serving),
            ("preemptions", stats.num_preemptions, self.num_preemptions),
            ("pc_queries", stats.prefix_cache_queries, self.prefix_cache_queries),
            ("pc_hits", stats.prefix_cache_hits, self.prefix_cache_hits),
        ):
            if total > self._seen[key]:
                counter.labels(model).inc(total - self._seen[key])
                self._seen[key] = total
        for phase, seconds in stats.startup_seconds.items():
            self.startup_duration.labels(model, phase).set(seconds)
        for reason, total in stats.num_eager_steps.items():
            seen = self._seen_eager.get(reason, 0)
            if total > seen:
                self.eager_steps.labels(model, reason).inc(total - seen)
                self._seen_eager[reason] = total
        if stats.spec_num_drafts > self._seen_spec_drafts:
            self._on_spec_totals(stats)
        if stats.spec_decisions and model is not None:
            for key, total in stats.spec_decisions.items():
                seen = self._seen_decisions.get(key, 0)
                if total > seen:
                    decision, reason = key.split(":", 1)
                    self.spec_decode_policy_steps.labels(model, decision, reason).inc(total - seen)
                    self._seen_decisions[key] = total
            self.spec_decode_accept_length_estimate.labels(model).set(
                stats.spec_accept_length_estimate
            )
            for bs, ratio in stats.spec_break_even.items():
                self.spec_decode_break_even.labels(model, str(bs)).set(ratio)

    def _on_spec_totals(self, stats: EngineStats) -> None:
        """Turn the engine's speculative running totals into what is new since the last call."""
        seen = self._seen_spec
        per_pos = [
            total - (seen.accepted_per_pos[i] if i < len(seen.accepted_per_pos) else 0)
            for i, total in enumerate(stats.spec_accepted_per_pos)
        ]
        lengths = []
        for length, total in stats.spec_accept_lengths.items():
            lengths += [length] * (total - seen.accept_lengths.get(length, 0))
        self.on_spec_decode(
            stats.spec_num_drafts - seen.num_drafts,
            stats.spec_num_draft_tokens - seen.num_draft_tokens,
            per_pos,
            lengths,
        )
        self._seen_spec = _SpecSeen(
            stats.spec_num_drafts,
            stats.spec_num_draft_tokens,
            list(stats.spec_accepted_per_pos),
            dict(stats.spec_accept_lengths),
        )

    @property
    def _seen_spec_drafts(self) -> int:
        return self._seen_spec.num_drafts

    def on_spec_decode(
        self,
        num_drafts: int,
        num_draft_tokens: int,
        num_accepted_tokens_per_pos: Sequence[int],
        accept_lengths: Iterable[int] = (),
    ) -> None:
        """Record verification steps since the last call.

        Args:
            num_drafts: verification steps (one per request per step).
            num_draft_tokens: draft tokens proposed in those steps.
            num_accepted_tokens_per_pos: accepted drafts at draft position 0, 1, ...
            accept_lengths: tokens emitted by each verification step, bonus token included.
        """
        model = self._model_name
        if model is None:
            return
        self.spec_decode_num_drafts.labels(model).inc(num_drafts)
        self.spec_decode_num_draft_tokens.labels(model).inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens.labels(model).inc(sum(num_accepted_tokens_per_pos))
        for pos, accepted in enumerate(num_accepted_tokens_per_pos):
            self.spec_decode_num_accepted_tokens_per_pos.labels(model, str(pos)).inc(accepted)
        for length in accept_lengths:
            self.spec_decode_accept_length.labels(model).observe(length)
