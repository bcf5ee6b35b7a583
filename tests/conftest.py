"""Shared fixtures: tiny random DeepSeek checkpoints, written once per test session.

Without CUDA, Triton kernels can only run under Triton's interpreter, and `TRITON_INTERPRET` is
read when a kernel is decorated, i.e. when its module is first imported, by whichever test
collects first. So it is set here, before anything imports mlaserve: on a CPU machine that has
Triton installed, every kernel test then runs interpreted (the model's CPU paths never call a
kernel: fused ops and the fused sampler noise are chosen only on CUDA). With CUDA it is left
alone and the compiled kernels run.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """variant -> path of its checkpoint (written on first use)."""
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = make_checkpoint(root, variant)
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def small_engine(checkpoint: Callable[[str], Path]):
    """A CPU `LLMEngine` on the tiny v3_moe checkpoint (fp32, page 4, 128 tokens, 8 sequences),
    one per test module that asks for it."""
    from mlaserve.config import EngineConfig  # after TRITON_INTERPRET is set, above
    from mlaserve.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(checkpoint("v3_moe")), device="cpu", dtype="float32", page_size=4,
        max_model_len=128, max_num_seqs=8,
    )  # fmt: skip
    return LLMEngine(config)
