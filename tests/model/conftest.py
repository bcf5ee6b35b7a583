"""The `setups` fixture of the model-vs-transformers parity tests (`parity_setup.py`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mlaserve.config import ModelConfig
from tests.checkpoints import make_reference_model
from tests.model.parity_setup import NUM_CONTINUATION, PROMPT_LENS, Setup


@pytest.fixture(scope="module")
def setups(checkpoint: Callable[[str], Path]) -> Callable[[str], Setup]:
    @functools.cache
    def get(variant: str) -> Setup:
        path = checkpoint(variant)
        ref_model = make_reference_model(path)
        g = torch.Generator().manual_seed(1234)
        seqs = [
            torch.randint(3, 384, (n + NUM_CONTINUATION,), generator=g).tolist()
            for n in PROMPT_LENS
        ]
        with torch.no_grad():
            ref = [ref_model(torch.tensor([s])).logits[0] for s in seqs]
        return Setup(ModelConfig.from_pretrained(path), path, seqs, ref)

    return get
