"""A Kimi-K2-style checkpoint: config.json names "kimi_k2" (DeepSeek-V3's architecture), the
tokenizer is Python code it ships, and generation_config.json adds an end-of-turn id. Built
from the default model's weights and a byte tokenizer of our own
(`tests/tokenizer/remote_code_tokenizer.py`), served by a real server: without
--trust-remote-code it exits naming the flag; with it the official client gets completions and
chat through the shipped class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from mlaserve import LLM
from mlaserve.config import default_model_path
from tests.service.server_process import start_server
from tests.tokenizer.remote_code_tokenizer import write_remote_code_tokenizer

EXIT_WAIT_S = 60.0  # bounds a hang: the preflight refuses before the engine starts


@pytest.fixture(scope="module")
def kimi_style(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("kimi-style")
    source = default_model_path()
    shutil.copy(source / "model.safetensors", folder / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return write_remote_code_tokenizer(folder)


def test_the_engine_takes_kimi_k2_and_generation_configs_end_of_turn(kimi_style: Path) -> None:
    llm = LLM(str(kimi_style), device="cpu", trust_remote_code=True, num_pages=64)
    try:
        assert llm.engine.model_config.model_type == "kimi_k2"
        assert llm.engine.eos_token_ids == [1, 2]  # config.json's 1, generation_config's 2
    finally:
        llm.shutdown()


def test_without_trust_remote_code_the_server_exits_naming_the_flag(
    kimi_style: Path, tmp_path: Path
) -> None:
    server = start_server(kimi_style, tmp_path / "server.log")
    try:
        code = server.proc.wait(EXIT_WAIT_S)
    finally:
        server.stop()
    logs = server.logs()
    assert code == 2, logs  # the preflight's refusal: before a port or an engine process
    assert "tokenization_bytes.BytesTokenizer" in logs and "--trust-remote-code" in logs, logs


def test_with_it_the_official_client_gets_completions_and_chat(
    kimi_style: Path, tmp_path: Path
) -> None:
    server = start_server(kimi_style, tmp_path / "server.log", "--trust-remote-code")
    try:
        server.wait_ready()
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        text = "héllo 你好"
        done = client.completions.create(model=model, prompt=text, max_tokens=8, temperature=0)
        assert done.usage.prompt_tokens == 1 + len(text.encode())  # <bos> + one id per byte
        assert 1 <= done.usage.completion_tokens <= 8
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        # "<bos><user>hi<eos><assistant>": the shipped class's ids for its specials and bytes
        assert chat.usage.prompt_tokens == 1 + len(b"<user>hi") + 1 + len(b"<assistant>")
        ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).json()["tokens"]
        assert ids == [0, 3 + ord("h"), 3 + ord("i")]
    finally:
        server.stop()
