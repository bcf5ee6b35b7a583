"""Reject request bodies larger than `max_request_bytes` with a 413, before they are buffered.

A declared `Content-Length` over the limit is refused at once; a chunked body is counted as it
arrives and refused as soon as it crosses the limit.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlaserve.service.errors import error_body

__all__ = ["BodySizeLimitMiddleware"]


class _BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parser re-raises it instead of answering 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            await self._reject(send)
            return

        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise _BodyTooLarge(self.max_request_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not response_started:
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        message = f"request body exceeds the limit of {self.max_request_bytes} bytes"
        body = json.dumps(error_body(message, "invalid_request_error", None, "request_too_large"))
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
