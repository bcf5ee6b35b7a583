"""Counts every request the server refuses, by reason, into `mlaserve:request_refused_total`.

A refusal is a response with status 4xx or 503 and an OpenAI error body
(`{"error": {..., "code"}}`); its reason is that `code`. The app's exception handlers
(errors.py) write most of them, but the API-key and body-size middlewares answer 401 and 413
before the app runs, so the count sits outside all of them, as the outermost ASGI middleware:
one response per request, so each refused request is counted once, whichever layer refused it.
The probes' 503s (`/health`, `/ready`) carry no error object and are not refusals; nor are
500s (the server's fault) or errors sent inside a stream that already answered 200.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RefusalCounterMiddleware", "is_refusal", "refusal_reason"]


def is_refusal(status: int) -> bool:
    return 400 <= status < 500 or status == 503


def refusal_reason(body: bytes) -> str | None:
    """The error body's `code` (its `type` when the code is null); None for a body that is
    not an OpenAI error."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict):
        return None
    return str(error.get("code") or error.get("type") or "unknown")


class RefusalCounterMiddleware:
    """Pure ASGI: reads the status and the (one-message) body of error responses only."""

    def __init__(self, app: ASGIApp, on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and is_refusal(status):
                reason = refusal_reason(message.get("body", b""))
                status = 0  # the first body message holds the whole JSON error: count once
                if reason is not None:
                    self.on_refused(reason)
            await send(message)

        await self.app(scope, receive, counting_send)
