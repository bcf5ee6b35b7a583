"""From an OpenAI request to engine requests and back: the shared part of both endpoints.

One HTTP request fans out into `len(prompts) * n` engine requests with ids `{id}-{index}`,
choice `index = prompt_index * n + i`, and seed `seed + i` when a seed is given (so choice i of
a request is reproducible on its own). Everything that can be wrong with a request is found
before a response starts: sampling parameters on the event loop, prompt and context checks by
the engine when it accepts the requests (`AsyncEngine.add` waits for that).

A client that goes away aborts its engine requests at once: a streaming response aborts when
Starlette stops it, a non-streaming one races the generation against `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlaserve.outputs import RequestOutput
from mlaserve.sampling_params import SamplingParams, SamplingParamsError
from mlaserve.service.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    QueueFullError,
)
from mlaserve.service.errors import (
    BadRequestError,
    InternalServerError,
    NotFoundError,
    ServiceUnavailableError,
    error_body,
)
from mlaserve.service.protocol import MAX_SEED, SamplingRequest, UsageInfo
from mlaserve.service.request_stream import RequestStream, SubRequest

__all__ = ["Fanout", "Serving", "sse_frame"]

_SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens",
)  # fmt: skip


def sse_frame(data: str) -> str:
    return f"data: {data}\n\n"


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True)
class Fanout:
    """The engine requests behind one HTTP request."""

    request_id: str
    prompts: list[list[int]]
    subrequests: list[SubRequest]
    created: int

    def index_of(self, engine_request_id: str) -> int:
        return int(engine_request_id.rsplit("-", 1)[1])

    def usage(self, finals: dict[str, RequestOutput]) -> UsageInfo:
        prompt_tokens = sum(len(p) for p in self.prompts)
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class Serving:
    """Readiness, model names, sampling parameters and request submission for both endpoints."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

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

    @staticmethod
    def reject_unsupported(field: str, is_set: bool, what: str = "is not supported") -> None:
        if is_set:
            raise BadRequestError(f"{field} {what}", param=field, code="unsupported_parameter")

    # ----- fan-out -----
    def fan_out(
        self,
        prefix: str,
        req: SamplingRequest,
        prompts: list[list[int]],
        max_tokens: Callable[[list[int]], int],
        logprobs: int | None,
    ) -> Fanout:
        request_id = new_request_id(prefix)
        subrequests = []
        for p, prompt in enumerate(prompts):
            for i in range(req.n):
                seed = None if req.seed is None else (req.seed + i) % (MAX_SEED + 1)
                params = self.sampling_params(req, max_tokens(prompt), seed, logprobs)
                index = p * req.n + i
                subrequests.append(SubRequest(f"{request_id}-{index}", prompt, params))
        return Fanout(request_id, prompts, subrequests, int(time.time()))

    def sampling_params(
        self, req: SamplingRequest, max_tokens: int, seed: int | None, logprobs: int | None
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
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                **kwargs,
            )
            params.check_vocab(vocab_size)
        except SamplingParamsError as e:  # the message starts with the field name
            param = str(e).split(":", 1)[0]
            raise BadRequestError(str(e), param=param, code="invalid_value") from None
        return params

    async def submit(self, fanout: Fanout, arrival_time: float) -> RequestStream:
        """Hand the requests to the engine; map its refusals to HTTP errors."""
        capacity = self.engine.max_num_seqs + self.engine.max_queue
        if len(fanout.subrequests) > capacity:
            raise BadRequestError(
                f"the request needs {len(fanout.subrequests)} sequences (prompts x n) but the "
                f"server admits at most {capacity} at once",
                param="n",
                code="invalid_value",
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
            raise BadRequestError(str(e), param=param, code="invalid_value") from None

    # ----- delivery -----
    async def collect(self, stream: RequestStream, raw: Request) -> dict[str, RequestOutput]:
        """Wait for every request of the stream to finish; abort them if the client leaves."""

        async def gather() -> dict[str, RequestOutput]:
            finals: dict[str, RequestOutput] = {}
            async for out in stream:
                finals[out.request_id] = out
            return finals

        collecting = asyncio.ensure_future(gather())
        watching = asyncio.ensure_future(_wait_for_disconnect(raw.receive))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():
                raise ClientDisconnected
            try:
                return collecting.result()
            except EngineDeadError as e:
                raise InternalServerError(str(e), code="engine_dead") from None
        finally:
            watching.cancel()
            collecting.cancel()
            self.engine.abort(stream)

    def streaming_response(self, stream: RequestStream, frames: AsyncIterator[str]) -> Response:
        return _EngineStreamingResponse(frames, on_close=lambda: self.engine.abort(stream))

    @staticmethod
    def error_frame(exc: Exception) -> str:
        """An SSE frame for an error after the stream started (status 200 is already sent)."""
        body = error_body(str(exc), InternalServerError.error_type, None, "engine_dead")
        return sse_frame(json.dumps(body))


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
