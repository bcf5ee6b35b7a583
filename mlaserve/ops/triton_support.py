"""Whether Triton is installed (the one check every fused-kernel and FP8 path gates on), and
whether its kernels run under the interpreter (`TRITON_INTERPRET=1`: the CPU tests).

A leaf (imports nothing from mlaserve) so `ops/__init__.py`, the FP8 modules and `sampling/`
can share it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["INTERPRETER_SMS", "interpreting", "num_sms", "triton_available"]

INTERPRETER_SMS = 132  # what a grid rule sees off the GPU: an H100's count, as a GPU would split


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton runs its kernels in the interpreter (`TRITON_INTERPRET=1`), where some forms the
    GPU compiler takes (a `range` over a runtime bound, libdevice calls) need another spelling.
    Read at each call: the tests set it before the first kernel runs."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def num_sms(device: object) -> int:
    """Streaming multiprocessors of `device` (a torch.device); INTERPRETER_SMS off CUDA."""
    if getattr(device, "type", None) != "cuda":
        return INTERPRETER_SMS
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
