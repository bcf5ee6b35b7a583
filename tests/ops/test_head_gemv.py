"""MLA's per-head GEMV (`ops/head_gemv.py`) vs its fp32 reference, in both weight layouts the
model passes (W_UK [H, d_n, r] with r contiguous, W_UV [H, r, d_v] with r contiguous), with x a
strided view (q_nope inside the q projection's rows) and `out` a view into wider rows.

Everything around the operands is NaN: x's rows sit in NaN-filled rows, and the weight is a view
into a NaN-filled buffer (the other half of kv_b_proj's heads), so a read outside the operands
turns outputs NaN. Rows of `out` past T stay NaN: nothing is stored past T.

Tolerance: |got - ref| <= eps(dtype) * |ref| + 1e-3 * max |ref| (one rounding to the output
dtype, fp32 accumulation in another order than torch's).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype

# name: (H, d_n, r, d_v): heads, nope dim, latent rank, value dim
SHAPES = {
    "v2lite": (16, 128, 512, 128),
    "v3": (128, 128, 512, 128),
    "ragged": (5, 40, 72, 24),  # nothing a power of two
}
GPU_CASES = [gpu_case(m, s, which) for m in (1, 2, 3, 8) for s in SHAPES for which in ("uk", "uv")]
CPU_CASES = [
    cpu_case(m, "ragged", which) for m, which in ((1, "uk"), (3, "uv"), (8, "uk"), (2, "uv"))
]


def _operands(m, shape, which, device):
    """-> (x [T, H, K] view, w [H, K, N] view, out [T, H, N] view, the out buffer)."""
    heads, d_n, r, d_v = shape
    dtype = model_dtype(device)
    gen = torch.Generator(device=device).manual_seed(m * 7 + heads)
    # kv_b_proj's weight [H, d_n + d_v, r], NaN in the half this product does not read
    kv_b = torch.randn(heads, d_n + d_v, r, generator=gen, device=device) / r**0.5
    if which == "uk":
        kv_b[:, d_n:] = float("nan")
        w = kv_b.to(dtype)[:, :d_n, :]  # [H, d_n, r]: N contiguous
        k, row = d_n, d_n + 64  # x: q_nope inside [T, H, d_n + d_r] rows (+ a kv tail)
    else:
        kv_b[:, :d_n] = float("nan")
        w = kv_b.to(dtype)[:, d_n:, :].transpose(1, 2)  # [H, r, d_v]: K contiguous
        k, row = r, r
    n = w.shape[2]
    x_rows = torch.full((m + 2, heads * row + 32), float("nan"), dtype=dtype, device=device)
    x = x_rows[:m, : heads * row].view(m, heads, row)[:, :, :k]
    x.copy_(torch.randn(m, heads, k, generator=gen, device=device))
    out_rows = torch.full((m + 2, heads, n + 8), float("nan"), dtype=dtype, device=device)
    return x, w, out_rows[:m, :, :n], out_rows


@pytest.mark.parametrize(("m", "shape", "which", "device"), GPU_CASES + CPU_CASES)
def test_head_gemv_matches_reference(m, shape, which, device):
    from mlaserve.ops.head_gemv import head_gemv

    x, w, out, out_rows = _operands(m, SHAPES[shape], which, device)
    ref = torch.einsum("thk,hkn->thn", x.float(), w.float())
    got = head_gemv(x, w, out=out)
    assert got.data_ptr() == out.data_ptr()
    tol = torch.finfo(x.dtype).eps * ref.abs() + 1e-3 * ref.abs().max()
    assert torch.all((got.float() - ref).abs() <= tol), f"max err {(got.float() - ref).abs().max()}"
    assert torch.isnan(out_rows[m:]).all() and torch.isnan(out_rows[:m, :, -8:]).all()
    fresh = head_gemv(x, w)  # allocated output: the same bits
    assert torch.equal(fresh, got)


@pytest.mark.parametrize("device", ["cpu"])
def test_head_gemv_rejects_what_does_not_fit(device):
    from mlaserve.ops.head_gemv import HEAD_GEMV_MAX_M, head_gemv

    x = torch.zeros(2, 4, 8, dtype=torch.float16)
    w = torch.zeros(4, 8, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not fit"):
        head_gemv(x, torch.zeros(4, 9, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="one float dtype"):
        head_gemv(x, w.float())
    with pytest.raises(ValueError, match="token rows"):
        head_gemv(torch.zeros(HEAD_GEMV_MAX_M + 1, 4, 8, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        head_gemv(x.transpose(1, 2).contiguous().transpose(1, 2), w)
    with pytest.raises(ValueError, match="out must be"):
        head_gemv(x, w, out=torch.zeros(2, 4, 15, dtype=torch.float16))
