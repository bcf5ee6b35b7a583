"""Block-scaled FP8 linear: y = x @ W^T with W stored as e4m3 + 128 x 128 block scales.

    block_fp8_linear(x [..., K] bf16/fp16/fp32, W_q [N, K] e4m3, S_w [N/bn, Kb] fp32) -> [..., N]

Steps: quantise x per token and 128-wide group (dynamic, `fp8_quant`), then one block-scaled
GEMM. Which GEMM (`gemm_backend`: a pure function of the device, the shape and the dtype,
decided on the host; nothing reads device memory, so the whole op is graph-capturable):

    triton_w8a16     W8A16_MIN_M <= M <= W8A16_MAX_M, SM90 (and SM100 without flashinfer):
                     `w8a16_gemm.w8a16_block_fp8_matmul_triton`, the FP8 weight widened to the
                     activations' dtype in registers. One launch where W8A8 takes an activation
                     quantisation, a split-K GEMM and its reduction, whose launches alone made
                     a decode-sized W8A8 step slower than bf16 (bench/RESULTS.md). Exact
                     activations, and the same FP8 weight bytes. Up to `W8A16_WIDE_MAX_M` rows
                     its decode kernel puts 2-4 K blocks' weight tiles in flight a loop step.
    triton           `fp8_triton.w8a8_block_fp8_matmul_triton` (SGLang/vLLM's design). Decode-
                     sized M is memory-bound; this kernel streams the FP8 weight once, half the
                     bytes of bf16. Any SM89+ GPU, SM90 and SM100 included; the fallback for
                     every shape the others refuse (partial blocks, per-row scales).
    torch_blockwise  SM90, M >= TORCH_BLOCKWISE_MIN_M: torch's own `F.scaled_mm` with
                     ScalingType.BlockWise1x128 (x) x BlockWise128x128 (W), i.e. cuBLASLt's
                     VEC128 / BLK128x128 scale modes. Faster than bf16 at prefill sizes, slower
                     at M <= 64 (`bench/fp8_gemm.py`), M = 1 rejected (torch 2.11). NVIDIA
                     documents those cuBLASLt scale modes as
                     SM90-only (CUDALibrarySamples issues 270, 310), so not on SM100.
    flashinfer       SM100 with flashinfer installed (`pip install '.[blackwell]'`):
                     `flashinfer.gemm.gemm_fp8_nt_groupwise(..., backend="trtllm")`, the
                     Blackwell kernel SGLang dispatches block-FP8 linears to at every M. Needs
                     bf16 activations, K >= 256, N and K multiples of 128; column-major 1x128
                     activation scales, [N/128, K/128] weight scales as stored. Written against
                     the documented API and contract-tested; not run here (no B200).
    emulated         no Triton or no CUDA (CPU): the same quantised activations times the
                     dequantised weight, in fp32. The CPU reference; slow, exact math.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    "FP8_WARM_UP_TOKENS",
    "TORCH_BLOCKWISE_MIN_M",
    "W8A16_MAX_M",
    "W8A16_MIN_M",
    "GemmBackend",
    "block_fp8_linear",
    "block_fp8_matmul_reference",
    "choose_gemm",
    "flashinfer_available",
    "fp8_gemm_warm_up_tasks",
    "gemm_backend",
]

GemmBackend = Literal["triton_w8a16", "triton", "torch_blockwise", "flashinfer", "emulated"]
# Below this M torch's blockwise scaled_mm loses to bf16 (and to the memory-bound Triton kernel);
# bench/fp8_gemm.py measures the crossover.
TORCH_BLOCKWISE_MIN_M = 256
# From W8A16_MIN_M to W8A16_MAX_M tokens the W8A16 kernel: memory- and launch-bound sizes, where
# the activation quantisation W8A8 needs costs more than the fp8 tensor-core rate gains. One
# token included: its decode kernel (several K blocks in flight a step) beats the split-K W8A8
# GEMM there on V3's shapes (bench/gemv.py, bench/RESULTS.md), with exact activations.
W8A16_MIN_M = 1
W8A16_MAX_M = 64
# A token count for each Triton variant `block_fp8_linear` runs on SM90 (`fp8_gemm_warm_up_tasks`):
# the W8A16 decode kernel (up to 16 rows), the W8A16 GEMM's 32- and 64-row tiles, W8A8 (its
# activation quantisation and GEMM), and the blockwise GEMM's activation quantisation (column-
# major scales). Those kernels take M unspecialised, so one count stands for its whole range.
FP8_WARM_UP_TOKENS = (2, 17, 33, W8A16_MAX_M + 1, TORCH_BLOCKWISE_MIN_M)


@functools.cache
def flashinfer_available() -> bool:
    try:
        from flashinfer.gemm import gemm_fp8_nt_groupwise  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def gemm_backend(
    device: torch.device, m: int, n: int, k: int, scale_rows: int, dtype: torch.dtype
) -> GemmBackend:
    """The GEMM for an [m, k] x [n, k]^T product in `dtype` whose weight scale has
    `scale_rows` rows, on `device` as it is (installed packages included)."""
    if device.type != "cuda" or not triton_available():
        return "emulated"
    has_flashinfer = _major(device) == 10 and flashinfer_available()
    return choose_gemm(_major(device), m, n, k, scale_rows, dtype, has_flashinfer=has_flashinfer)


def choose_gemm(
    major: int,
    m: int,
    n: int,
    k: int,
    scale_rows: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    has_flashinfer: bool = False,
) -> GemmBackend:
    """The dispatch rule itself, for a GPU of compute capability `major`.x (see module doc)."""
    blocks = n % 128 == 0 and k % 128 == 0 and scale_rows * 128 == n  # true 128x128 blocks
    # torch 2.11's blockwise scaled_mm wants the K-block count padded to a multiple of 4 in its
    # scale layout (H100: "scale_b must have shape 12 x 16" for K = 1408, 11 blocks), and the
    # activation scales' columns exactly M apart, which their 4-row alignment gives only when
    # 4 divides M (H100, M = 257: "scale_a must have strides (1, 257)").
    if major == 9 and blocks and (k // 128) % 4 == 0 and m >= TORCH_BLOCKWISE_MIN_M and m % 4 == 0:
        return "torch_blockwise"
    if major == 10 and has_flashinfer and blocks and k >= 256 and dtype == torch.bfloat16:
        return "flashinfer"
    if W8A16_MIN_M <= m <= W8A16_MAX_M:
        return "triton_w8a16"
    return "triton"


def block_fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: GemmBackend | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in `out_dtype` (default x's). W_q [N, K] e4m3, S_w [ceil(N/128) or
    N, ceil(K/128)]. fp32 output (a tensor-parallel partial sum) is the accumulator unrounded from
    the Triton GEMMs and the emulation; torch's blockwise scaled_mm and flashinfer's GEMM write
    16-bit here (their result is widened).

    `backend` forces a GEMM (tests, bench); None picks by `gemm_backend`."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w_q.shape[0]
    out_dtype = out_dtype or x.dtype
    if backend is None:
        backend = gemm_backend(x.device, m, n, k, w_s.shape[0], x.dtype)
    if backend == "emulated":
        x_q, x_s = per_token_group_quant_fp8_torch(x2)
        x_deq = dequantize_weight_block(x_q, x_s)  # [M, Kb] scales = 1 x 128 blocks
        y = (x_deq @ dequantize_weight_block(w_q, w_s).t()).to(out_dtype)
    elif backend == "torch_blockwise":
        x_q, x_s = per_token_group_quant_fp8(x2, column_major_scales=True, align_rows=4)
        y = F.scaled_mm(
            x_q,
            w_q.t(),  # [K, N] column-major view: what the kernel wants for B
            x_s,  # [M, Kb], column-major
            F.ScalingType.BlockWise1x128,
            w_s.t(),  # [Kb, Nb] view of the [Nb, Kb] block scales
            F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        ).to(out_dtype)
    elif backend == "flashinfer":
        from flashinfer.gemm import gemm_fp8_nt_groupwise

        x_q, x_s = per_token_group_quant_fp8(x2, column_major_scales=True)
        y = gemm_fp8_nt_groupwise(x_q, w_q, x_s, w_s, out_dtype=x.dtype, backend="trtllm")
        y = y.to(out_dtype)
    elif backend == "triton_w8a16":
        from mlaserve.ops.w8a16_gemm import w8a16_block_fp8_matmul_triton

        y = w8a16_block_fp8_matmul_triton(x2, w_q, w_s, out_dtype=out_dtype)
    else:
        from mlaserve.ops.fp8_triton import w8a8_block_fp8_matmul_triton

        x_q, x_s = per_token_group_quant_fp8(x2)
        y = w8a8_block_fp8_matmul_triton(x_q, x_s, w_q, w_s, out_dtype=out_dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, n)


def fp8_gemm_warm_up_tasks(
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> list[Callable[[], None]]:
    """A task per `FP8_WARM_UP_TOKENS` count: `block_fp8_linear` once on zeros with this weight,
    so that every Triton variant its GEMMs and quantisation take for this shape compiles before
    serving (a speculative VERIFY or a prefill chunk of any length past the decode GEMV finds
    them built). None where no Triton kernel runs (the CPU)."""
    if gemm_backend(w_q.device, 1, w_q.shape[0], w_q.shape[1], w_s.shape[0], x_dtype) == "emulated":
        return []
    return [
        functools.partial(_linear_once, m, w_q, w_s, x_dtype, out_dtype) for m in FP8_WARM_UP_TOKENS
    ]


def _linear_once(
    m: int,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    x_dtype: torch.dtype,
    out_dtype: torch.dtype | None,
) -> None:
    x = torch.zeros(m, w_q.shape[1], dtype=x_dtype, device=w_q.device)
    block_fp8_linear(x, w_q, w_s, out_dtype=out_dtype)


def block_fp8_matmul_reference(
    x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor
) -> torch.Tensor:
    """What the quantised operands represent, multiplied in float64 on their device:
    x_q [M, K], x_s [M, Kb], W_q [N, K], S_w [N/bn, Kb] -> [M, N] float64. The GEMM oracle."""
    x = dequantize_weight_block(x_q, x_s, torch.float64)
    w = dequantize_weight_block(w_q, w_s, torch.float64)
    return x @ w.t()
