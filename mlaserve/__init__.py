"""mlaserve: a small, CUDA-graph-aware inference server for MLA models (DeepSeek-V2/V3 family).

The public names are imported lazily, so `import mlaserve.config` does not load the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "mlaserve.llm",
    "SamplingParams": "mlaserve.sampling_params",
    "EngineConfig": "mlaserve.config",
    "ModelConfig": "mlaserve.config",
    "RequestOutput": "mlaserve.outputs",
    "CompletionOutput": "mlaserve.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from mlaserve.config import EngineConfig, ModelConfig
    from mlaserve.llm import LLM
    from mlaserve.outputs import CompletionOutput, RequestOutput
    from mlaserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlaserve' has no attribute {name!r}")
