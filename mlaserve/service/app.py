"""The FastAPI application: routes, middleware and the engine's start/stop around the server.

    POST /v1/completions, /v1/chat/completions   OpenAI-compatible generation (SSE with stream)
    GET  /v1/models, /version                     what is served
    POST /tokenize, /detokenize                   the model's tokenizer and chat template
    GET  /health                                  200 while the engine process lives, else 503
    GET  /ready                                   200 once loaded and warmed up, else 503
    GET  /metrics                                 Prometheus text format
    POST /reset_prefix_cache                      drop every cached prefix page (vLLM's route)

With an API key, every route but /health, /ready and /metrics needs `Authorization: Bearer`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mlaserve.service.async_engine import AsyncEngine, EngineState
from mlaserve.service.auth import UNAUTHENTICATED_PATHS, APIKeyMiddleware
from mlaserve.service.body_limit import BodySizeLimitMiddleware
from mlaserve.service.chat import Chat, ChatOptions, render_chat
from mlaserve.service.completions import Completions
from mlaserve.service.errors import BadRequestError, install_error_handlers
from mlaserve.service.protocol import (
    MAX_LOGPROBS,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from mlaserve.service.refusal_counter import RefusalCounterMiddleware
from mlaserve.service.serving import Serving
from mlaserve.service.version import server_version

__all__ = ["build_app", "server_version"]

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (503, "Not ready, overloaded (Retry-After) or shutting down"),
    )
}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def build_app(
    engine: AsyncEngine,
    *,
    api_key: str | None = None,
    max_request_bytes: int = 8 * 1024 * 1024,
    shutdown_timeout: float = 30.0,
    max_prompts_per_request: int = MAX_PROMPTS,
    max_prompt_tokens_per_request: int = 131072,
    max_logprobs: int = MAX_LOGPROBS,
    log_requests: bool = True,
    chat_options: ChatOptions | None = None,
) -> FastAPI:
    """The app that serves `engine`; the engine process starts with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        await engine.shutdown(timeout=shutdown_timeout)

    app = FastAPI(title="mlaserve", version=server_version(), lifespan=lifespan)
    install_error_handlers(app)
    # Commas bound the JSON values a body holds: every prompt token (as an id, or as at least
    # one character of text) plus the prompts themselves, plus room for the other fields.
    max_json_values = max_prompt_tokens_per_request + 2 * max_prompts_per_request + 4096
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_request_bytes=max_request_bytes,
        max_json_values=max_json_values,
    )
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # before any body
    # Outermost: it sees the refusals of every layer inside it, the two above included.
    app.add_middleware(RefusalCounterMiddleware, on_refused=engine.metrics.on_refused)
    serving = Serving(
        engine,
        max_prompts_per_request=max_prompts_per_request,
        max_prompt_tokens_per_request=max_prompt_tokens_per_request,
        max_logprobs=max_logprobs,
        log_requests=log_requests,
    )
    chat_options = chat_options or ChatOptions()
    completions, chat = Completions(serving), Chat(serving, chat_options)
    created = int(time.time())

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": _SSE}},
    )
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: {"content": _SSE}},
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        serving.require_ready()
        card = ModelCard(
            id=engine.model_name,
            created=created,
            root=str(engine.config.model_path),
            max_model_len=engine.max_model_len,
        )
        return ModelList(data=[card])

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server_version()}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.require_ready()
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequestError("give exactly one of prompt and messages", param="prompt")
        messages, prompt = body.messages, body.prompt
        if messages is not None:
            template = chat_options.chat_template
            tokens = await serving.run_tokenizer(
                lambda tok: render_chat(
                    tok, messages, body.add_generation_prompt, chat_template=template
                )
            )
        else:
            tokens = await serving.run_tokenizer(
                lambda tok: tok.encode(prompt, body.add_special_tokens)
            )
        return TokenizeResponse(
            count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.require_ready()
        serving.check_model(body.model)
        size = engine.tokenizer_vocab_size
        bad = next((t for t in body.tokens if t >= size), None)
        if bad is not None:
            raise BadRequestError(
                f"tokens: token id {bad} is outside the tokenizer's vocabulary (size {size})",
                param="tokens",
                code="invalid_value",
            )
        text = await serving.run_tokenizer(lambda tok: tok.decode(body.tokens))
        return DetokenizeResponse(prompt=text)

    @app.post("/reset_prefix_cache", responses=_ERRORS)
    async def reset_prefix_cache() -> JSONResponse:
        """vLLM's operator route: every prefix-cache key is dropped between two engine steps;
        cached pages no request holds become free. 200 with the pages freed (0 when prefix
        caching is off)."""
        serving.require_ready()
        freed = await engine.reset_prefix_cache()
        return JSONResponse({"status": "ok", "num_freed_pages": freed})

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_alive:
            return JSONResponse({"status": "ok"})
        # `is_alive` also asks the OS: a process that just died reads as dead even before its
        # pipe's EOF (which sets `engine.error`) is read.
        error = repr(engine.error) if engine.error is not None else "the engine is not running"
        status = "stopped" if engine.state is EngineState.STOPPED else "dead"
        return JSONResponse({"status": status, "error": error}, status_code=503)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        status = 200 if engine.is_ready else 503
        return JSONResponse({"status": engine.state.value}, status_code=status)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if api_key:
        _document_bearer_auth(app)
    return app


def _document_bearer_auth(app: FastAPI) -> None:
    """Declare the bearer scheme in the OpenAPI schema (the middleware enforces it)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}
            }
            for path, operations in schema["paths"].items():
                if path not in UNAUTHENTICATED_PATHS:
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
