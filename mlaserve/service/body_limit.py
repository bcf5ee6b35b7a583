"""Reject request bodies larger than `max_request_bytes` with a 413, before they are buffered.

A declared `Content-Length` over the limit is refused at once; a chunked body is counted as it
arrives and refused as soon as it crosses the limit.

Size is not the only cost: parsing and validating JSON is paid per value, on the event loop and
under the GIL (a thread would not help), so 8 MiB of `[1],` takes seconds and stalls every other
request, /health included. A body is therefore also refused (413) once it holds more than
`max_json_values` commas, counted as the bytes arrive (`bytes.count`: milliseconds for 8 MiB),
before anything is parsed. Commas inside strings count too: telling them apart would need a
scan that costs what the parse does. The limit is derived from the prompt-token limit, well above
what any acceptable request needs.

A refused body is read to its end (and discarded) before the 413 goes out, up to
`DRAIN_LIMIT_BYTES`: a server that closes its socket with unread request bytes in the kernel's
buffer sends a TCP reset, and a client still writing its body then sees "connection reset"
instead of the 413. Beyond that bound the connection is closed without reading on.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlaserve.service.errors import error_body

__all__ = ["BodySizeLimitMiddleware"]

DRAIN_LIMIT_BYTES = 64 * 1024 * 1024


class _BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parser re-raises it instead of answering 400."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


class BodySizeLimitMiddleware:
    def __init__(
        self, app: ASGIApp, max_request_bytes: int, max_json_values: int | None = None
    ) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.max_json_values = max_json_values

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        too_large = f"request body exceeds the limit of {self.max_request_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            if int(declared) <= DRAIN_LIMIT_BYTES:
                await _drain(receive)
            await self._reject(send, too_large)
            return

        received = 0
        commas = 0
        max_commas = self.max_json_values
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received, commas
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            received += len(chunk)
            refusal = None
            if received > self.max_request_bytes:
                refusal = too_large
            elif max_commas is not None:
                commas += chunk.count(b",")
                if commas > max_commas:
                    refusal = (
                        f"request body holds more than {max_commas} JSON values (commas, "
                        "strings included); see max_prompt_tokens_per_request"
                    )
            if refusal is None:
                return message
            if message.get("more_body", False):
                # Whoever answers (this middleware or the app's HTTPException handler) answers
                # after the whole body is in.
                await _drain(receive, DRAIN_LIMIT_BYTES - received)
            raise _BodyTooLarge(refusal)

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge as e:
            if not response_started:
                await self._reject(send, e.detail)

    async def _reject(self, send: Send, message: str) -> None:
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


async def _drain(receive: Receive, limit: int = DRAIN_LIMIT_BYTES) -> None:
    """Read and discard the rest of a request body: until its end, a disconnect, or `limit`."""
    read = 0
    while read <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
