"""Bad input raises a clear exception naming the problem; the engine keeps serving."""

from __future__ import annotations

import json

import pytest

from mlaserve import LLM, SamplingParams
from mlaserve.config import ConfigError, EngineConfig
from mlaserve.llm_engine import InvalidRequestError
from mlaserve.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def ckpt(checkpoint):
    return checkpoint("v3_moe")


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", page_size=4, max_model_len=64)


def test_unknown_model_type(tmp_path, ckpt) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type.*llama"):
        LLM(str(tmp_path), device="cpu")


def test_missing_model_folder(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"nope' does not exist; expected a local checkpoint"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"empty' has no config\.json"):
        LLM(str(tmp_path / "empty"), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"page_size": 3}, "page_size"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"attention_backend": "flashinfer9"}, "attention_backend"),
    ],
)
def test_invalid_engine_config_names_field(kwargs, field) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**kwargs)


def test_unknown_engine_option() -> None:
    with pytest.raises(TypeError, match="page_sise"):
        LLM(None, page_sise=4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_invalid_sampling_params_name_field(kwargs, field) -> None:
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_rejected_and_engine_keeps_serving(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([[1] * 64], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[1, vocab + 5]], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=1, stop_token_ids=[vocab]))
    with pytest.raises(InvalidRequestError, match="at least one token"):
        llm.generate([[]], SamplingParams(max_tokens=1))
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert out[0].outputs[0].finish_reason == "length"
    stats = llm.engine.get_stats()
    assert stats.num_free_pages == stats.num_total_pages
