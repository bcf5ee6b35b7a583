"""MLA's per-head GEMV (`ops/head_gemv.py`) vs its fp32 reference, in both weight layouts the
model passes (W_UK [H, d_n, r] with r contiguous, W_UV [H, r, d_v] with r contiguous), with x a
strided view (q_nope inside the q projection's rows) and `out` a view into wider rows.

Everything around the operands is NaN: x's rows sit in NaN-filled rows, and the weight is a view
into a NaN-filled buffer (the other half of kv_b_proj's heads), so a read outside the operands
turns outputs NaN. Rows of `out` past T stay NaN: nothing is stored past T.

Tolerance: |got - ref| <= eps(dtype) * |ref| + 1e-3 * max |ref| (one rounding to the output
dtype, fp32 accumulation in another order than torch's).

The joined query (`tail`: W_UK's products and q_pe in FlashMLA's [T, H, N + DR] layout, in x's
dtype or e4m3) must equal the two-kernel path bit for bit: on the GPU
`prepare_q(head_gemv(x, w), q_pe, dtype)`, under the interpreter the torch cat + clamp + cast of
the plain GEMV's products. fp8 outs run on the GPU only: Triton 3.6's interpreter casts to e4m3
wrongly when rounding carries into the exponent (31.0 -> 16.0; see test_kv_write.py).
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


def _operands(m, shape, which, device, scale=1.0):
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
    x.copy_(torch.randn(m, heads, k, generator=gen, device=device) * scale)
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


def test_token_limit_falls_with_the_ranks_heads():
    """8 tokens up to 32 heads (V2-Lite, V3 at TP4); 4 at V3's TP2 share, 2 at its 128, where
    cuBLAS's bmm was faster at 8 tokens. Never below one token."""
    pytest.importorskip("triton")
    from mlaserve.ops.head_gemv import HEAD_GEMV_MAX_M, head_gemv_max_m

    assert [head_gemv_max_m(h) for h in (1, 16, 32, 64, 128, 4096)] == [
        HEAD_GEMV_MAX_M, 8, 8, 4, 2, 1
    ]  # fmt: skip


FP8 = torch.float8_e4m3fn
V2LITE_DR = 64  # qk_rope_head_dim
JOINED_GPU = [
    gpu_case(m, "v2lite", V2LITE_DR, layout, out)
    for m in (1, 2, 7, 8)
    for layout in ("view", "contiguous")
    for out in ("model", "fp8")
]
JOINED_CPU = [
    cpu_case(1, "ragged", 12, "view", "model"),
    cpu_case(3, "ragged", 24, "contiguous", "model"),
    cpu_case(8, "ragged", 12, "contiguous", "model"),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("m", "shape", "dr", "layout", "out", "device"), JOINED_GPU + JOINED_CPU)
def test_joined_query_equals_gemv_then_q_prep(m, shape, dr, layout, out, device):
    from mlaserve.ops.head_gemv import head_gemv

    # x large enough that some products and q_pe values pass e4m3's +-448 (the saturation)
    x, w, _, _ = _operands(m, SHAPES[shape], "uk", device, scale=600.0)
    heads, n = x.shape[1], w.shape[2]
    gen = torch.Generator(device=device).manual_seed(m)
    if layout == "view":  # q_pe beside q_nope in the q projection's rows (NaN past it)
        q_pe = x.as_strided((m, heads, dr), x.stride(), x.storage_offset() + x.shape[2])
    else:  # mla_norm_rope's output: contiguous, NaN rows past T
        q_pe = torch.full((m + 1, heads, dr), float("nan"), dtype=x.dtype, device=device)[:m]
    q_pe.copy_(torch.randn(m, heads, dr, generator=gen, device=device) * 300)
    dtype = FP8 if out == "fp8" else x.dtype
    out_rows = torch.empty(m + 2, heads, n + dr + 8, dtype=dtype, device=device)
    out_rows.view(torch.uint8).fill_(0xFF)  # all-ones bytes: NaN in e4m3, bf16 and fp16
    got = head_gemv(x, w, out=out_rows[:m, :, : n + dr], tail=q_pe)
    assert got.data_ptr() == out_rows.data_ptr() and got.dtype == dtype
    if device == "cuda":
        from mlaserve.ops.q_prep import prepare_q

        want = prepare_q(head_gemv(x, w), q_pe, dtype)
    else:
        want = torch.cat([head_gemv(x, w), q_pe], dim=-1)  # products rounded to x's dtype
        if dtype == FP8:
            want = want.float().clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max)
        want = want.to(dtype)
    if dtype == FP8:  # the clamp was exercised
        assert (want.float().abs() == torch.finfo(FP8).max).any()
    assert torch.equal(_bytes(got), _bytes(want)), "joined query differs from the two kernels"
    assert (_bytes(out_rows[m:]) == 0xFF).all() and (_bytes(out_rows[:m, :, -8:]) == 0xFF).all()


@pytest.mark.parametrize("device", ["cpu"])
def test_head_gemv_rejects_a_tail_or_out_that_does_not_fit(device):
    from mlaserve.ops.head_gemv import head_gemv

    f16 = torch.float16
    x, w = torch.zeros(2, 4, 8, dtype=f16), torch.zeros(4, 8, 16, dtype=f16)
    pe = torch.zeros(2, 4, 6, dtype=f16)
    q = torch.zeros(2, 4, 22, dtype=f16)
    with pytest.raises(ValueError, match="tail must be"):
        head_gemv(x, w, out=q, tail=torch.zeros(2, 3, 6, dtype=f16))
    with pytest.raises(ValueError, match="tail must be"):
        head_gemv(x, w, out=q, tail=pe.float())
    with pytest.raises(ValueError, match="tail needs a contiguous last dim"):
        head_gemv(x, w, out=q, tail=pe.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="a tail needs `out`"):
        head_gemv(x, w, tail=pe)
    with pytest.raises(ValueError, match=r"out must be \[2, 4, 22\]"):
        head_gemv(x, w, out=torch.zeros(2, 4, 16, dtype=f16), tail=pe)
    with pytest.raises(ValueError, match="out must be"):
        head_gemv(x, w, out=q.to(torch.bfloat16), tail=pe)
    with pytest.raises(ValueError, match="out must be"):
        head_gemv(x, w, out=torch.zeros(2, 22, 4, dtype=f16).transpose(1, 2), tail=pe)
    with pytest.raises(ValueError, match="out must be"):  # without a tail: x's dtype only
        head_gemv(x, w, out=torch.zeros(2, 4, 16, dtype=FP8))


def test_warm_up_tasks_one_per_variant(monkeypatch):
    """`head_gemv_warm_up_tasks`: per M bucket one plain task and, with a tail, one joined task
    per output dtype, each a single call with the laid-out strides. Calls recorded (CPU)."""
    from mlaserve.ops import head_gemv as module

    ran = []

    def record(x, w, out=None, tail=None):
        ran.append((x.shape[0], x.stride()[:2], None if out is None else out.dtype))

    monkeypatch.setattr(module, "head_gemv", record)
    heads, k, n, dr = 4, 16, 32, 8
    w = torch.zeros(heads, k, n)
    tasks = module.head_gemv_warm_up_tasks(
        (heads * (k + dr), k + dr), heads, w, 3, tail=(dr, (heads * (k + dr), k + dr)),
        out_dtypes=(torch.float32, torch.float16),
    )  # fmt: skip
    for task in tasks:
        task()
    strides = (heads * (k + dr), k + dr)
    assert ran == [
        (m, strides, out) for m in (1, 2) for out in (None, torch.float32, torch.float16)
    ]
