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


def _fixed_order_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's `create_dot` with numpy's einsum in place of its matmul: einsum's own
    loops reduce each output element over k in one order wherever its row sits, where a BLAS
    may treat a tile's edge rows apart. The operands' handling is the interpreter's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _convert_float

    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
        b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
    ):
        a_data = _convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        b_data = _convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
    acc = np.einsum("...ik,...kj->...ij", a_data, b_data, dtype=d.data.dtype, casting="unsafe")
    return TensorHandle(acc + d.data, d.dtype.scalar)


def row_invariant_interpreter_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the Triton interpreter's `tl.dot` give a row the same bits wherever it sits in its
    tile, on a host whose BLAS does not (`HOST_MATMUL_ROW_INVARIANT`; this CI's AMD host from
    2026-11-28 differs at row 63 of 64). Without it a bitwise batch-invariance check under the
    interpreter measures the host's BLAS, not the kernel. A no-op where the host's matmul is
    already invariant (the interpreter's own dot is then checked)."""
    if HOST_MATMUL_ROW_INVARIANT:
        return
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_dot", _fixed_order_dot)
