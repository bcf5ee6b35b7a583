"""Name -> attention backend class, imported lazily so a missing kernel package only matters
when that backend is chosen."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlaserve.kernels_adapter.base import AttentionBackend

__all__ = ["available_backends", "get_backend_class", "resolve_backend_name"]

_BACKENDS: dict[str, str] = {
    "reference": "mlaserve.kernels_adapter.reference:ReferenceBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto` picks the fastest backend known to run on this device."""
    if name != "auto":
        return name
    return "reference"


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; available: {available_backends()}"
        )
    module_name, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)
