"""Optional API key: `Authorization: Bearer <key>` on every route but the probes and /metrics.

The check hashes both sides with SHA-256 and compares the digests with `hmac.compare_digest`,
so its running time depends neither on where a wrong key first differs nor on its length.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from mlaserve.service.errors import error_body

__all__ = ["UNAUTHENTICATED_PATHS", "APIKeyMiddleware", "is_authorized"]

# Load balancers and Prometheus must reach these without a key.
UNAUTHENTICATED_PATHS = frozenset({"/health", "/ready", "/metrics"})


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def is_authorized(authorization: bytes | None, key_digest: bytes) -> bool:
    """Whether an `Authorization` header value carries the key whose SHA-256 is `key_digest`.

    The scheme is matched case-insensitively (RFC 9110); the token is compared in constant time.
    """
    scheme, _, token = (authorization or b"").partition(b" ")
    ok_scheme = scheme.lower() == b"bearer"
    # Always hash and compare, even for a missing header or a wrong scheme.
    ok_token = hmac.compare_digest(_digest(token.strip()), key_digest)
    return ok_scheme and ok_token


class APIKeyMiddleware:
    """Pure ASGI middleware, so it runs before body parsing and for unknown routes too."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key: must be a non-empty string")
        self.app = app
        self._key_digest = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNAUTHENTICATED_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if is_authorized(header, self._key_digest):
            await self.app(scope, receive, send)
            return
        message = "missing API key" if header is None else "invalid API key"
        body = json.dumps(error_body(message, "authentication_error", None, "invalid_api_key"))
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
