"""The API key check: right answers, and a comparison whose cost does not depend on the input."""

from __future__ import annotations

import hashlib

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mlaserve.service import auth
from mlaserve.service.auth import APIKeyMiddleware, is_authorized

KEY = "s3cret-key"
DIGEST = hashlib.sha256(KEY.encode()).digest()


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        (f"Bearer {KEY}".encode(), True),
        (f"bearer {KEY}".encode(), True),
        (f"BEARER {KEY} ".encode(), True),
        (None, False),
        (b"", False),
        (b"Bearer", False),
        (b"Bearer ", False),
        (KEY.encode(), False),
        (f"Basic {KEY}".encode(), False),
        (f"Bearer {KEY[:-1]}".encode(), False),
        (f"Bearer {KEY}x".encode(), False),
        (f"Bearer {KEY.upper()}".encode(), False),
    ],
)
def test_is_authorized(header, ok) -> None:
    assert is_authorized(header, DIGEST) is ok


def test_comparison_is_constant_time(monkeypatch) -> None:
    """Every check, whatever the header, compares two 32-byte digests with compare_digest."""
    seen = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    headers = [None, b"", b"Bearer x", f"Bearer {KEY}".encode(), b"Bearer " + b"y" * 10_000]
    for header in headers:
        is_authorized(header, DIGEST)
    assert seen == [(32, 32)] * len(headers)


def test_middleware_guards_all_but_probes_and_metrics() -> None:
    async def hello(_):
        return PlainTextResponse("ok")

    paths = ["/health", "/ready", "/metrics", "/v1/models", "/anything"]
    app = Starlette(routes=[Route(p, hello) for p in paths])
    client = TestClient(APIKeyMiddleware(app, KEY))
    for path in ("/health", "/ready", "/metrics"):
        assert client.get(path).status_code == 200
    for path in ("/v1/models", "/anything", "/missing"):
        response = client.get(path)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).text == "ok"
    with pytest.raises(ValueError, match="api_key"):
        APIKeyMiddleware(app, "")
