"""Attention kernels behind one narrow interface (`base.AttentionBackend`) and a registry.

`reference` is pure torch, runs everywhere and is the oracle every other backend is tested
against.
"""

from mlaserve.kernels_adapter.base import AttentionBackend, BackendUnsupportedError
from mlaserve.kernels_adapter.registry import (
    available_backends,
    get_backend_class,
    resolve_backend_name,
)

__all__ = [
    "AttentionBackend",
    "BackendUnsupportedError",
    "available_backends",
    "get_backend_class",
    "resolve_backend_name",
]
