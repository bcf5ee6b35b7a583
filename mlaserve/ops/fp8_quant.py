"""FP8 (e4m3) block quantisation: weights in 128 x 128 blocks, activations in 1 x 128 groups.

Layouts (the published DeepSeek-V3 format; `group` = 128 unless said otherwise):

    weight      W_q [N, K] float8_e4m3fn, scale S_w [ceil(N/bn), ceil(K/group)] fp32,
                W[n, k] = W_q[n, k] * S_w[n // bn, k // group]          (bn = 128, or 1 when the
                scales are stored per output row; see `expand_scale_rows`)
    activation  x_q [M, K] float8_e4m3fn, scale S_x [M, ceil(K/group)] fp32,
                x[m, k] ~= x_q[m, k] * S_x[m, k // group]                 (dynamic: per forward)

Scales are amax / 448 (e4m3's largest finite value), floored at 1e-10 / 448 so an all-zero
group quantises to zeros instead of NaN. `per_token_group_quant_fp8` runs one Triton kernel on
CUDA (device-side only: graph-capturable) and the same math in torch elsewhere.
"""

from __future__ import annotations

import torch

from mlaserve.ops.fp8_layout import FP8_DTYPE, FP8_MAX, column_major_scale_buffer
from mlaserve.ops.triton_support import triton_available

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "column_major_scale_buffer",
    "dequantize_weight_block",
    "expand_scale_rows",
    "per_token_group_quant_fp8",
    "per_token_group_quant_fp8_torch",
    "quantize_weight_block",
    "triton_available",
]

_EPS = 1e-10  # amax floor: zero groups get a tiny positive scale, never a division by zero


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def quantize_weight_block(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, K] float -> (W_q [..., N, K] e4m3, S [..., ceil(N/bn), ceil(K/bk)] fp32).

    What DeepSeek's and the re-exporters' converters write: one scale per block, amax / 448.
    Partial edge blocks are zero-padded for the amax and cropped afterwards."""
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = _blocks(n, bn), _blocks(k, bk)
    padded = w.new_zeros(*lead, nb * bn, kb * bk, dtype=torch.float32)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(_EPS)  # [..., nb, kb]
    scale = amax / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale.contiguous()


def dequantize_weight_block(
    w_q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_weight_block` for any block size implied by the shapes:
    W_q [..., N, K], S [..., ceil(N/bn), ceil(K/bk)] -> W [..., N, K] in `dtype` (fp32 math)."""
    n, k = w_q.shape[-2:]
    bn = _block_size(n, scale.shape[-2])
    bk = _block_size(k, scale.shape[-1])
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]
    s = s.repeat_interleave(bk, dim=-1)[..., :k]
    return (w_q.float() * s).to(dtype)


def _block_size(n: int, num_blocks: int) -> int:
    """The block edge that gives `num_blocks` blocks over `n` (128, or 1 for per-row scales)."""
    for block in (128, 1):
        if _blocks(n, block) == num_blocks:
            return block
    raise ValueError(f"a scale with {num_blocks} blocks does not fit a dimension of {n}")


def expand_scale_rows(scale: torch.Tensor, n: int, block_n: int = 128) -> torch.Tensor:
    """[..., ceil(N/block_n), Kb] block scales -> [..., N, Kb] one row per output feature.

    Used where a layer stores several checkpoint tensors side by side (gate | up) and a shard's
    row count is not a multiple of block_n: its blocks would straddle the seam, so the layer keeps
    per-row scales (the GEMMs read scale[n // bn] either way; bn = 1 here)."""
    return scale.repeat_interleave(block_n, dim=-2)[..., :n, :].contiguous()


def per_token_group_quant_fp8_torch(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (x_q [M, K] e4m3, S [M, ceil(K/group)] fp32). The reference math."""
    m, k = x.shape
    kb = _blocks(k, group)
    padded = x.new_zeros(m, kb * group, dtype=torch.float32)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, group)
    scale = groups.abs().amax(dim=-1).clamp_min(_EPS) / FP8_MAX  # [M, Kb]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * group)[:, :k].contiguous(), scale


def per_token_group_quant_fp8(
    x: torch.Tensor, group: int = 128, *, column_major_scales: bool = False, align_rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, contiguous rows) -> (x_q [M, K] e4m3, S [M, ceil(K/group)] fp32).

    `column_major_scales` stores S column-major (`column_major_scale_buffer`, columns padded to
    `align_rows`), what torch's blockwise `scaled_mm` and flashinfer's SM100 GEMM want for the
    1x128 operand. On CUDA with Triton: one kernel launch, one program per (row, group);
    elsewhere the torch reference."""
    if x.dim() != 2:
        raise ValueError(f"per_token_group_quant_fp8: expected [M, K], got {list(x.shape)}")
    if not (x.is_cuda and triton_available()):
        q, s = per_token_group_quant_fp8_torch(x, group)
        if column_major_scales:
            s = column_major_scale_buffer(*s.shape, x.device, align_rows).copy_(s)
        return q, s
    from mlaserve.ops.fp8_triton import per_token_group_quant_fp8_triton

    return per_token_group_quant_fp8_triton(
        x, group, column_major_scales=column_major_scales, align_rows=align_rows
    )
