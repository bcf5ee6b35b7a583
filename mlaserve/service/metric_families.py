"""The Prometheus families behind /metrics: names, types, help strings, labels and buckets.

Names are vLLM's (`vllm:*` -> `mlaserve:*`), so dashboards carry over. The registry exposes the
families in the order they are declared here. Every series carries a `model_name` label (first,
so `.labels(model, ...)` is positional); `Metrics` (metrics.py) feeds them.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

__all__ = [
    "ACCEPT_LENGTH_BUCKETS",
    "EAGER_REASONS",
    "FINISH_REASONS",
    "PREFIX",
    "REQUEST_LATENCY_BUCKETS",
    "TOKEN_COUNT_BUCKETS",
    "TOKEN_LATENCY_BUCKETS",
    "MetricFamilies",
]

PREFIX = "mlaserve:"
# Per-token latencies: sub-millisecond (small batches on a GPU) to seconds (a stalled step).
TOKEN_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Per-request latencies: a millisecond (a cached one-token prompt) to ten minutes.
REQUEST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
ACCEPT_LENGTH_BUCKETS = tuple(float(i) for i in range(1, 17))
# Token counts per request (prompt, generation) and per engine step: vLLM's 1-2-5 series.
TOKEN_COUNT_BUCKETS = tuple(
    float(m * 10**e) for e in range(0, 7) for m in (1, 2, 5) if m * 10**e <= 1_000_000
)
FINISH_REASONS = ("stop", "length", "abort")
# Why a step ran without a CUDA graph (the graph runner's reasons).
EAGER_REASONS = ("extend", "batch_too_large", "graphs_off", "no_graphs")

# NOTE: `*_created` timestamp series double the exposition and no dashboard reads them.
disable_created_metrics()


class MetricFamilies:
    """Every family, declared on one registry (a fresh one unless given)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # Declaration order is exposition order: keep it when adding a family.
        self._declare_request_histograms()
        self._declare_scheduler_series()
        self._declare_token_counters()
        self._declare_spec_decode()
        self._declare_cuda_graphs()
        self._declare_startup()
        self._declare_refusals()

    def create_series(self, model_name: str) -> None:
        """Create the labelled series, so they read 0 rather than being absent."""
        for family in (
            self.time_to_first_token, self.inter_token_latency, self.request_time_per_output_token,
            self.e2e_request_latency, self.request_queue_time, self.num_requests_running,
            self.num_requests_waiting, self.kv_cache_usage_perc, self.prompt_tokens,
            self.generation_tokens, self.spec_decode_num_drafts, self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens, self.spec_decode_accept_length,
            self.cuda_graph_replays, self.piecewise_graph_replays, self.compiles_while_serving,
            self.request_prefill_time,
            self.request_decode_time, self.request_prompt_tokens, self.request_generation_tokens,
            self.iteration_tokens, self.num_preemptions, self.prefix_cache_queries,
            self.prefix_cache_hits,
        ):  # fmt: skip
            family.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in EAGER_REASONS:
            self.eager_steps.labels(model_name, reason)

    # ----- the families, by what feeds them -----
    def _declare_request_histograms(self) -> None:
        """Per-request latencies and sizes, from the timestamps in `RequestOutput.metrics`."""
        h = self._histogram
        self.time_to_first_token = h(
            "time_to_first_token_seconds", "Time to first token (TTFT).", REQUEST_LATENCY_BUCKETS
        )
        self.inter_token_latency = h(
            "inter_token_latency_seconds",
            "Inter-token latency (TPOT); k tokens in one step count as k samples of interval/k.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.request_time_per_output_token = h(
            "request_time_per_output_token_seconds",
            "Per-request mean time per output token after the first.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = h(
            "e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = h(
            "request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = h(
            "request_prefill_time_seconds",
            "Time from first scheduling to the first token (prefill phase).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = h(
            "request_decode_time_seconds",
            "Time from the first to the last token (decode phase).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = h(
            "request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = h(
            "request_generation_tokens",
            "Generated tokens per finished request.",
            TOKEN_COUNT_BUCKETS,
        )

    def _declare_scheduler_series(self) -> None:
        """The engine's steps and its queues, from `LLMEngine.get_stats()`."""
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total",
            "Tokens (prompt + generated) run by each engine step.",
            TOKEN_COUNT_BUCKETS,
        )
        self.num_preemptions = self._counter(
            "num_preemptions", "Requests preempted (KV pages freed, recomputed later)."
        )
        self.num_requests_running = self._gauge(
            "num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = self._gauge(
            "num_requests_waiting", "Requests waiting to be scheduled."
        )
        self.kv_cache_usage_perc = self._gauge(
            "kv_cache_usage_perc", "KV-cache page usage, 0 to 1."
        )

    def _declare_token_counters(self) -> None:
        """Token and finished-request totals, from each step's outputs."""
        self.prompt_tokens = self._counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.")
        self.request_success = self._counter(
            "request_success", "Finished requests by finish reason.", "finished_reason"
        )
        # vLLM's prefix-cache counters (tokens): hits / queries is the hit rate.
        self.prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission."
        )
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens the prefix cache held at admission."
        )

    def _declare_spec_decode(self) -> None:
        """Speculative decoding (vLLM's names; fed once the engine drafts tokens)."""
        self.spec_decode_num_drafts = self._counter("spec_decode_num_drafts", "Verification steps.")
        self.spec_decode_num_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.spec_decode_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self.spec_decode_num_accepted_tokens_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position.",
            "position",
        )
        self.spec_decode_accept_length = self._histogram(
            "spec_decode_accept_length",
            "Tokens emitted per verification step (accepted drafts + the bonus token).",
            ACCEPT_LENGTH_BUCKETS,
        )
        self.spec_decode_policy_steps = self._counter(
            "spec_decode_policy_steps",
            "Steps by the speculation policy's decision (on/off) and its reason "
            "(pays, hold, does_not_pay, probe, cap, unmeasured, too_large, forced).",
            "decision",
            "reason",
        )
        self.spec_decode_accept_length_estimate = self._gauge(
            "spec_decode_accept_length_estimate",
            "The policy's running accept-length estimate (compared with the measured "
            "break-even per batch size).",
        )
        self.spec_decode_break_even = self._gauge(
            "spec_decode_break_even",
            "Accept length above which speculation pays at this captured batch size "
            "(speculative / plain step cost, followed from the served steps' wall times).",
            "batch_size",
        )

    def _declare_cuda_graphs(self) -> None:
        """How forward steps ran, and JIT compiles after start-up (expected 0)."""
        self.cuda_graph_replays = self._counter(
            "cuda_graph_replays", "Forward steps replayed from a CUDA graph."
        )
        self.piecewise_graph_replays = self._counter(
            "piecewise_graph_replays",
            "EXTEND (prefill) forwards replayed from piecewise CUDA graphs (attention eager).",
        )
        self.eager_steps = self._counter(
            "eager_steps",
            "Forward steps run eagerly, by reason (extend, too_large, no_graphs, ...).",
            "reason",
        )
        self.compiles_while_serving = self._counter(
            "compiles_while_serving",
            "JIT compilations (Triton kernels, torch.compile graphs) after warm-up; expected 0.",
        )

    def _declare_startup(self) -> None:
        """Where the engine's start-up went (set once, when the engine is ready)."""
        self.startup_duration = self._gauge(
            "startup_duration_seconds",
            "Engine start-up, seconds per phase (process_start, torch_import, tokenizer, "
            "tp_start, device_init, model_construction, weight_read, weight_postprocess, "
            "kernel_warmup, kv_pool, warmup, capture, other); the phases sum to the process's age "
            "at ready.",
            "phase",
        )

    def _declare_refusals(self) -> None:
        """Requests the server answered with a 4xx or 503 error body (refusal_counter.py)."""
        self.request_refused = self._counter(
            "request_refused",
            "Requests refused (4xx, 503) by reason: the error body's code (invalid_value, "
            "queue_full, not_ready, engine_dead, invalid_api_key, request_too_large, ...).",
            "reason",
        )

    # ----- constructors: `model_name` first, then the family's own labels -----
    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(
            PREFIX + name, doc, ["model_name"], registry=self.registry, buckets=buckets
        )

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)
