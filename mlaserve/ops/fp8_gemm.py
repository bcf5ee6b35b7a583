"""Block-scaled FP8 linear: y = x @ W^T with W stored as e4m3 + 128 x 128 block scales.

    block_fp8_linear(x [..., K] bf16/fp16/fp32, W_q [N, K] e4m3, S_w [N/bn, Kb] fp32) -> [..., N]

Steps: quantise x per token and 128-wide group (dynamic, `fp8_quant`), then one block-scaled
GEMM. Which GEMM (`gemm_backend`, a pure function of the device and the shape, decided on the
host; nothing reads device memory, so the whole op is graph-capturable):

    triton           `fp8_triton.w8a8_block_fp8_matmul_triton` (SGLang/vLLM's design). Decode-
                     sized M is memory-bound; this kernel streams the FP8 weight once, half the
                     bytes of bf16. Runs on SM89+ (SM90 and SM100 included).
    torch_blockwise  torch's own `F.scaled_mm` with ScalingType.BlockWise1x128 (x) x
                     BlockWise128x128 (W). Measured on an H100 (torch 2.11): faster than bf16 at
                     M = 2048 (32 us vs 48 us at 2048x4096x2048), slower at M <= 64, and M = 1 is
                     rejected; so only for M >= TORCH_BLOCKWISE_MIN_M with N, K multiples of 128
                     and true 128-row weight blocks. SM90 and SM100 (torch routes both through
                     its blockwise recipe; an SM100 build that rejects it fails loudly at the
                     first prefill, never silently).
    emulated         no Triton or no CUDA (CPU): the same quantised activations times the
                     dequantised weight, in fp32. The CPU reference; slow, exact math.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from mlaserve.ops.fp8_quant import (
    dequantize_weight_block,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_torch,
    triton_available,
)

__all__ = [
    "TORCH_BLOCKWISE_MIN_M",
    "GemmBackend",
    "block_fp8_linear",
    "block_fp8_matmul_reference",
    "gemm_backend",
]

GemmBackend = Literal["triton", "torch_blockwise", "emulated"]
# Below this M torch's blockwise scaled_mm loses to bf16 (and to the memory-bound Triton kernel).
# Measured points: loses at 16 and 64, wins at 2048; bench/fp8_gemm.py refines the crossover.
TORCH_BLOCKWISE_MIN_M = 256


def gemm_backend(
    device: torch.device, m: int, n: int, k: int, scale_rows: int, *, has_triton: bool = True
) -> GemmBackend:
    """The GEMM for an [m, k] x [n, k]^T product whose weight scale has `scale_rows` rows."""
    if device.type != "cuda" or not has_triton:
        return "emulated"
    major = torch.cuda.get_device_capability(device)[0]
    return _choose(major, m, n, k, scale_rows)


def _choose(major: int, m: int, n: int, k: int, scale_rows: int) -> GemmBackend:
    block_scales = scale_rows * 128 == n  # not per-row, no partial last block
    if major in (9, 10) and m >= TORCH_BLOCKWISE_MIN_M and k % 128 == 0 and block_scales:
        return "torch_blockwise"
    return "triton"


def block_fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: GemmBackend | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype. W_q [N, K] e4m3, S_w [ceil(N/128) or N, ceil(K/128)].

    `backend` forces a GEMM (tests, bench); None picks by `gemm_backend`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w_q.shape[0]
    if backend is None:
        backend = gemm_backend(x.device, m, n, k, w_s.shape[0], has_triton=triton_available())
    if backend == "emulated":
        x_q, x_s = per_token_group_quant_fp8_torch(x2)
        x_deq = dequantize_weight_block(x_q, x_s)  # [M, Kb] scales = 1 x 128 blocks
        y = (x_deq @ dequantize_weight_block(w_q, w_s).t()).to(x.dtype)
    elif backend == "torch_blockwise":
        x_q, x_s = per_token_group_quant_fp8(x2, column_major_scales=True)
        y = F.scaled_mm(
            x_q,
            w_q.t(),  # [K, N] column-major view: what the kernel wants for B
            x_s,  # [M, Kb], column-major
            F.ScalingType.BlockWise1x128,
            w_s.t(),  # [Kb, Nb] view of the [Nb, Kb] block scales
            F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        )
    else:
        from mlaserve.ops.fp8_triton import w8a8_block_fp8_matmul_triton

        x_q, x_s = per_token_group_quant_fp8(x2)
        y = w8a8_block_fp8_matmul_triton(x_q, x_s, w_q, w_s, out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, n)


def block_fp8_matmul_reference(
    x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor
) -> torch.Tensor:
    """What the quantised operands represent, multiplied in float64 on their device:
    x_q [M, K], x_s [M, Kb], W_q [N, K], S_w [N/bn, Kb] -> [M, N] float64. The GEMM oracle."""
    x = dequantize_weight_block(x_q, x_s, torch.float64)
    w = dequantize_weight_block(w_q, w_s, torch.float64)
    return x @ w.t()
