"""Where and at which shapes the kernel tests run: the GPU at serving shapes, or the CPU under
Triton's interpreter at tiny ones (it runs each program in numpy, one at a time)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
]
interpreted = [
    # With CUDA the kernels are compiled (see conftest.py) and the gpu cases cover them.
    pytest.mark.skipif(HAS_CUDA, reason="the GPU cases run instead"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton (TRITON_INTERPRET=1 on the CPU)"),
]

# Decode batch sizes and an EXTEND-sized chunk.
GPU_TOKENS = [1, 2, 7, 8, 31, 64, 2048]


def gpu_case(*values: object) -> object:
    return pytest.param(*values, "cuda", marks=gpu, id="cuda-" + "-".join(map(str, values)))


def cpu_case(*values: object) -> object:
    return pytest.param(
        *values, "cpu", marks=interpreted, id="interp-" + "-".join(map(str, values))
    )


def fp8_within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3 values agree exactly or differ by one representable step (3 mantissa bits), which
    is how a tie rounded the other way would show up."""
    g, w = got.float(), want.float()
    assert not g.isnan().any()
    step = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-6))) - 3)
    bad = (g - w).abs() > step
    assert not bad.any(), f"{int(bad.sum())} values differ: {g[bad][:8]} vs {w[bad][:8]}"
    assert (g == w).float().mean() > 0.99


def model_dtype(device: str) -> torch.dtype:
    """bf16 on the GPU (the serving dtype). fp16 under the interpreter: it emulates bf16 casts
    in numpy by truncating (fp32 -> bf16 rounds toward zero), fp16 it rounds correctly."""
    return torch.bfloat16 if device == "cuda" else torch.float16


def _host_matmul_row_invariant() -> bool:
    """Whether this host's numpy float32 matmul (the Triton interpreter's `tl.dot`, on tiles of
    one fixed shape) gives a row the same bits wherever it sits in the tile. Where it does not (a
    BLAS that handles a tile's last rows apart, as this CI's AMD host from 2026-11-28 does at row
    63 of 64), a bitwise batch-invariance check run under the interpreter measures the host's
    BLAS, not the kernel: it runs on GPUs only there."""
    import numpy as np

    rng = np.random.default_rng(0)
    row = rng.standard_normal(96).astype(np.float32)
    b = rng.standard_normal((96, 64)).astype(np.float32)
    got = []
    for position in (0, 17, 63):
        tile = rng.standard_normal((64, 96)).astype(np.float32)
        tile[position] = row
        got.append((tile @ b)[position])
    return all(np.array_equal(g, got[0]) for g in got[1:])


HOST_MATMUL_ROW_INVARIANT = _host_matmul_row_invariant()
NOT_ROW_INVARIANT_HOST = (
    "this host's numpy matmul gives a row other bits at another position of the same-shaped "
    "tile, so the interpreter cannot check bitwise batch invariance here; the GPU variant does"
)
