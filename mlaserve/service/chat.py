"""POST /v1/chat/completions: messages through the model's chat template, a reply out.

Streaming follows OpenAI: each choice first gets a chunk with `delta.role = "assistant"`, then
content deltas; the last one carries `finish_reason`. Usage, when asked for with
`stream_options.include_usage`, comes in one more chunk with no choices, before `[DONE]`.

Tools (with `--tool-call-parser`): `tools` reach the chat template; `tool_choice` is 'none' (the
output is content), 'auto' (needs `--enable-auto-tool-choice`: the parser finds the calls the
model writes, and `finish_reason` is "tool_calls"), 'required' or a named function (the opening
of the calls, for a named function through its name, is forced after the prompt, and xgrammar
constrains the rest to calls in the model's own format: names among the tools, arguments valid
against each tool's `parameters`; parsers/deepseek_v3_forced.py). With `--reasoning-parser`,
`<think>...</think>` goes to `reasoning_content`.
Streamed, a call arrives as `delta.tool_calls` pieces: first its index, id, type and name, then
pieces of `function.arguments` that add up to the non-streamed arguments.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.outputs import RequestMetrics, RequestOutput
from mlaserve.service.errors import BadRequestError
from mlaserve.service.logprobs import chat_logprobs, prompt_logprobs
from mlaserve.service.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChatOutputParser,
    ChatParts,
    ToolCallDelta,
)
from mlaserve.service.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from mlaserve.service.request_stream import RequestStream
from mlaserve.service.serving import STREAM_ERRORS, ClientDisconnected, Fanout, Serving, sse_frame
from mlaserve.service.sse_chunks import ChunkFrames
from mlaserve.service.tool_mode import ToolMode

if TYPE_CHECKING:
    from mlaserve.tokenizer import Tokenizer

__all__ = ["Chat", "ChatOptions", "render_chat"]


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat settings (vLLM's flags of the same names)."""

    chat_template: str | None = None  # the template text; None: the tokenizer's own
    tool_call_parser: str | None = None  # a key of TOOL_PARSERS
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # a key of REASONING_PARSERS


def render_chat(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    max_tokens: int | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    *,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    continuation: Callable[[str], str] | None = None,
) -> list[int]:
    """Token ids of `messages` through the chat template; a template error is the client's.
    Assistant `tool_calls` and tool results (`tool_call_id`) reach the template as the model's
    template expects them; `template_kwargs` are extra template variables. With `max_tokens`, a
    rendered prompt that surely has more tokens is refused before it is encoded.
    `continuation` gives text to append to the rendered prompt (a forced tool call). Runs on the
    tokenizer thread (`Serving.run_tokenizer`)."""
    plain = [m.template_dict() for m in messages]
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    try:
        text = tokenizer.render_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **extra,
        )
    except ValueError as e:  # ChatTemplateError: no template, or the template raised
        raise BadRequestError(str(e), param="messages", code="invalid_value") from None
    except TypeError as e:  # e.g. a template variable of the wrong type
        raise BadRequestError(
            f"chat template failed: {e}", param="chat_template_kwargs", code="invalid_value"
        ) from None
    if continuation is not None:
        text += continuation(text)
    if max_tokens is not None and tokenizer.min_num_tokens(text) > max_tokens:
        raise BadRequestError(
            f"messages: the rendered prompt has at least {tokenizer.min_num_tokens(text)} tokens "
            f"(limit {max_tokens})",
            param="messages",
            code="invalid_value",
        )
    return tokenizer.encode(text, add_special_tokens=False)


class Chat:
    def __init__(self, serving: Serving, options: ChatOptions | None = None) -> None:
        self.serving = serving
        self.options = options or ChatOptions()

    def _output_parser(self, mode: ToolMode, req: ChatCompletionRequest) -> ChatOutputParser:
        reasoning_cls = REASONING_PARSERS.get(self.options.reasoning_parser or "")
        tool_cls = TOOL_PARSERS.get(self.options.tool_call_parser or "")
        return ChatOutputParser(
            # A forced call starts the output inside the call: there is no reasoning to read.
            reasoning=reasoning_cls() if reasoning_cls is not None and not mode.forced else None,
            tools=tool_cls() if mode.parse and tool_cls is not None else None,
            forced=mode.forced,
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )

    @property
    def _parsing(self) -> bool:
        return (
            self.options.tool_call_parser is not None or self.options.reasoning_parser is not None
        )

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()
        s = self.serving
        s.require_ready()
        model = s.check_model(req.model)
        opts = self.options
        mode = ToolMode.of(req, opts.tool_call_parser, opts.enable_auto_tool_choice)
        if mode.keep_special_tokens:  # the parser must see the calls' markers
            req = req.model_copy(update={"skip_special_tokens": False})
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        s.reject_all_unsupported(req)
        s.check_sequences(1, req.n)
        limit_tokens = min(s.engine.max_model_len - 1, s.max_prompt_tokens)
        template = opts.chat_template
        continuation = mode.continuation(reasoning=opts.reasoning_parser is not None)
        prompt = await s.run_tokenizer(
            lambda tok: render_chat(
                tok,
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                max_tokens=limit_tokens,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                chat_template=template,
                tools=tools,
                continuation=continuation,
            )
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

        fanout = s.fan_out(
            "chatcmpl", req, [prompt], max_tokens, num_logprobs, req.prompt_logprobs, mode.grammar
        )
        stream = await s.submit(fanout, arrival_time, req)

        def new_parser() -> ChatOutputParser | None:
            return self._output_parser(mode, req) if self._parsing else None

        if req.stream:
            frames = self._frames(req, model, fanout, stream, num_logprobs, new_parser, mode)
            return s.streaming_response(stream, frames)
        try:
            finals = await s.collect(stream, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [
            self._choice(fanout.index_of(r), o, num_logprobs, new_parser(), mode)
            for r, o in finals.items()
        ]
        response = ChatCompletionResponse(
            id=fanout.request_id,
            created=fanout.created,
            model=model,
            choices=sorted(choices, key=lambda c: c.index),
            usage=fanout.usage(
                sum(len(o.outputs[0].token_ids) for o in finals.values()),
                [o.metrics for o in finals.values()] if req.return_spec_stats else None,
                s.cached_tokens({rid: o.metrics for rid, o in finals.items()}),
            ),
            prompt_logprobs=prompt_logprobs(next(iter(finals.values())).prompt_logprobs),
        )
        return JSONResponse(response.model_dump(mode="json"))

    @staticmethod
    def _choice(
        index: int,
        out: RequestOutput,
        num_logprobs: int | None,
        parser: ChatOutputParser | None,
        mode: ToolMode,
    ) -> ChatChoice:
        c = out.outputs[0]
        logprobs = None
        if num_logprobs is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, num_logprobs)
        message = ChatResponseMessage(content=c.text)
        finish_reason = c.finish_reason
        if parser is not None:
            parts = parser.feed(c.text)
            rest = parser.finish()
            parts.reasoning += rest.reasoning
            parts.content += rest.content
            parts.calls.extend(rest.calls)
            message = _message(parts)
            finish_reason = _finish_reason(finish_reason, parser, mode)
        return ChatChoice(
            index=index, message=message, logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=c.stop_reason,
        )  # fmt: skip

    async def _frames(
        self,
        req: ChatCompletionRequest,
        model: str,
        fanout: Fanout,
        stream: RequestStream,
        num_logprobs: int | None,
        new_parser: Callable[[], ChatOutputParser | None],
        mode: ToolMode,
    ) -> AsyncIterator[str]:
        sent_tokens: dict[str, int] = defaultdict(int)  # generated, per choice
        last_metrics: dict[str, RequestMetrics] = {}  # for return_spec_stats
        want_logprobs = num_logprobs is not None
        parsers = {sub.request_id: new_parser() for sub in fanout.subrequests}
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
                last_metrics[rid] = out.metrics
                parser = parsers[rid]
                finish_reason = c.finish_reason if out.finished else None
                if parser is None:
                    delta = ChatDelta(content=text)
                    has_news = bool(text)
                else:
                    parts = parser.feed(text)
                    if out.finished:
                        more = parser.finish()
                        parts.reasoning += more.reasoning
                        parts.content += more.content
                        parts.calls.extend(more.calls)
                        finish_reason = _finish_reason(finish_reason, parser, mode)
                    delta = _delta(parts)
                    has_news = bool(parts)
                if not (has_news or out.finished or (want_logprobs and c.token_ids)):
                    continue  # e.g. a token that ends inside a multi-byte character
                stop_reason = c.stop_reason if out.finished else None
                plain = parser is None and (num_logprobs is None or c.logprobs is None)
                if plain and stop_reason is None:
                    yield frames.text(index, text, finish_reason)  # plain content: preformatted
                    continue
                logprobs = None
                if num_logprobs is not None and c.logprobs is not None:
                    logprobs = chat_logprobs(c.token_ids, c.logprobs, num_logprobs)
                choice = ChatChunkChoice(
                    index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )  # fmt: skip
                yield frames.choice(choice)
            if req.include_usage_in_stream:
                spec = list(last_metrics.values()) if req.return_spec_stats else None
                cached = self.serving.cached_tokens(last_metrics)
                yield chunk([], usage=fanout.usage(sum(sent_tokens.values()), spec, cached))
        except STREAM_ERRORS as e:
            yield self.serving.error_frame(e)
        yield sse_frame("[DONE]")


def _finish_reason(reason: str | None, parser: ChatOutputParser, mode: ToolMode) -> str | None:
    return mode.finish_reason if reason == "stop" and parser.called_tools else reason


def _message(parts: ChatParts) -> ChatResponseMessage:
    calls: dict[int, ToolCall] = {}
    for piece in parts.calls:
        call = calls.get(piece.index)
        if call is None:
            call = ToolCall(
                id=piece.id or "", function=FunctionCall(name=piece.name or "", arguments="")
            )
            calls[piece.index] = call
        call.function.arguments += piece.arguments
    return ChatResponseMessage(
        # OpenAI sends null content beside tool calls when the model wrote none.
        content=parts.content if parts.content or not calls else None,
        reasoning_content=parts.reasoning or None,
        tool_calls=[calls[i] for i in sorted(calls)] or None,
    )


def _delta(parts: ChatParts) -> ChatDelta:
    return ChatDelta(
        content=parts.content or None,
        reasoning_content=parts.reasoning or None,
        tool_calls=[_delta_call(p) for p in parts.calls] or None,
    )


def _delta_call(piece: ToolCallDelta) -> DeltaToolCall:
    first = piece.id is not None
    return DeltaToolCall(
        index=piece.index,
        id=piece.id,
        type="function" if first else None,
        function=DeltaFunctionCall(
            name=piece.name, arguments=piece.arguments if piece.arguments or first else None
        ),
    )
