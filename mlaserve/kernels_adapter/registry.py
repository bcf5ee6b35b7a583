"""Name -> attention backend class, imported lazily so a missing kernel package only matters
when that backend is chosen."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

import torch

from mlaserve.kernels_adapter.base import BackendUnsupportedError

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.kernels_adapter.base import AttentionBackend

__all__ = ["available_backends", "get_backend_class", "resolve_backend_name"]

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, str] = {
    "reference": "mlaserve.kernels_adapter.reference:ReferenceBackend",
    "flashmla": "mlaserve.kernels_adapter.flashmla:FlashMLABackend",
}
# What `auto` tries, fastest first; `reference` runs everywhere.
_AUTO_ORDER = ("flashmla", "reference")


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; available: {available_backends()}"
        )
    module_name, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_backend_name(
    name: str,
    model_config: ModelConfig,
    page_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
) -> str:
    """`auto` picks the first backend of `_AUTO_ORDER` that can run this configuration; a named
    backend must be able to, or `BackendUnsupportedError` says why not."""
    if name != "auto":
        get_backend_class(name).check_supported(model_config, page_size, kv_cache_dtype, device)
        return name
    for candidate in _AUTO_ORDER:
        try:
            get_backend_class(candidate).check_supported(
                model_config, page_size, kv_cache_dtype, device
            )
        except BackendUnsupportedError as e:
            logger.debug("attention_backend auto: skipping %s (%s)", candidate, e)
            continue
        return candidate
    raise BackendUnsupportedError("no attention backend can run this configuration")
