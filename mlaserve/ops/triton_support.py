"""Whether Triton is installed: the one check every fused-kernel and FP8 path gates on.

A leaf (imports nothing from mlaserve) so `ops/__init__.py` and the FP8 modules can share it.
"""

from __future__ import annotations

import functools
import importlib.util

__all__ = ["triton_available"]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
