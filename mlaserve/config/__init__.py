"""Typed, validated configuration: the model's hyper-parameters and the engine's knobs.

`ModelConfig` (model_config.py) is parsed from a checkpoint's `config.json` and keeps the DeepSeek
paper's names; `EngineConfig` (engine_config.py) holds what an operator chooses. All are frozen
dataclasses validated when built; a bad value raises `ConfigError` naming the field. This package
is the bottom layer: it imports nothing else from mlaserve but the leaf `backend_names`.
"""

from mlaserve.config.engine_config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MODEL_DTYPES,
    EngineConfig,
    default_model_path,
    resolve_torch_dtype,
)
from mlaserve.config.error import ConfigError
from mlaserve.config.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from mlaserve.config.quantization_config import QuantizationConfig
from mlaserve.config.speculative_config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)

__all__ = [
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "KV_CACHE_DTYPES",
    "LOAD_FORMATS",
    "MODEL_DTYPES",
    "SPECULATIVE_METHODS",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "QuantizationConfig",
    "RopeScaling",
    "SpeculativeConfig",
    "default_model_path",
    "resolve_torch_dtype",
]
