"""Fixtures for the HTTP service: a real `python -m mlaserve serve` on loopback, real clients.

The session-wide `server` serves a tiny random DeepSeek-V3 checkpoint (greedy outputs are
gibberish but deterministic). Tests that stop or reconfigure a server start their own with
`start_server`.
"""

from __future__ import annotations

import pytest

from tests.service.server_process import ServerProcess, start_server


@pytest.fixture(scope="session")
def model_dir(checkpoint):
    """The tiny random DeepSeek-V3 (MoE) checkpoint of tests/conftest.py."""
    return checkpoint("v3_moe")


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory: pytest.TempPathFactory):
    """The shared server: no API key, room for 64 concurrent requests."""
    proc = start_server(
        model_dir,
        tmp_path_factory.mktemp("server-logs") / "server.log",
        "--max-num-seqs", "64", "--max-queue", "64", "--page-size", "16",
        "--max-request-bytes", "65536",
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def openai_client(server: ServerProcess):
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture(scope="session")
def model_name(server: ServerProcess) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]
