"""Whether Triton is installed (the one check every fused-kernel and FP8 path gates on), and
whether its kernels run under the interpreter (`TRITON_INTERPRET=1`: the CPU tests).

A leaf (imports nothing from mlaserve) so `ops/__init__.py`, the FP8 modules and `sampling/`
can share it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["interpreting", "triton_available"]


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton runs its kernels in the interpreter (`TRITON_INTERPRET=1`), where some forms the
    GPU compiler takes (a `range` over a runtime bound, libdevice calls) need another spelling.
    Read at each call: the tests set it before the first kernel runs."""
    return os.environ.get("TRITON_INTERPRET") == "1"
