"""Shared fixtures: tiny random DeepSeek checkpoints, written once per test session."""

from __future__ import annotations

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
