"""Fixtures for the model tests: tiny checkpoints, written once per session."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# `tests.checkpoints` is shared by every test package; make the repository root importable
# however pytest was started (it only puts the test's own package root on sys.path).
_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.checkpoints import make_checkpoint  # noqa: E402


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
