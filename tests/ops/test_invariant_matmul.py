"""The batch-invariant matmul (`ops/invariant_matmul.py`): against its fp32 torch form, and
invariant itself, bitwise.

Accuracy: each case against `rowwise_matmul` (fp32 products and sums, rounded once); the
operands are the leading rows and columns of NaN-filled buffers (x's rows end in NaN past K, and
NaN rows follow the last one), so a read past K or past M shows as NaN. Tolerance:
|got - ref| <= eps(out dtype) * |ref| + 1e-3 * max |ref| (the one rounding, plus fp32 sums in
another order); fp32 outputs 1e-5 relative.

Invariance: the same rows computed alone, inside batches of 1, 3, 17 and 64 rows (at different
offsets in the tile), and next to rows of garbage (huge values, NaN): identical bits.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.ops.fp8_quant import expand_scale_rows, quantize_weight_block
from mlaserve.ops.invariant_rowwise import rowwise_head_matmul, rowwise_matmul
from tests.ops.cases import cpu_case, gpu_case, model_dtype, row_invariant_interpreter_dot

# (N, K) at serving sizes: the default model (hidden 256, q_lora 64, latent 576, vocab 4096) and
# V3-lite (hidden 2048, q 3072 + latent 576, experts' shared MLP, vocab 102400)
GPU_SHAPES = {
    "default_q_kv_a": (640, 256),
    "default_q_b": (1280, 64),
    "default_o": (256, 256),
    "default_lm_head": (4096, 256),
    "v3lite_q_kv_a": (3648, 2048),
    "v3lite_o": (2048, 2048),
    "v3lite_shared_gate_up": (5632, 2048),
    "v3lite_lm_head": (102400, 2048),
    "ragged": (1000, 1400),
}
GPU_CASES = [
    gpu_case(shape, weights)
    for shape in GPU_SHAPES
    for weights in ("dtype", "fp8_block", "fp8_row", "fp32_router")
    if not (weights == "fp32_router" and GPU_SHAPES[shape][0] > 4096)
]
# (N, K, weights): tiny, the interpreter runs each program in numpy
CPU_CASES = [
    cpu_case((24, 96), "dtype"),
    cpu_case((130, 200), "dtype"),
    cpu_case((70, 260), "fp8_block"),
    cpu_case((70, 260), "fp8_row"),
    cpu_case((8, 64), "fp32_router"),
]
BATCHES = (1, 3, 17, 64)


def _weights(n, k, weights, device, gen):
    """(w, scale, x dtype, out dtype)"""
    w = torch.randn(n, k, generator=gen, device=device) / k**0.5
    dtype = model_dtype(device)
    if weights == "dtype":
        return w.to(dtype), None, dtype, dtype
    if weights == "fp32_router":
        return w, None, dtype, torch.float32
    wq, scale = quantize_weight_block(w)
    if weights == "fp8_row":
        scale = expand_scale_rows(scale, n)
    return wq, scale, dtype, dtype


def _poisoned_x(rows, k, dtype, device, gen):
    """[rows, K] view of a NaN buffer: each row's stride is K + 16 (NaN past K), NaN rows after."""
    buf = torch.full((rows + 4, k + 16), float("nan"), dtype=dtype, device=device)
    buf[:rows, :k] = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    return buf[:rows, :k]


def _check_close(got, ref):
    assert not got.isnan().any()
    g, r = got.float(), ref.float()
    eps = 1e-5 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    tol = eps * r.abs() + 1e-3 * r.abs().max()
    assert ((g - r).abs() <= tol).all(), (g - r).abs().max()


@pytest.mark.parametrize(("shape", "weights", "device"), [*CPU_CASES, *GPU_CASES])
def test_matches_fp32_reference_and_is_batch_invariant(shape, weights, device, monkeypatch):
    from mlaserve.ops.invariant_matmul import invariant_matmul

    if device == "cpu":
        row_invariant_interpreter_dot(monkeypatch)
    n, k = GPU_SHAPES.get(shape, shape)
    gen = torch.Generator(device=device).manual_seed(0)
    w, scale, x_dtype, out_dtype = _weights(n, k, weights, device, gen)
    x = _poisoned_x(64, k, x_dtype, device, gen)
    y = invariant_matmul(x, w, scale, out_dtype=out_dtype)
    assert y.shape == (64, n) and y.dtype == out_dtype
    _check_close(y, rowwise_matmul(x, w, scale, out_dtype=out_dtype))
    # Invariance on the fp32 accumulator itself (rounding to a 16-bit output would hide most
    # changes of summation order), and on the served output.
    y32 = invariant_matmul(x, w, scale, out_dtype=torch.float32)
    for m in BATCHES:
        for start in {0, 64 - m}:  # the same rows at another offset in their tile
            rows = slice(start, start + m)
            got = invariant_matmul(x[rows], w, scale, out_dtype=torch.float32)
            assert torch.equal(got, y32[rows]), (m, start)
            assert torch.equal(invariant_matmul(x[rows], w, scale, out_dtype=out_dtype), y[rows])
    # real rows beside garbage rows (padding to a graph bucket holds anything)
    garbage = torch.cat([x[:5], torch.full_like(x[:11], 1e3)]).contiguous()
    garbage[7] = float("nan")
    got = invariant_matmul(garbage, w, scale, out_dtype=torch.float32)
    assert torch.equal(got[:5], y32[:5])


@pytest.mark.parametrize(
    ("h", "n", "k", "transposed", "device"),
    [
        cpu_case(3, 24, 40, False),
        cpu_case(2, 48, 16, True),  # W_UK's layout: w[h] a transposed view
        gpu_case(16, 512, 16, True),  # default model W_UK: [T, 16, 16] -> [T, 16, 512]
        gpu_case(16, 16, 512, False),  # default model W_UV
        gpu_case(16, 512, 128, True),  # V3-lite W_UK
        gpu_case(16, 128, 512, False),  # V3-lite W_UV
    ],
)
def test_head_matmul_matches_reference_and_is_invariant(h, n, k, transposed, device):
    from mlaserve.ops.invariant_matmul import invariant_head_matmul

    gen = torch.Generator(device=device).manual_seed(1)
    dtype = model_dtype(device)
    if transposed:  # [H, K, N] storage read as [H, N, K]
        w = torch.randn(h, k, n, generator=gen, device=device).to(dtype).transpose(1, 2)
    else:
        w = torch.randn(h, n, k, generator=gen, device=device).to(dtype)
    buf = torch.full((70, h + 1, k), float("nan"), dtype=dtype, device=device)
    buf[:64, :h] = torch.randn(64, h, k, generator=gen, device=device).to(dtype)
    x = buf[:64, :h]  # head stride free, NaN head after the last
    y = invariant_head_matmul(x, w)
    _check_close(y, rowwise_head_matmul(x, w))
    for m in BATCHES:
        assert torch.equal(invariant_head_matmul(x[64 - m :], w), y[64 - m :]), m


def test_torch_form_is_batch_invariant():
    """The CPU path: one row at a time, so rows never see each other."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(40, 33, generator=gen)
    x = torch.randn(17, 33, generator=gen)
    y = rowwise_matmul(x, w)
    for m in (1, 3, 17):
        assert torch.equal(rowwise_matmul(x[:m], w), y[:m])
    wh = torch.randn(3, 8, 33, generator=gen)
    xh = torch.randn(17, 3, 33, generator=gen)
    yh = rowwise_head_matmul(xh, wh)
    assert torch.equal(rowwise_head_matmul(xh[:1], wh), yh[:1])


def test_refuses_mismatched_operands():
    from mlaserve.ops.invariant_matmul import invariant_matmul

    with pytest.raises(ValueError, match="weight"):
        invariant_matmul(torch.zeros(2, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="FP8"):
        invariant_matmul(torch.zeros(2, 8), torch.zeros(4, 8), torch.ones(1, 1))
