"""Property-based API tests: schemathesis generates requests from the server's own OpenAPI
schema (valid and invalid ones) and the real server must never answer with a 5xx."""

from __future__ import annotations

import hypothesis
import pytest

from tests.service.server_process import ServerProcess

# Optional on the GPU host (`pytest -m gpu` collects this file): skip at collection if absent.
schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

MAX_EXAMPLES = 100  # per operation


@pytest.fixture()
def api_schema(server: ServerProcess):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", timeout=10)
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=MAX_EXAMPLES,
        deterministic=True,  # the same examples every run: CI stays reproducible
        database="none",
    )
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


def _bounded(body: object) -> None:
    """Keep generated generations short (the point is the validation, not the CPU time)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool):
            body[key] = min(body[key], 4)
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool):
        body["n"] = min(body["n"], 2)
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4  # chat's default is the whole context left


@schema.parametrize()
@hypothesis.settings(
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
)
def test_no_server_errors(case, server: ServerProcess) -> None:
    _bounded(case.body)
    case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=60)
    assert server.get("/health").status_code == 200
