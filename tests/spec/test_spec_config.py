"""Speculative decoding configuration: vLLM's dict, the shorthand, the CLI, and clear errors."""

from __future__ import annotations

import pytest

from mlaserve import LLM
from mlaserve.config import ConfigError, EngineConfig, SpeculativeConfig
from mlaserve.service.settings import load_settings

CPU = {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "auto", "page_size": 4}


def test_dict_and_shorthand_agree() -> None:
    a = EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    b = EngineConfig(num_speculative_tokens=2)
    assert a.speculative == b.speculative == SpeculativeConfig("mtp", 2)
    assert EngineConfig(speculative_config={"method": "mtp"}).speculative.k == 3  # the default
    assert EngineConfig().speculative is None and EngineConfig().num_lookahead_tokens == 0
    assert b.num_lookahead_tokens == 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"speculative_config": {"method": "eagle"}}, r"speculative_config\.method"),
        (
            {"speculative_config": {"method": "mtp", "num_speculative_tokens": 0}},
            r"speculative_config\.num_speculative_tokens",
        ),
        ({"speculative_config": {"mtp": 3}}, r"speculative_config: unknown key"),
        ({"speculative_config": "mtp"}, r"speculative_config: expected a JSON object"),
        ({"num_speculative_tokens": 0}, r"^num_speculative_tokens: must be"),
        (
            {"num_speculative_tokens": 2, "speculative_config": {"num_speculative_tokens": 3}},
            r"num_speculative_tokens: 2 contradicts",
        ),
    ],
)
def test_bad_values_name_the_key(kwargs, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)


def test_cli_flags() -> None:
    settings = load_settings({"num_speculative_tokens": "2"}, {})
    assert settings.engine.speculative == SpeculativeConfig("mtp", 2)
    raw = '{"method": "mtp", "num_speculative_tokens": 1}'
    settings = load_settings({"speculative_config": raw}, {})
    assert settings.engine.speculative == SpeculativeConfig("mtp", 1)
    with pytest.raises(ConfigError, match="speculative_config"):
        load_settings({"speculative_config": '{"method": "medusa"}'}, {})


def test_model_without_mtp_weights_is_a_clear_error(checkpoint) -> None:
    with pytest.raises(ConfigError, match=r"speculative_config: method 'mtp' needs MTP weights"):
        LLM(str(checkpoint("v3_moe")), num_speculative_tokens=1, **CPU)


def test_k_beyond_the_backend_is_a_clear_error(checkpoint) -> None:
    with pytest.raises(ConfigError, match=r"max_uniform_q_len"):
        LLM(str(checkpoint("v3_mtp")), num_speculative_tokens=16, **CPU)


def test_kv_pool_holds_the_mtp_layer(checkpoint) -> None:
    llm = LLM(str(checkpoint("v3_mtp")), num_speculative_tokens=2, **CPU)
    mc = llm.engine.model_config
    pool = llm.engine.runner.kv_pool
    assert pool.num_layers == mc.num_hidden_layers + mc.num_nextn_predict_layers
