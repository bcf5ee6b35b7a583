"""Host-side state of one request: its tokens, its KV pages and how far its KV is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlaserve.engine.output_text import OutputText
from mlaserve.outputs import RequestMetrics

if TYPE_CHECKING:
    from mlaserve.sampling_params import SamplingParams
    from mlaserve.tokenizer import IncrementalDetokenizer

__all__ = ["FinishReason", "Request", "RequestStatus"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # drives this request's sampling noise; fixed at admission (reproducible)
    max_tokens: int  # resolved: params.max_tokens, clipped to the context left
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    # Overlap scheduling: tokens sampled by a step still on the device (0 or 1). They count in
    # `num_tokens` (the scheduler plans the next decode around them) but are not in
    # `output_token_ids` until the engine reads them back; the next forward takes such a token
    # straight from the device (`HostBatch.future_ids`).
    num_pending_tokens: int = 0
    pending_row: int = 0  # with a pending token: its row among that step's sampled tokens
    pending_step: int = 0  # and that step's id (`StepLedger`; overlap rule 4)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in the cache. A token is "computed" once a forward wrote its KV.
    num_computed_tokens: int = 0
    # KV pages, in order. The list only grows while it holds pages; freeing them replaces it
    # with a new list (the input buffers rely on this to upload only appended pages).
    pages: list[int] = field(default_factory=list)
    # Row of the per-request device state (SamplingSlots) while RUNNING, in [0, max_num_seqs);
    # assigned by the scheduler at admission, freed at finish and preemption.
    slot: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    output_text: OutputText = field(default_factory=OutputText)  # grown by deltas
    num_released_chars: int = 0  # prefix of output_text already handed to callers
    logprobs: list[dict] | None = None
    # With params.prompt_logprobs: one entry per prompt token scored so far, [None] for token 0
    # (engine/prompt_logprobs.py fills it from the prefill forward).
    prompt_logprobs: list[dict | None] | None = None
    cumulative_logprob: float = 0.0
    metrics: RequestMetrics | None = None
    # With params.structured_outputs: its xgrammar GrammarMatcher (engine/grammar.py), which
    # has accepted every output token so far.
    grammar: Any = None
    # Speculative decoding: the draft tokens proposed after the last emitted one (the next
    # verify step checks them).
    draft_token_ids: list[int] = field(default_factory=list)
    # Whether the draft model's own KV cache holds every position this request computed. A
    # decode step that does not speculate skips the draft entirely (its cost is the point), so
    # the request's draft cache goes stale and it drafts no more until a recomputation from
    # its prompt (after preemption) refills it.
    draft_cache_valid: bool = True
    # Prefix caching (`kv_cache/prefix_cache.py`). cache_salt: mixed into the key of the first
    # page, so requests of different salts never share a cached page (vLLM's field).
    cache_salt: str | None = None
    # Keys of the first len(page_keys) full pages of `pages` (cached or not: the chain the next
    # page's key extends). Reset with the pages.
    page_keys: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, pending ones included (the sampler's step count)."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]
