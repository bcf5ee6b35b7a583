"""What one HTTP request hands the engine (`SubRequest`s) and gets back (a `RequestStream`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.outputs import RequestOutput
    from mlaserve.sampling_params import SamplingParams

__all__ = ["RequestStream", "SubRequest"]


@dataclass(slots=True)
class SubRequest:
    """One engine request: one choice of one prompt of an HTTP request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestStream:
    """Outputs of one HTTP request's engine requests, in the order the engine produced them."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item
