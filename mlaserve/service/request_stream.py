"""What one HTTP request hands the engine (`SubRequest`s) and gets back (a `RequestStream`).

The service asks the engine for `RequestOutputKind.DELTA` outputs: each holds only what one step
added (text, token ids, logprobs), so neither side does O(length) work per step.

Backpressure policy. The engine never waits for a reader: a slow SSE client must not slow the
batch. Instead each stream keeps at most ONE pending output per engine request: an output that
arrives while the previous one is still unread is merged into it (text pieces and token ids are
appended, O(new tokens)). The queue is thus bounded by the number of choices, whatever the
reader's speed, and what it holds is exactly the undelivered part of the output (at most
max_tokens tokens per choice, never the O(n^2) of repeated cumulative copies). A reader that
catches up gets everything, in order, in fewer and larger chunks. A reader that never reads is
ended by its connection (the client leaving aborts the request) or by the shutdown timeout.

`DeltaAccumulator` is the same merge, used once more by non-streaming responses to assemble the
whole output once, at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.outputs import RequestOutput
    from mlaserve.sampling_params import SamplingParams

__all__ = ["DeltaAccumulator", "RequestStream", "SubRequest"]


@dataclass(slots=True)
class SubRequest:
    """One engine request: one choice of one prompt of an HTTP request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # prefix caching: shares cached pages only with this salt


class DeltaAccumulator:
    """Consecutive DELTA outputs of one engine request, merged into one (in O(new tokens) per
    `add`; the text is joined once, by `build`)."""

    __slots__ = (
        "_last", "_logprobs", "_new_tokens", "_prompt_logprobs", "_prompt_token_ids", "_texts",
        "_token_ids", "num_merged",
    )  # fmt: skip

    def __init__(self, first: RequestOutput) -> None:
        c = first.outputs[0]
        self._last = first
        self._texts = [first.new_text]
        self._token_ids = list(c.token_ids)
        self._logprobs = list(c.logprobs) if c.logprobs is not None else None
        self._new_tokens = first.num_new_tokens
        # Only the first delta carries them (the engine process sends the prompt once).
        self._prompt_logprobs = first.prompt_logprobs
        self._prompt_token_ids = first.prompt_token_ids
        self.num_merged = 1

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self._last = out
        self._texts.append(out.new_text)
        self._token_ids.extend(c.token_ids)
        if self._logprobs is not None and c.logprobs is not None:
            self._logprobs.extend(c.logprobs)
        self._new_tokens += out.num_new_tokens
        self.num_merged += 1

    def build(self) -> RequestOutput:
        """One output equal to the merged deltas (finish state and metrics of the last)."""
        last = self._last
        text = "".join(self._texts)
        c = dataclasses.replace(
            last.outputs[0], text=text, token_ids=self._token_ids, logprobs=self._logprobs
        )
        return dataclasses.replace(
            last,
            outputs=[c],
            new_text=text,
            num_new_tokens=self._new_tokens,
            prompt_token_ids=self._prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs,
        )


class RequestStream:
    """Outputs of one HTTP request's engine requests, in the order they became pending."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        # At most one pending (merged) output per engine request; dict order = arrival order.
        self._pending: dict[str, RequestOutput | DeltaAccumulator] = {}
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the event loop: never blocks, never grows beyond one entry per request."""
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        else:
            rid = item.request_id
            pending = self._pending.get(rid)
            if pending is None:
                self._pending[rid] = item
            elif isinstance(pending, DeltaAccumulator):
                pending.add(item)
            else:
                merged = DeltaAccumulator(pending)
                merged.add(item)
                self._pending[rid] = merged
        self._wakeup.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Pending outputs first; then the error, if one was put (e.g. the engine died)."""
        while self.unfinished:
            if not self._pending:
                if self._error is not None:
                    raise self._error
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            rid = next(iter(self._pending))
            item = self._pending.pop(rid)
            out = item.build() if isinstance(item, DeltaAccumulator) else item
            if out.finished:
                self.unfinished.discard(rid)
            yield out
