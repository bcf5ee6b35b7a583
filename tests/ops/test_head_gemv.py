"""MLA's absorbed per-head projections (`ops/head_gemv.py`) vs torch.bmm in fp32, on the weight
views `MLAAttention` keeps (W_UK [H, d_n, r] and W_UV [H, r, d_v] of one kv_b_proj). Inputs are
views into NaN-filled buffers (past T tokens, past the heads' used columns), so a read outside
them fails. Tolerance: one rounding of the output, 1e-2 x max |ref| + 2 eps |ref| (bf16/fp16).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case, model_dtype

# (H, d_n, r, d_v): V2-Lite, V3 (128 heads), and a tiny ragged one for the interpreter
SHAPES = {"v2lite": (16, 128, 512, 128), "v3": (128, 128, 512, 128), "tiny": (3, 24, 40, 20)}
CASES = [gpu_case(t, s) for t in (1, 2, 3, 8) for s in ("v2lite", "v3")] + [
    cpu_case(1, "tiny"),
    cpu_case(3, "tiny"),
]


@pytest.mark.parametrize("tokens,shape,device", CASES)
def test_head_gemv_matches_bmm(tokens, shape, device):
    from mlaserve.ops.head_gemv import head_gemv

    h, dn, r, dv = SHAPES[shape]
    dtype = model_dtype(torch.device(device))
    gen = torch.Generator(device=device).manual_seed(tokens + h)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    kv_b = randn(h, dn + dv, r) / r**0.5  # as process_weights_after_loading views it
    w_uk, w_uv = kv_b[:, :dn, :], kv_b[:, dn:, :].transpose(1, 2)
    q = torch.full((tokens + 2, h, dn + 8), float("nan"), dtype=dtype, device=device)
    q[:tokens] = randn(tokens, h, dn + 8)
    q[:tokens, :, dn:] = float("nan")  # the rope part: never read by the W_UK product
    o_buf = torch.full((tokens + 2, h, r), float("nan"), dtype=dtype, device=device)
    o_buf[:tokens] = randn(tokens, h, r)
    for x, w in ((q[:tokens, :, :dn], w_uk), (o_buf[:tokens], w_uv)):
        got = head_gemv(x, w)
        want = torch.bmm(x.float().transpose(0, 1), w.float()).transpose(0, 1)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        assert not got.isnan().any()
        bound = 1e-2 * want.abs().max() + 2 * torch.finfo(dtype).eps * want.abs()
        assert ((got.float() - want).abs() <= bound).all()


def test_head_gemv_refuses_what_does_not_fit():
    from mlaserve.ops.head_gemv import head_gemv

    x, w = torch.zeros(2, 3, 8), torch.zeros(3, 8, 5)
    with pytest.raises(ValueError, match="do not match"):
        head_gemv(x, torch.zeros(3, 7, 5))
    with pytest.raises(ValueError, match="one float dtype"):
        head_gemv(x.half(), w)
    with pytest.raises(ValueError, match="contiguous last dim"):
        head_gemv(x.transpose(1, 2).transpose(1, 2).as_strided((2, 3, 8), (1, 2, 6)), w)
    with pytest.raises(ValueError, match="tokens"):
        head_gemv(torch.zeros(9, 3, 8), w)
