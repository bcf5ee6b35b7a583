"""POST /v1/completions: prompts (text or token ids) in, text out, whole or as SSE chunks.

`echo` puts the prompt before the completion; with `logprobs` the prompt's tokens come first in
the logprobs too (the first one null), scored by the prefill forward itself
(`SamplingParams.prompt_logprobs`). `max_tokens: 0` with `echo` scores the prompt only: as in
vLLM, the engine samples one token, which the response drops (no text, no logprob, not counted
in usage; finish_reason "length"). This is what evaluation harnesses send for log-likelihoods.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlaserve.outputs import RequestMetrics, RequestOutput
from mlaserve.service.errors import BadRequestError
from mlaserve.service.logprobs import completion_logprobs, prompt_logprobs
from mlaserve.service.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from mlaserve.service.request_stream import RequestStream
from mlaserve.service.serving import STREAM_ERRORS, ClientDisconnected, Fanout, Serving, sse_frame
from mlaserve.service.sse_chunks import ChunkFrames
from mlaserve.tokenizer import Tokenizer

__all__ = ["Completions"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@dataclass(slots=True)
class _Echo:
    """What `echo` puts before each prompt's completion: its text, and the text of its first
    token (the one logprobs entry the engine has no logprob for)."""

    texts: list[str]
    first_pieces: list[dict[int, str]]


class Completions:
    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival_time = time.time()
        s = self.serving
        s.require_ready()
        model = s.check_model(req.model)
        s.reject_all_unsupported(req)
        raw_prompts = self._prompts(req.prompt)
        s.check_sequences(len(raw_prompts), req.n)  # before any tokenizing
        prompts = await s.tokenize(raw_prompts)
        max_model_len = s.engine.max_model_len
        score_only = req.echo and req.max_tokens == 0

        def max_tokens(prompt: list[int]) -> int:
            if score_only:
                return 1  # sampled, then dropped (see the module docstring)
            if req.max_tokens is not None:
                return req.max_tokens
            return max(1, min(DEFAULT_MAX_TOKENS, max_model_len - len(prompt)))

        num_prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            num_prompt_logprobs = max(num_prompt_logprobs or 0, req.logprobs)
        fanout = s.fan_out("cmpl", req, prompts, max_tokens, req.logprobs, num_prompt_logprobs)
        echo = await self._echo(req, raw_prompts, prompts) if req.echo else None
        stream = await s.submit(fanout, arrival_time, req)
        if req.stream:
            return s.streaming_response(stream, self._frames(req, model, fanout, stream, echo))
        try:
            finals = await s.collect(stream, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [
            self._choice(fanout.index_of(rid), out, req, echo) for rid, out in finals.items()
        ]
        generated = 0 if score_only else sum(len(o.outputs[0].token_ids) for o in finals.values())
        response = CompletionResponse(
            id=fanout.request_id,
            created=fanout.created,
            model=model,
            choices=sorted(choices, key=lambda c: c.index),
            usage=fanout.usage(
                generated,
                [o.metrics for o in finals.values()] if req.return_spec_stats else None,
                s.cached_tokens({rid: o.metrics for rid, o in finals.items()}),
            ),
        )
        return JSONResponse(response.model_dump(mode="json"))

    async def _echo(
        self,
        req: CompletionRequest,
        raw_prompts: Sequence[str | list[int]],
        prompts: list[list[int]],
    ) -> _Echo:
        """Text prompts echo as sent; token prompts as decoded, special tokens included (the
        prompt exactly as the model saw it), on the tokenizer thread."""

        def work(tok: Tokenizer) -> _Echo:
            texts = [
                p if isinstance(p, str) else tok.decode(ids, skip_special_tokens=False)
                for p, ids in zip(raw_prompts, prompts)
            ]
            return _Echo(texts, [{ids[0]: tok.id_to_piece(ids[0])} for ids in prompts])

        return await self.serving.run_tokenizer(work)  # type: ignore[return-value]

    @staticmethod
    def _parts(
        out: RequestOutput,
        req: CompletionRequest,
        echo: _Echo | None,
        prompt_index: int,
        first: bool,
    ) -> tuple[str, list[int], list | None, int | None]:
        """This output's text, token ids and logprob entries as the choice shows them (the
        prompt first when echoing, on the first output), and the text offset of the generated
        part's start relative to the choice's text (None if nothing is echoed now)."""
        c = out.outputs[0]
        text, token_ids, entries = out.new_text, list(c.token_ids), c.logprobs
        if req.echo and req.max_tokens == 0:
            text, token_ids, entries = "", [], []  # the sampled token is not shown
        if echo is None or not first:
            return text, token_ids, entries, None
        prompt_entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        echoed = echo.texts[prompt_index]
        return (
            echoed + text,
            out.prompt_token_ids + token_ids,
            None if entries is None else prompt_entries + list(entries),
            len(echoed),
        )

    def _choice(
        self, index: int, out: RequestOutput, req: CompletionRequest, echo: _Echo | None
    ) -> CompletionChoice:
        c = out.outputs[0]
        prompt_index = index // req.n
        text, token_ids, entries, _ = self._parts(out, req, echo, prompt_index, first=True)
        logprobs = None
        if req.logprobs is not None and entries is not None:
            unscored = echo.first_pieces[prompt_index] if echo is not None else None
            logprobs = completion_logprobs(token_ids, entries, req.logprobs, unscored=unscored)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_logprobs=(
                prompt_logprobs(out.prompt_logprobs) if req.prompt_logprobs is not None else None
            ),
        )

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

    async def _frames(
        self,
        req: CompletionRequest,
        model: str,
        fanout: Fanout,
        stream: RequestStream,
        echo: _Echo | None,
    ) -> AsyncIterator[str]:
        # Per choice: tokens sent, and where the next token starts in the choice's text (the
        # sum of the sent tokens' lengths, as in the non-streamed response; NOT the characters
        # sent, which lag behind by the stop-string holdback).
        sent_tokens: dict[str, int] = defaultdict(int)  # generated, per choice
        last_metrics: dict[str, RequestMetrics] = {}  # for return_spec_stats
        text_offsets: dict[str, int] = defaultdict(int)
        started: set[str] = set()
        want_logprobs = req.logprobs is not None
        score_only = req.echo and req.max_tokens == 0
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
                first = rid not in started
                started.add(rid)
                if not score_only:
                    sent_tokens[rid] += len(c.token_ids)  # counted in usage even if not sent now
                last_metrics[rid] = out.metrics
                text, token_ids, entries, _ = self._parts(out, req, echo, index // req.n, first)
                if not (text or out.finished or (want_logprobs and token_ids)):
                    continue  # e.g. a token that ends inside a multi-byte character
                logprobs = None
                if req.logprobs is not None and entries is not None:
                    unscored = echo.first_pieces[index // req.n] if echo and first else None
                    logprobs = completion_logprobs(
                        token_ids, entries, req.logprobs, text_offsets[rid], unscored
                    )
                    if logprobs.tokens:
                        text_offsets[rid] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
                finish_reason = c.finish_reason if out.finished else None
                stop_reason = c.stop_reason if out.finished else None
                if logprobs is None and stop_reason is None:
                    yield frames.text(index, text, finish_reason)
                    continue
                choice = CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
                yield frames.choice(choice)
            if req.include_usage_in_stream:
                spec = list(last_metrics.values()) if req.return_spec_stats else None
                cached = self.serving.cached_tokens(last_metrics)
                yield chunk([], usage=fanout.usage(sum(sent_tokens.values()), spec, cached))
        except STREAM_ERRORS as e:
            yield self.serving.error_frame(e)
        yield sse_frame("[DONE]")
