"""The config package: derived values computed once when built, following `replace` and pickling,
invisible to equality; and no import of the kernels it names."""

from __future__ import annotations

import dataclasses
import math
import pickle
import subprocess
import sys

from mlaserve.backend_names import ATTENTION_BACKENDS
from mlaserve.config import EngineConfig, ModelConfig, SpeculativeConfig

TINY_V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 32,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "mscale_all_dim": 1.0,
    },
}


def test_engine_config_derived_values_follow_replace_and_pickle() -> None:
    config = EngineConfig(max_num_seqs=8, num_speculative_tokens=2, model="/ckpt")
    assert config.speculative == SpeculativeConfig("mtp", 2) and config.num_lookahead_tokens == 4
    assert str(config.model_path) == str(config.tokenizer_path) == "/ckpt"
    assert config.resolved_cuda_graph_batch_sizes() == (1, 2, 4, 8)

    wider = config.replace(max_num_seqs=40, num_speculative_tokens=3, tokenizer="/tok")
    assert wider.resolved_cuda_graph_batch_sizes() == (1, 2, 4, 8, 12, 16, 24, 32, 40)
    assert wider.num_lookahead_tokens == 6 and str(wider.tokenizer_path) == "/tok"

    # The engine process receives the config pickled (spawn).
    copy = pickle.loads(pickle.dumps(wider, protocol=5))
    assert copy == wider and hash(copy) == hash(wider) and repr(copy) == repr(wider)
    assert copy.speculative == wider.speculative and copy.model_path == wider.model_path
    assert copy.resolved_cuda_graph_batch_sizes() == wider.resolved_cuda_graph_batch_sizes()


def test_derived_fields_are_not_settable_or_shown() -> None:
    names = EngineConfig.field_names()
    for derived in ("speculative", "num_lookahead_tokens", "model_path", "tokenizer_path"):
        assert derived not in names and f"{derived}=" not in repr(EngineConfig())
    init = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
    assert not {"qk_head_dim", "kv_cache_dim", "softmax_scale"} & init


def test_model_config_derived_values_follow_replace() -> None:
    config = ModelConfig.from_dict(TINY_V3)
    assert config.qk_head_dim == 12 and config.kv_cache_dim == 12
    m = 0.1 * 1.0 * math.log(40) + 1.0  # YaRN mscale(40, mscale_all_dim=1)
    assert abs(config.softmax_scale - 12**-0.5 * m * m) < 1e-12
    plain = dataclasses.replace(config, qk_rope_head_dim=8, rope_scaling=None)
    assert plain.qk_head_dim == 16 and plain.kv_cache_dim == 16 and plain.softmax_scale == 0.25
    assert pickle.loads(pickle.dumps(config)) == config


def test_backend_names_are_the_registrys() -> None:
    from mlaserve.kernels_adapter.registry import available_backends

    assert available_backends() == sorted(ATTENTION_BACKENDS)


def test_config_imports_no_kernels_adapter() -> None:
    code = (
        "import sys, mlaserve.config; "
        "print([m for m in sys.modules if m.startswith('mlaserve.') "
        "and not m.startswith(('mlaserve.config', 'mlaserve.backend_names'))])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
