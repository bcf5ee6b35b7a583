"""POST /v1/chat/completions: messages through the model's chat template, a reply out.

Streaming follows OpenAI: each choice first gets a chunk with `delta.role = "assistant"`, then
content deltas; the last one carries `finish_reason`. Usage, when asked for with
`stream_options.include_usage`, comes in one more chunk with no choices, before `[DONE]`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.outputs import RequestOutput
from mlaserve.service.errors import BadRequestError
from mlaserve.service.logprobs import chat_logprobs
from mlaserve.service.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
)
from mlaserve.service.request_stream import RequestStream
from mlaserve.service.serving import STREAM_ERRORS, ClientDisconnected, Fanout, Serving, sse_frame
from mlaserve.service.sse_chunks import ChunkFrames

if TYPE_CHECKING:
    from mlaserve.tokenizer import Tokenizer

__all__ = ["Chat", "render_chat"]


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
) -> list[int]:
    """Token ids of `messages` through the chat template; a template error is the client's.
    With `max_tokens`, a rendered prompt that surely has more tokens is refused before it is
    encoded. Runs on the tokenizer thread (`Serving.run_tokenizer`)."""
    plain = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in messages
    ]
    try:
        text = tokenizer.render_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except ValueError as e:  # ChatTemplateError: no template, or the template raised
        raise BadRequestError(str(e), param="messages", code="invalid_value") from None
    if max_tokens is not None and tokenizer.min_num_tokens(text) > max_tokens:
        raise BadRequestError(
            f"messages: the rendered prompt has at least {tokenizer.min_num_tokens(text)} tokens "
            f"(limit {max_tokens})",
            param="messages",
            code="invalid_value",
        )
    return tokenizer.encode(text, add_special_tokens=False)


class Chat:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()
        s = self.serving
        s.require_ready()
        model = s.check_model(req.model)
        s.reject_unsupported("tools", bool(req.tools))
        s.reject_unsupported("tool_choice", req.tool_choice not in (None, "none"))
        s.reject_unsupported("logit_bias", bool(req.logit_bias))
        fmt = (req.response_format or {}).get("type", "text")
        s.reject_unsupported("response_format", fmt != "text", "only supports type 'text'")
        s.reject_unsupported("top_logprobs", req.top_logprobs is not None and not req.logprobs,
                             "requires logprobs=true")  # fmt: skip
        s.reject_unsupported("stream_options", req.stream_options is not None and not req.stream,
                             "requires stream=true")  # fmt: skip
        s.check_sequences(1, req.n)
        limit_tokens = min(s.engine.max_model_len - 1, s.max_prompt_tokens)
        prompt = await s.run_tokenizer(
            lambda tok: render_chat(tok, req.messages, max_tokens=limit_tokens)
        )
        if len(prompt) > s.max_prompt_tokens:
            raise BadRequestError(
                f"messages: {len(prompt)} prompt tokens exceed the limit of {s.max_prompt_tokens}",
                param="messages",
                code="too_many_tokens",
            )
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        limit = req.max_completion_tokens or req.max_tokens
        max_model_len = s.engine.max_model_len

        def max_tokens(prompt: list[int]) -> int:
            return limit if limit is not None else max(1, max_model_len - len(prompt))

        fanout = s.fan_out("chatcmpl", req, [prompt], max_tokens, num_logprobs)
        stream = await s.submit(fanout, arrival_time)
        if req.stream:
            frames = self._frames(req, model, fanout, stream, num_logprobs)
            return s.streaming_response(stream, frames)
        try:
            finals = await s.collect(stream, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [self._choice(fanout.index_of(r), o, num_logprobs) for r, o in finals.items()]
        response = ChatCompletionResponse(
            id=fanout.request_id,
            created=fanout.created,
            model=model,
            choices=sorted(choices, key=lambda c: c.index),
            usage=fanout.usage(sum(len(o.outputs[0].token_ids) for o in finals.values())),
        )
        return JSONResponse(response.model_dump(mode="json"))

    @staticmethod
    def _choice(index: int, out: RequestOutput, num_logprobs: int | None) -> ChatChoice:
        c = out.outputs[0]
        logprobs = None
        if num_logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, num_logprobs)
        return ChatChoice(
            index=index,
            message=ChatResponseMessage(content=c.text),
            logprobs=logprobs,
            finish_reason=c.finish_reason,
        )

    async def _frames(
        self,
        req: ChatCompletionRequest,
        model: str,
        fanout: Fanout,
        stream: RequestStream,
        num_logprobs: int | None,
    ) -> AsyncIterator[str]:
        sent_tokens: dict[str, int] = defaultdict(int)  # generated, per choice
        want_logprobs = num_logprobs is not None
        frames = ChunkFrames.chat(fanout.request_id, fanout.created, model)

        def chunk(choices: list[ChatChunkChoice], **extra: object) -> str:
            body = ChatCompletionChunk(
                id=fanout.request_id, created=fanout.created, model=model, choices=choices, **extra
            )
            return sse_frame(body.model_dump_json())

        try:
            for sub in fanout.subrequests:
                index = fanout.index_of(sub.request_id)
                role = ChatDelta(role="assistant", content="")
                yield chunk([ChatChunkChoice(index=index, delta=role)])
            async for out in stream:  # DELTA outputs: this step's tokens only
                rid, c = out.request_id, out.outputs[0]
                index = fanout.index_of(rid)
                if out.error is not None:
                    yield self.serving.error_frame(
                        f"choice {index}: {out.error}", "generation_failed"
                    )
                    continue
                text = out.new_text
                sent_tokens[rid] += len(c.token_ids)  # counted in usage even if not sent now
                if not (text or out.finished or (want_logprobs and c.token_ids)):
                    continue  # e.g. a token that ends inside a multi-byte character
                finish_reason = c.finish_reason if out.finished else None
                if num_logprobs is None or c.logprobs is None:
                    yield frames.text(index, text, finish_reason)
                    continue
                choice = ChatChunkChoice(
                    index=index,
                    delta=ChatDelta(content=text),
                    logprobs=chat_logprobs(c.token_ids, c.logprobs, num_logprobs),
                    finish_reason=finish_reason,
                )
                yield frames.choice(choice)
            if req.include_usage_in_stream:
                yield chunk([], usage=fanout.usage(sum(sent_tokens.values())))
        except STREAM_ERRORS as e:
            yield self.serving.error_frame(e)
        yield sse_frame("[DONE]")
