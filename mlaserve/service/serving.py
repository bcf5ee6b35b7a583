"""From an OpenAI request to engine requests and back: the shared part of both endpoints.

One HTTP request fans out into `len(prompts) * n` engine requests with ids `{id}-{index}`,
choice `index = prompt_index * n + i`, and seed `seed + i` when a seed is given (so choice i of
a request is reproducible on its own). Everything that can be wrong with a request is found
before a response starts: sampling parameters on the event loop, prompt and context checks by
the engine when it accepts the requests (`AsyncEngine.add` waits for that).

Reject before working: what costs nothing to check is checked before anything costs something.
The number of prompts and of sequences (prompts x n) and the prompt-token budget are checked
before tokenizing (token-id prompts by their length, text prompts by a lower bound on their
token count, `Tokenizer.min_num_tokens`); tokenizing then runs on the tokenizer thread, stopping
at the first prompt that breaks a limit. Sampling parameters are validated once per request.

A client that goes away aborts its engine requests at once: a streaming response aborts when
Starlette stops it, a non-streaming one races the generation against `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlaserve.outputs import RequestMetrics, RequestOutput
from mlaserve.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from mlaserve.service.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
    ServerShutdownError,
)
from mlaserve.service.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    ServiceUnavailableError,
    error_body,
)
from mlaserve.service.fanout import Fanout
from mlaserve.service.protocol import (
    MAX_LOGPROBS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_SEED,
    SamplingRequest,
)
from mlaserve.service.request_stream import DeltaAccumulator, RequestStream, SubRequest
from mlaserve.service.tokenizer_worker import TokenizerBusyError
from mlaserve.tokenizer import Tokenizer

__all__ = ["Fanout", "Serving", "sse_frame"]

logger = logging.getLogger("mlaserve.service")

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens",
)  # fmt: skip


def sse_frame(data: str) -> str:
    return f"data: {data}\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Serving:
    """Readiness, model names, sampling parameters and request submission for both endpoints."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        max_prompts_per_request: int = MAX_PROMPTS,
        max_prompt_tokens_per_request: int = MAX_PROMPT_TOKENS,
        max_logprobs: int = MAX_LOGPROBS,
        log_requests: bool = True,
    ) -> None:
        self.engine = engine
        self.max_prompts = max_prompts_per_request
        self.max_prompt_tokens = max_prompt_tokens_per_request
        self.max_logprobs = max_logprobs
        self.log_requests = log_requests

    # ----- checks -----
    def require_ready(self) -> None:
        engine = self.engine
        if engine.is_ready:
            return
        if not engine.is_alive:
            raise ServiceUnavailableError("the engine is not running", code="engine_dead")
        state = engine.state.value.replace("_", " ")
        retry = "1" if state == "draining" else "5"
        raise ServiceUnavailableError(
            f"the server is not ready: {state}",
            code="not_ready",
            headers={"Retry-After": retry},
        )

    def check_model(self, name: str | None) -> str:
        served = self.engine.model_name
        if name is not None and name != served:
            raise NotFoundError(
                f"the model {name!r} does not exist; this server serves {served!r}",
                param="model",
                code="model_not_found",
            )
        return served

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """Before any work: the prompt count and the sequences the request would need."""
        if num_prompts > self.max_prompts:
            raise BadRequestError(
                f"prompt: {num_prompts} prompts in one request; the limit is {self.max_prompts}",
                param="prompt",
                code="too_many_prompts",
            )
        capacity = self.engine.admission_bound
        if num_prompts * n > capacity:
            raise BadRequestError(
                f"the request needs {num_prompts * n} sequences (prompts x n) but the "
                f"server admits at most {capacity} at once",
                param="n",
                code="invalid_value",
            )

    def _too_many_tokens(self, what: str) -> BadRequestError:
        return BadRequestError(
            f"prompt: {what} exceeds the limit of {self.max_prompt_tokens} prompt tokens per "
            "request",
            param="prompt",
            code="too_many_tokens",
        )

    def _too_long(self, index: int, at_least: int, exact: bool) -> BadRequestError:
        n = f"{at_least}" if exact else f"at least {at_least}"
        return BadRequestError(
            f"prompt: prompt {index} has {n} tokens, which leaves no room to generate within "
            f"max_model_len {self.engine.max_model_len}",
            param="prompt",
            code="invalid_value",
        )

    async def tokenize(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        """Token ids of every prompt; text prompts are encoded on the tokenizer thread. Refuses
        (400) what breaks the per-request token budget or cannot fit the context, before
        encoding when lower bounds already tell."""
        limit = self.max_prompt_tokens
        max_prompt = self.engine.max_model_len - 1
        bound = self.engine.tokenizer.min_num_tokens  # O(1), cached: safe on the loop
        total = 0
        for i, p in enumerate(prompts):
            n = bound(p) if isinstance(p, str) else len(p)
            if n > max_prompt:
                raise self._too_long(i, n, exact=not isinstance(p, str))
            total += n
        if total > limit:
            raise self._too_many_tokens(f"{'at least ' if total else ''}{total} prompt tokens")
        texts = [(i, p) for i, p in enumerate(prompts) if isinstance(p, str)]
        if not texts:
            return [list(p) for p in prompts]  # type: ignore[arg-type]
        known = total - sum(bound(p) for _, p in texts)

        def encode_all(tok: Tokenizer) -> dict[int, list[int]] | BadRequestError:
            running, out = known, {}
            for i, text in texts:
                ids = tok.encode(text)
                running += len(ids)
                if len(ids) > max_prompt:
                    return self._too_long(i, len(ids), exact=True)
                if running > limit:  # stop at once: the rest would be wasted work
                    return self._too_many_tokens(f"more than {running - len(ids)} + {len(ids)}")
                out[i] = ids
            return out

        encoded = await self.run_tokenizer(encode_all)
        if isinstance(encoded, BadRequestError):
            raise encoded
        return [encoded[i] if isinstance(p, str) else list(p) for i, p in enumerate(prompts)]

    async def run_tokenizer(self, fn: Callable[[Tokenizer], object]) -> object:
        try:
            return await self.engine.tokenizer_worker.run(fn)
        except TokenizerBusyError as e:
            raise ServiceUnavailableError(
                str(e), code="tokenizer_busy", headers={"Retry-After": "1"}
            ) from None

    @staticmethod
    def reject_unsupported(field: str, is_set: bool, what: str = "is not supported") -> None:
        if is_set:
            raise BadRequestError(f"{field} {what}", param=field, code="unsupported_parameter")

    def reject_all_unsupported(self, req: SamplingRequest) -> None:
        """400 naming the first set field the request's schema marks unsupported."""
        for field, why in req.unsupported():
            self.reject_unsupported(field, True, why)

    def cached_tokens(self, metrics: dict[str, RequestMetrics | None]) -> dict[str, int] | None:
        """Per engine request, the prompt tokens the prefix cache held (for usage's
        prompt_tokens_details); None with prefix caching off (the field is then absent)."""
        if not self.engine.config.enable_prefix_caching:
            return None
        return {rid: m.num_cached_tokens if m is not None else 0 for rid, m in metrics.items()}

    # ----- fan-out -----
    def fan_out(
        self,
        prefix: str,
        req: SamplingRequest,
        prompts: list[list[int]],
        max_tokens: Callable[[list[int]], int],
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> Fanout:
        """`structured`: the grammar the endpoint imposes (a forced tool call), instead of the
        request's own (`SamplingRequest.structured_outputs`)."""
        request_id = new_request_id(prefix)
        if logprobs is not None and logprobs > self.max_logprobs:
            field = "top_logprobs" if prefix == "chatcmpl" else "logprobs"
            raise BadRequestError(
                f"{field}: at most {self.max_logprobs} (the server's --max-logprobs), got "
                f"{logprobs}",
                param=field,
                code="invalid_value",
            )
        # Validated once per request; each choice gets a shallow copy with its own max_tokens and
        # seed (validating len(prompts) * n copies was O(n) Python work per prompt).
        longest = max(max_tokens(p) for p in prompts)
        base = self.sampling_params(req, longest, req.seed, logprobs, prompt_logprobs, structured)
        subrequests = []
        for p, prompt in enumerate(prompts):
            limit = max_tokens(prompt)
            if base.min_tokens > limit:
                raise BadRequestError(
                    f"min_tokens: must be <= max_tokens ({limit}), got {base.min_tokens}",
                    param="min_tokens",
                    code="invalid_value",
                )
            for i in range(req.n):
                params = copy.copy(base)
                params.max_tokens = limit
                params.seed = None if req.seed is None else (req.seed + i) % (MAX_SEED + 1)
                index = p * req.n + i
                subrequests.append(
                    SubRequest(f"{request_id}-{index}", prompt, params, req.cache_salt)
                )
        return Fanout(request_id, prompts, subrequests, int(time.time()))

    def sampling_params(
        self,
        req: SamplingRequest,
        max_tokens: int,
        seed: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        vocab_size = self.engine.vocab_size
        kwargs: dict = {name: getattr(req, name) for name in _SAMPLING_FIELDS}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        try:
            params = SamplingParams(
                n=1,
                max_tokens=max_tokens,
                seed=seed,
                stop=req.stop_list,
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured_outputs=structured or req.structured_outputs(),
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA,  # O(new tokens) per step; see request_stream
                **kwargs,
            )
            params.check_vocab(vocab_size)
        except SamplingParamsError as e:  # the message starts with the field name
            param = str(e).split(":", 1)[0]
            raise BadRequestError(str(e), param=param, code="invalid_value") from None
        return params

    async def submit(
        self, fanout: Fanout, arrival_time: float, req: SamplingRequest | None = None
    ) -> RequestStream:
        """Hand the requests to the engine; map its refusals to HTTP errors."""
        self.check_sequences(len(fanout.prompts), len(fanout.subrequests) // len(fanout.prompts))
        if self.log_requests:  # one line per HTTP request, as vLLM logs them (never the text)
            params = fanout.subrequests[0].params
            logger.info(
                "request %s: %d choice(s), %d prompt tokens, max_tokens %d, temperature %s",
                fanout.request_id,
                len(fanout.subrequests),
                sum(len(p) for p in fanout.prompts),
                params.max_tokens,
                params.temperature,
            )
        try:
            return await self.engine.add(fanout.subrequests, arrival_time)
        except QueueFullError as e:
            raise ServiceUnavailableError(
                str(e), code="queue_full", headers={"Retry-After": "1"}
            ) from None
        except (EngineNotReadyError, EngineDeadError):
            self.require_ready()
            raise
        except ValueError as e:  # InvalidRequestError / SamplingParamsError
            param = getattr(e, "param", None)
            message = str(e)
            if param == "structured_outputs" and req is not None:  # e.g. a schema xgrammar refused
                param = req.structured_output_field
                message = f"{param}: {message.split(': ', 1)[-1]}"
            raise BadRequestError(message, param=param, code="invalid_value") from None

    # ----- delivery -----
    async def collect(self, stream: RequestStream, raw: Request) -> dict[str, RequestOutput]:
        """Wait for every request of the stream to finish; abort them if the client leaves.
        Returns each request's whole output, assembled once from its deltas."""

        async def gather() -> dict[str, RequestOutput]:
            parts: dict[str, DeltaAccumulator] = {}
            async for out in stream:
                acc = parts.get(out.request_id)
                if acc is None:
                    parts[out.request_id] = DeltaAccumulator(out)
                else:
                    acc.add(out)
            return {rid: acc.build() for rid, acc in parts.items()}

        collecting = asyncio.ensure_future(gather())
        watching = asyncio.ensure_future(_wait_for_disconnect(raw.receive))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                raise ClientDisconnected
            try:
                finals = collecting.result()
            except EngineDeadError as e:
                raise InternalServerError(str(e), code="engine_dead") from None
            except ServerShutdownError as e:
                raise ServiceUnavailableError(str(e), code="server_shutdown") from None
            failed = next((o for o in finals.values() if o.error is not None), None)
            if failed is not None:
                raise InternalServerError(
                    f"choice {failed.request_id.rsplit('-', 1)[1]}: {failed.error}",
                    code="generation_failed",
                )
            return finals
        finally:
            watching.cancel()
            collecting.cancel()
            self.engine.abort(stream)

    def streaming_response(self, stream: RequestStream, frames: AsyncIterator[str]) -> Response:
        return _EngineStreamingResponse(frames, on_close=lambda: self.engine.abort(stream))

    @staticmethod
    def error_frame(exc: Exception | str, code: str | None = None) -> str:
        """An SSE frame for an error after the stream started (status 200 is already sent):
        the engine died (`engine_dead`), the shutdown timeout expired (`server_shutdown`) or
        one choice failed (`generation_failed`)."""
        code = code or getattr(exc, "code", None) or "internal_error"
        kind = STREAM_ERROR_TYPES.get(code, InternalServerError.error_type)
        return sse_frame(json.dumps(error_body(str(exc), kind, None, code)))


# Errors that end a stream after its 200 (the SSE response catches them and sends error_frame).
STREAM_ERRORS = (EngineDeadError, ServerShutdownError)
STREAM_ERROR_TYPES = {"server_shutdown": ServiceUnavailableError.error_type}


class ClientDisconnected(Exception):
    """The client closed the connection before its response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends: completed, client
    gone (Starlette cancels the body), or cancelled by a shutdown that ran out of time."""

    def __init__(self, frames: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            frames,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._frames = frames
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self._frames, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(RuntimeError):  # already running or closed
                    await aclose()
