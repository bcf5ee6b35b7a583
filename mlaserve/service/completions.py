"""POST /v1/completions: prompts (text or token ids) in, text out, whole or as SSE chunks."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.outputs import RequestOutput
from mlaserve.service.errors import BadRequestError
from mlaserve.service.logprobs import completion_logprobs
from mlaserve.service.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from mlaserve.service.request_stream import RequestStream
from mlaserve.service.serving import STREAM_ERRORS, ClientDisconnected, Fanout, Serving, sse_frame
from mlaserve.service.sse_chunks import ChunkFrames

__all__ = ["Completions"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


class Completions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()
        s = self.serving
        s.require_ready()
        model = s.check_model(req.model)
        s.reject_unsupported("echo", req.echo)
        s.reject_unsupported("suffix", req.suffix is not None)
        s.reject_unsupported("best_of", req.best_of not in (None, req.n), "must equal n")
        s.reject_unsupported("logit_bias", bool(req.logit_bias))
        s.reject_unsupported("stream_options", req.stream_options is not None and not req.stream,
                             "requires stream=true")  # fmt: skip
        raw_prompts = self._prompts(req.prompt)
        s.check_sequences(len(raw_prompts), req.n)  # before any tokenizing
        prompts = await s.tokenize(raw_prompts)
        max_model_len = s.engine.max_model_len

        def max_tokens(prompt: list[int]) -> int:
            if req.max_tokens is not None:
                return req.max_tokens
            return max(1, min(DEFAULT_MAX_TOKENS, max_model_len - len(prompt)))

        fanout = s.fan_out("cmpl", req, prompts, max_tokens, req.logprobs)
        stream = await s.submit(fanout, arrival_time)
        if req.stream:
            return s.streaming_response(stream, self._frames(req, model, fanout, stream))
        try:
            finals = await s.collect(stream, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [
            self._choice(fanout.index_of(rid), out, req.logprobs) for rid, out in finals.items()
        ]
        response = CompletionResponse(
            id=fanout.request_id,
            created=fanout.created,
            model=model,
            choices=sorted(choices, key=lambda c: c.index),
            usage=fanout.usage(sum(len(o.outputs[0].token_ids) for o in finals.values())),
        )
        return JSONResponse(response.model_dump(mode="json"))

    @staticmethod
    def _prompts(prompt: str | list) -> Sequence[str | list[int]]:
        """The request's prompts, untokenized (a list of token ids is one prompt)."""
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequestError("prompt: must not be empty", param="prompt", code="invalid_value")
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    @staticmethod
    def _choice(index: int, out: RequestOutput, num_logprobs: int | None) -> CompletionChoice:
        c = out.outputs[0]
        logprobs = None
        if num_logprobs is not None and c.logprobs is not None:
            logprobs = completion_logprobs(c.token_ids, c.logprobs, num_logprobs)
        return CompletionChoice(
            index=index, text=c.text, logprobs=logprobs, finish_reason=c.finish_reason
        )

    async def _frames(
        self, req: CompletionRequest, model: str, fanout: Fanout, stream: RequestStream
    ) -> AsyncIterator[str]:
        # Per choice: tokens sent, and where the next token starts in the choice's text (the
        # sum of the sent tokens' lengths, as in the non-streamed response; NOT the characters
        # sent, which lag behind by the stop-string holdback).
        sent_tokens: dict[str, int] = defaultdict(int)  # generated, per choice
        text_offsets: dict[str, int] = defaultdict(int)
        want_logprobs = req.logprobs is not None
        frames = ChunkFrames.completion(fanout.request_id, fanout.created, model)

        def chunk(choices: list[CompletionChoice], **extra: object) -> str:
            body = CompletionResponse(
                id=fanout.request_id, created=fanout.created, model=model, choices=choices, **extra
            )
            return sse_frame(body.model_dump_json())

        try:
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
                logprobs = None
                if req.logprobs is not None and c.logprobs is not None:
                    logprobs = completion_logprobs(
                        c.token_ids, c.logprobs, req.logprobs, text_offsets[rid]
                    )
                    if logprobs.tokens:
                        text_offsets[rid] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                finish_reason = c.finish_reason if out.finished else None
                if logprobs is None:
                    yield frames.text(index, text, finish_reason)
                    continue
                choice = CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=finish_reason
                )
                yield frames.choice(choice)
            if req.include_usage_in_stream:
                yield chunk([], usage=fanout.usage(sum(sent_tokens.values())))
        except STREAM_ERRORS as e:
            yield self.serving.error_frame(e)
        yield sse_frame("[DONE]")
