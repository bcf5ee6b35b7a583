"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers registered by `install_error_handlers` turn FastAPI's validation errors (422 by
default) into 400s, Starlette's 404/405/413 into the same body shape, and anything unexpected
into a 500 that does not leak a traceback to the client.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = [
    "APIError",
    "AuthenticationError",
    "BadRequestError",
    "InternalServerError",
    "NotFoundError",
    "ServiceUnavailableError",
    "error_body",
    "error_response",
    "install_error_handlers",
]

logger = logging.getLogger("mlaserve.service")


class APIError(Exception):
    """An error that the API answers with `status_code` and an OpenAI error body."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class BadRequestError(APIError):
    status_code = 400


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "not_found_error"


class ServiceUnavailableError(APIError):
    """Overloaded, not ready yet, draining for shutdown, or the engine died (503)."""

    status_code = 503
    error_type = "service_unavailable_error"


class InternalServerError(APIError):
    status_code = 500
    error_type = "internal_server_error"


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code),
        status_code=exc.status_code,
        headers=exc.headers,
    )


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param(loc: tuple | list) -> str | None:
    """`body.prompt.function-after[...].0` -> `prompt.0`: field names and list indices only,
    without the union-member tags pydantic puts in between."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int):
            if parts:
                parts.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            parts.append(part)
        elif parts and not part.isidentifier():
            break  # a union member's tag: the field itself is what the client got wrong
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> BadRequestError:
    """Name the offending field the way OpenAI does: `param` is the dotted body path."""
    errors = exc.errors()
    if not errors:
        return BadRequestError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return BadRequestError(f"invalid JSON body: {first.get('msg', '')}", code="invalid_json")
    param = _param(first.get("loc", ()))
    if param is None and first.get("type") == "missing":
        return BadRequestError("a JSON request body is required", code="invalid_request")
    # A value matching no member of a union fails once per member: report them together.
    same = [e for e in errors if _param(e.get("loc", ())) == param]
    messages = list(dict.fromkeys(str(e.get("msg", "invalid value")) for e in same))[:3]
    where = f"{param}: " if param else "request body: "
    text = messages[0] if len(messages) == 1 else "invalid value (" + "; ".join(messages) + ")"
    others = len(errors) - len(same)
    more = f" (and {others} more problems)" if others else ""
    return BadRequestError(f"{where}{text}{more}", param=param, code="invalid_value")


_HTTP_ERROR_TYPES = {
    400: (BadRequestError, "invalid_request"),
    401: (AuthenticationError, "invalid_api_key"),
    404: (NotFoundError, "not_found"),
    405: (BadRequestError, "method_not_allowed"),
    413: (BadRequestError, "request_too_large"),
}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        cls, code = _HTTP_ERROR_TYPES.get(exc.status_code, (APIError, "http_error"))
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's body parser gave up
            message = f"request body is not valid UTF-8: {exc.__cause__.reason}"
        err = cls(message, code=code)
        response = error_response(err)
        response.status_code = exc.status_code
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(InternalServerError("internal server error", code="internal_error"))
