"""Preformatted SSE chunks are byte-for-byte what pydantic renders for the same chunk."""

from __future__ import annotations

import pytest

from mlaserve.service.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)
from mlaserve.service.sse_chunks import ChunkFrames

TEXTS = ["", " foo", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x01\x1f\x7f",
         "é 😀 \u2028 \u2029 中文", "</script>", "\ufffd", "null", "\"\"\""]  # fmt: skip
REASONS = [None, "stop", "length", "abort", "error"]
ID, CREATED, MODEL = "cmpl-0123456789abcdef", 1700000000, 'a "model" / name é'


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", REASONS)
@pytest.mark.parametrize("index", [0, 7, 2047])
def test_completion_text_chunk_equals_pydantic(text, reason, index) -> None:
    frames = ChunkFrames.completion(ID, CREATED, MODEL)
    choice = CompletionChoice(index=index, text=text, finish_reason=reason)
    body = CompletionResponse(id=ID, created=CREATED, model=MODEL, choices=[choice])
    assert frames.text(index, text, reason) == f"data: {body.model_dump_json()}\n\n"


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reason", REASONS)
@pytest.mark.parametrize("index", [0, 15])
def test_chat_text_chunk_equals_pydantic(text, reason, index) -> None:
    frames = ChunkFrames.chat(ID, CREATED, MODEL)
    choice = ChatChunkChoice(index=index, delta=ChatDelta(content=text), finish_reason=reason)
    body = ChatCompletionChunk(id=ID, created=CREATED, model=MODEL, choices=[choice])
    assert frames.text(index, text, reason) == f"data: {body.model_dump_json()}\n\n"


def test_any_choice_is_framed_in_the_same_envelope() -> None:
    frames = ChunkFrames.completion(ID, CREATED, MODEL)
    logprobs = CompletionLogprobs(text_offset=[0], token_logprobs=[-0.5], tokens=["a"],
                                  top_logprobs=[{"a": -0.5}])  # fmt: skip
    choice = CompletionChoice(index=3, text="a", logprobs=logprobs, finish_reason=None)
    body = CompletionResponse(id=ID, created=CREATED, model=MODEL, choices=[choice])
    assert frames.choice(choice) == f"data: {body.model_dump_json()}\n\n"
