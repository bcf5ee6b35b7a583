"""Preformatted SSE chunks of one streamed response: the per-token frame without pydantic.

Every chunk of a stream repeats the same envelope (id, object, created, model) around one
choice, and a token's choice differs from the last only in its text (and, at the end, its
finish reason). The envelope and the choice are therefore rendered by pydantic ONCE per
response, with sentinel values that are then cut out; a token's frame is a join of the fixed
pieces with `json.dumps` of its text. This makes a plain text chunk several times cheaper on
the event loop (measured: bench/RESULTS.md, "Moved from mlaserve/service/sse_chunks.py").
Chunks with logprobs,
the chat role chunk and the usage chunk still go through pydantic (`choice`, `frame`).

The output is byte-for-byte what pydantic renders (same field order, same escaping: non-ASCII as
UTF-8, control characters as \\uXXXX); tests/service/test_sse_chunks.py checks it. Because the
pieces come from the models themselves, a field added to them travels without a change here.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from mlaserve.service.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

__all__ = ["ChunkFrames"]

_INDEX, _TEXT, _REASON = 987654321, "\x00", "\x01"
_dumps = json.JSONEncoder(ensure_ascii=False).encode  # what pydantic writes for a str


class ChunkFrames:
    def __init__(self, envelope: BaseModel, choice: BaseModel) -> None:
        """`envelope`: the response with `choices=[]`; `choice`: a choice holding the sentinels
        (index `_INDEX`, text `_TEXT`, finish reason `_REASON`)."""
        head = envelope.model_dump_json()
        cut = head.index('"choices":[]') + len('"choices":[')
        self._head, self._tail = "data: " + head[:cut], head[cut:] + "\n\n"
        rest = choice.model_dump_json()
        parts = []
        for sentinel in (str(_INDEX), _dumps(_TEXT), _dumps(_REASON)):
            before, found, rest = rest.partition(sentinel)
            if not found:
                raise ValueError(f"sentinel {sentinel} missing from {choice.model_dump_json()}")
            parts.append(before)
        self._p0, self._p1, self._p2 = parts
        self._p3 = rest

    @classmethod
    def completion(cls, request_id: str, created: int, model: str) -> ChunkFrames:
        envelope = CompletionResponse(id=request_id, created=created, model=model, choices=[])
        return cls(envelope, CompletionChoice(index=_INDEX, text=_TEXT, finish_reason=_REASON))

    @classmethod
    def chat(cls, request_id: str, created: int, model: str) -> ChunkFrames:
        envelope = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[])
        choice = ChatChunkChoice(
            index=_INDEX, delta=ChatDelta(content=_TEXT), finish_reason=_REASON
        )
        return cls(envelope, choice)

    def text(self, index: int, text: str, finish_reason: str | None) -> str:
        """The frame of one choice's text (no logprobs), as pydantic would render it."""
        reason = "null" if finish_reason is None else _dumps(finish_reason)
        return "".join(
            (self._head, self._p0, str(index), self._p1, _dumps(text), self._p2, reason,
             self._p3, self._tail)
        )  # fmt: skip

    def choice(self, choice: BaseModel) -> str:
        """The frame of any one choice (e.g. with logprobs), rendered by pydantic."""
        return f"{self._head}{choice.model_dump_json()}{self._tail}"
