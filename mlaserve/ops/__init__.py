"""Compute kernels with no knowledge of the model: fused GPU kernels (Triton) for the decode
step's glue (KV write, q preparation, RMSNorm + residual add, RoPE, MoE routing, SiLU-and-mul,
MLA's per-head absorbed projections), launched with programmatic dependent launch where the GPU
has it (`pdl.py`), and FP8 block quantisation with block-scaled GEMMs (`fp8_*.py`).

Each op has one file with its kernel, its launcher and the shapes/dtypes/layouts it takes. The
torch code in `mlaserve/model` and `mlaserve/kv_cache` is the reference every kernel is tested
against, and stays the path on the CPU. Callers decide once, at construction, whether to use a
fused op (`fused_ops_enabled(device)`), never per call. Every launcher is CUDA-graph safe: no
host sync, outputs allocated with shapes that depend only on input shapes.

This package imports nothing else from mlaserve but `mlaserve/switches.py` (a leaf), so every
layer may depend on it.
"""

from __future__ import annotations

import torch

from mlaserve import switches
from mlaserve.ops.triton_support import triton_available

__all__ = ["fused_ops_enabled", "triton_available"]


def fused_ops_enabled(device: torch.device | str) -> bool:
    """Whether modules built for `device` use the fused kernels: CUDA with Triton installed.

    `MLASERVE_FUSED_OPS` (README, "Switches"): "0" turns them off (the unfused torch path is
    the reference), "1" also allows them off CUDA, under `TRITON_INTERPRET=1` (CPU tests)."""
    forced = switches.fused_ops()
    if forced is False or not triton_available():
        return False
    return torch.device(device).type == "cuda" or forced is True
