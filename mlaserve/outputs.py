"""What the engine hands back to its callers (the offline `LLM` API and the HTTP service)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution."""

    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str


@dataclass
class CompletionOutput:
    """With `RequestOutputKind.CUMULATIVE` (the default) `text`, `token_ids` and `logprobs` hold
    everything generated so far; with DELTA only what this output adds (concatenated in order,
    the deltas give the final output); with FINAL_ONLY, the whole output once, at the end."""

    index: int
    # Generated text (stop strings removed unless asked to keep them). While the request runs,
    # the tail of a cumulative text may still turn into a stop string and be cut: stream
    # `RequestOutput.new_text` (or DELTA outputs), not slices of this field.
    text: str
    token_ids: list[int]  # generated token ids
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: Logprob} holding the chosen token and the top-N.
    logprobs: list[dict[int, Logprob]] | None = None
    # "stop" | "length" | "abort" | "error" (see RequestOutput.error); None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # Prefix caching: prompt tokens found in the cache at the request's first admission (their
    # KV was not computed for it). OpenAI's usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int = 0
    # Speculative decoding: draft tokens verified for this request, and how many were accepted
    # (what `"return_spec_stats": true` reports).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    # Tokens this step added to outputs[0] (for inter-token latency), and the text released for
    # streaming this step: concatenated, the new_text deltas equal the final outputs[0].text.
    num_new_tokens: int = 0
    new_text: str = ""
    extra: dict = field(default_factory=dict)
    # Set when the request failed (finish_reason "error"), e.g. its logits held NaN or inf: the
    # reason, for the caller to report. The output holds no token from the failed step.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (it
    # has no context), else {token_id: Logprob} holding the prompt token and the top-N. In the
    # first output of the request (every output for CUMULATIVE), else None.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's name: prompt tokens the prefix cache held at the request's admission."""
        return self.metrics.num_cached_tokens if self.metrics is not None else 0
