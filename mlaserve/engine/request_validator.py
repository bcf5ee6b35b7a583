"""Checks a request before it is queued: what the engine cannot serve is refused with an
`InvalidRequestError` naming the field, rather than failing (or silently misbehaving) later."""

from __future__ import annotations

from mlaserve.engine.scheduler import Scheduler
from mlaserve.kv_cache import PageAllocator
from mlaserve.sampling_params import SamplingParams

__all__ = ["InvalidRequestError", "RequestValidator"]


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestValidator:
    """The engine's limits a request is checked against. Holds references to the engine's
    scheduler and page allocator (owned by the engine) for the KV capacity check."""

    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        scheduler: Scheduler,
        allocator: PageAllocator,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.allocator = allocator

    @staticmethod
    def refuse_with_speculation(params: SamplingParams) -> None:
        """For an engine that decodes speculatively (the caller knows whether it does)."""
        # The speculative loop samples and verifies on the device without the grammar mask
        # and keeps no prompt-logprob rows: refused rather than silently ignored.
        for name in ("prompt_logprobs", "structured_outputs"):
            if getattr(params, name) is not None:
                raise InvalidRequestError(
                    f"{name}: not supported with speculative decoding (start the server "
                    "without --speculative-config / --num-speculative-tokens)",
                    name,
                )

    def validate(self, token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        """The prompt's ids and length, the params' ids, and the KV pages it needs."""
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
        vocab = self.vocab_size
        # min / max run in C: a long prompt is not scanned in Python
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
            )
        try:
            params.check_vocab(vocab)
        except ValueError as e:
            raise InvalidRequestError(str(e), "stop_token_ids") from None
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {n} tokens leave no room to generate within max_model_len "
                f"{self.max_model_len}",
                "prompt",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens: {params.max_tokens} + {n} prompt tokens exceeds max_model_len "
                f"{self.max_model_len}",
                "max_tokens",
            )
        total = n + max_tokens
        if (
            self.scheduler.num_pages_for(total + self.scheduler.num_lookahead_tokens)
            > self.allocator.num_usable_pages
        ):
            raise InvalidRequestError(
                f"prompt: {total} tokens need more KV pages than the cache holds "
                f"({self.allocator.num_usable_pages} pages of {self.scheduler.page_size})",
                "prompt",
            )
