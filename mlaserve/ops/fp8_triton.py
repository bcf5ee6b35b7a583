"""Triton kernels for FP8 block-scaled compute (SM89+; written and timed for SM90).

Imported only where Triton is installed (`triton_support.triton_available()`). Every launch
here is shape-dispatched on the host and reads no device value back, so all of it can be
captured in a CUDA graph. The GEMMs follow the published design of SGLang's / vLLM's
`w8a8_block_fp8_matmul` and `fused_moe` (block-FP8 variant): fp8 x fp8 `tl.dot` per 128-wide K
step, each partial product rescaled by its activation-group and weight-block scales into an fp32
accumulator.

    per_token_group_quant_fp8_triton  x [M, K] -> x_q [M, K] e4m3, S_x [M, Kb] fp32
    w8a8_block_fp8_matmul_triton      x_q [M, K], S_x [M, Kb], W_q [N, K], S_w [N/bn, Kb]
                                      -> [M, N] in out_dtype (split-K at decode-sized M)
    w8a16_dense_matmul_triton         x [M, K] bf16/fp16/fp32, W_q [N, K], S_w [N/bn, Kb]
                                      -> [M, N]: the weight widened in registers, no activation
                                      quantisation, one launch (17-64 rows; `w8a16_gemm.py`
                                      takes 1-16 and dispatches)
    grouped_block_fp8_matmul_triton   rows of x_q grouped by expert (`align_blocks` layout),
                                      W_q [E, N, K], S_w [E, N/bn, Kb] -> [R, N]

Kb = ceil(K / 128); bn (`rows_per_scale`) = 128 for block scales, 1 for per-row scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.fp8_layout import FP8_DTYPE, FP8_MAX, column_major_scale_buffer

__all__ = [
    "GROUP_K",
    "NUM_PROGRAMS_TARGET",
    "grouped_block_fp8_matmul_triton",
    "per_token_group_quant_fp8_triton",
    "rows_per_scale",
    "w8a8_block_fp8_matmul_triton",
    "w8a16_dense_matmul_triton",
    "widen_e4m3",
]

GROUP_K = 128


@triton.jit
def widen_e4m3(w, dtype: tl.constexpr):
    """An e4m3 tile widened to `dtype` for `tl.dot` (exact). To bf16 it goes through fp32:
    Triton 3.6 lowers e4m3 -> bf16 to a packed e4m3 -> f16 and two scalar f16 -> bf16 converts,
    the fp32 route to one packed f32 -> bf16, and the decode GEMMs that widen every weight byte
    ran 13-22 % faster with it on an H200 (same bits; bench/RESULTS.md, thirty-first session)."""
    if dtype == tl.bfloat16:
        return w.to(tl.float32).to(dtype)
    else:
        return w.to(dtype)


# The scales' strides unspecialised: column-major ones are M apart (Triton would compile a
# variant for M % 16 == 0 and one for the rest: a compile while serving).
@triton.jit(do_not_specialize=["stride_sm", "stride_sk"])
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm, stride_sk,
    fp8_max, eps, GROUP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x)), eps) / fp8_max
    q = tl.clamp(x / scale, -fp8_max, fp8_max)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sk, scale)


def per_token_group_quant_fp8_triton(
    x: torch.Tensor,
    group: int = GROUP_K,
    *,
    column_major_scales: bool = False,
    align_rows: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (x_q [M, K] e4m3, S [M, ceil(K/group)] fp32); S
    column-major (columns padded to align_rows) if asked, else row-major."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    kb = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = (
        column_major_scale_buffer(m, kb, x.device, align_rows)
        if column_major_scales
        else torch.empty((m, kb), dtype=torch.float32, device=x.device)
    )
    if m:
        _per_token_group_quant_kernel[(m, kb)](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            FP8_MAX, 1e-10, GROUP=group, num_warps=1,
        )  # fmt: skip
    return q, s


# M unspecialised: one compiled variant serves every token count of a tile choice, so warm-up
# at one count per choice (`fp8_gemm.FP8_WARM_UP_TOKENS`) leaves no compile to serving.
@triton.jit(do_not_specialize=["M"])
def _block_fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K, group_n, kb_per_split,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cs, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_FP8: tl.constexpr,
):  # fmt: skip
    # A_FP8: a is e4m3 with per-(row, K block) scales as_ptr (W8A8); otherwise a is in its own
    # 16/32-bit dtype and as_ptr is unused (W8A16: b's e4m3 codes widen exactly to a's dtype).
    # Grouped launch order (GROUP_M rows of tiles share B tiles in L2).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    # Split K (axis 1): this program sums K blocks [kb_start, kb_start + kb_per_split) into its
    # own partial; blocks past the last one (only in the last split) are masked to zero.
    pid_k = tl.program_id(1)
    kb_start = pid_k * kb_per_split
    num_kb = tl.cdiv(K, BLOCK_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = offs_m % M  # wrapped rows/cols are computed but never stored
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = (
        a_ptr + offs_am[:, None] * stride_am + (kb_start * BLOCK_K + offs_k[None, :]) * stride_ak
    )
    b_ptrs = (
        b_ptr + offs_bn[None, :] * stride_bn + (kb_start * BLOCK_K + offs_k[:, None]) * stride_bk
    )
    as_ptrs = as_ptr + offs_am * stride_asm
    bs_ptrs = bs_ptr + (offs_bn // group_n) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, kb_per_split):
        kb = kb_start + i
        k_left = K - kb * BLOCK_K  # <= 0 past the last block: every load masked
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        kb_s = tl.minimum(kb, num_kb - 1)  # in bounds; a and b are zero past the end anyway
        b_s = tl.load(bs_ptrs + kb_s * stride_bsk)
        if A_FP8:
            a_s = tl.load(as_ptrs + kb_s * stride_ask)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, widen_e4m3(b, a.dtype)) * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


NUM_PROGRAMS_TARGET = 264  # ~2 per SM of an H100 (132 SMs): enough loads in flight for HBM


def _dense_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes and K splits by shape (no autotuning: a tuning run inside graph capture would
    break it).

    Decode-sized M is memory-bound: the smallest M tile tl.dot allows, N tiles of 64, and the K
    loop split over `split_k` programs until the launch covers every SM about twice, so that
    enough weight loads are in flight to saturate HBM (o_proj at M = 1 would otherwise be 32
    programs on 132 SMs). The split partials are summed in fp32 afterwards ([split, M, N], tiny
    at these M). Larger M: SGLang's default tiles, no split."""
    if m > 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "split_k": 1, "num_warps": 4, "num_stages": 3}
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
    split_k = max(1, min(NUM_PROGRAMS_TARGET // tiles, triton.cdiv(k, GROUP_K) // 2))
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "split_k": split_k, "num_warps": 4, "num_stages": 4}


def w8a8_block_fp8_matmul_triton(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """x_q [M, K] e4m3, x_s [M, Kb] fp32, w_q [N, K] e4m3, w_s [N/bn, Kb] fp32 -> [M, N].
    `split_k` overrides the shape's K split (tests)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    group_n = rows_per_scale(n, w_s.shape[0])
    if m == 0:
        return torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    cfg = _dense_config(m, n, k)
    num_kb = triton.cdiv(k, GROUP_K)
    kb_per_split = triton.cdiv(num_kb, split_k or cfg["split_k"])
    splits = triton.cdiv(num_kb, kb_per_split)  # every split has at least one K block
    out = (
        torch.empty((1, m, n), dtype=out_dtype, device=x_q.device)
        if splits == 1
        else torch.empty((splits, m, n), dtype=torch.float32, device=x_q.device)
    )
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _block_fp8_matmul_kernel[grid](
        x_q, w_q, out, x_s, w_s, m, n, k, group_n, kb_per_split,
        x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        x_s.stride(0), x_s.stride(1), w_s.stride(0), w_s.stride(1),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=GROUP_K, GROUP_M=8, A_FP8=True,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0).to(out_dtype)


def _w8a16_config(m: int, n: int) -> dict[str, int]:
    """Tiles for the W8A16 GEMM past the decode kernel's 16 rows (up to `fp8_gemm.W8A16_MAX_M`):
    one launch, no K split (a split needs a second, reducing launch, and at these sizes launches
    cost more than the bytes), so N tiles shrink until the launch has about one program per SM."""
    block_m = 32 if m <= 32 else 64
    m_tiles = triton.cdiv(m, block_m)
    block_n = 64
    while block_n > 16 and m_tiles * triton.cdiv(n, block_n) < NUM_PROGRAMS_TARGET // 2:
        block_n //= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 4}


def w8a16_dense_matmul_triton(
    x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """`_block_fp8_matmul_kernel` with bf16 / fp16 / fp32 activations (the weight widened in
    registers, no activation quantisation): x [M, K] (contiguous last dim), w_q [N, K] e4m3,
    w_s [N/bn, Kb] fp32 -> out [M, N], one launch. `w8a16_gemm`'s path past 16 rows."""
    m, k = x.shape
    n = w_q.shape[0]
    cfg = _w8a16_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), 1)
    out3 = out.unsqueeze(0)
    _block_fp8_matmul_kernel[grid](
        x, w_q, out3, x, w_s, m, n, k, rows_per_scale(n, w_s.shape[0]), triton.cdiv(k, GROUP_K),
        x.stride(0), x.stride(1), w_q.stride(0), w_q.stride(1),
        out3.stride(0), out3.stride(1), out3.stride(2),
        0, 0, w_s.stride(0), w_s.stride(1),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=GROUP_K, GROUP_M=8, A_FP8=False,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def rows_per_scale(n: int, scale_rows: int) -> int:
    """Weight rows a scale row covers: 1 (per-row scales) or 128 (128 x 128 blocks)."""
    if scale_rows == n:
        return 1
    if scale_rows == triton.cdiv(n, 128):
        return 128
    raise ValueError(f"weight scale has {scale_rows} rows; expected ceil({n}/128) or {n}")


@triton.jit
def _grouped_block_fp8_matmul_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, sorted_rows_ptr, block_expert_ptr,
    R, N, K, group_n,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_FP8: tl.constexpr,
):  # fmt: skip
    # A_FP8 as in _block_fp8_matmul_kernel: W8A8 with activation scales, or W8A16 without.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a padding block past the last expert's rows
        return
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < R  # padding slots hold R
    rows = tl.where(row_ok, rows, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_bn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + offs_bn[None, :] * stride_bn + offs_k[:, None] * stride_bk
    as_ptrs = as_ptr + rows * stride_asm
    bs_ptrs = bs_ptr + expert.to(tl.int64) * stride_bse + (offs_bn // group_n) * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk)
        if A_FP8:
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc += tl.dot(a, widen_e4m3(b, a.dtype)) * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def grouped_block_fp8_matmul_triton(
    x_q: torch.Tensor,
    x_s: torch.Tensor | None,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_expert: torch.Tensor,
    block_m: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Row r of the output = x[r] @ W[e(r)]^T, for rows grouped by expert.

    x_q [R, K] e4m3, x_s [R, Kb] fp32 (W8A8), or x_q [R, K] bf16/fp16/fp32 and x_s None
    (W8A16: the weight widened to x's dtype, the activations never quantised);
    w_q [E, N, K] e4m3, w_s [E, N/bn, Kb] fp32;
    sorted_rows [num_blocks * block_m] int32 and block_expert [num_blocks] int32 from
    `fp8_grouped_gemm.align_blocks` (each block of block_m slots holds rows of one expert, R
    marks an empty slot, expert -1 an unused block). -> [R, N] in out_dtype."""
    if x_s is None and x_q.stride(-1) != 1:
        x_q = x_q.contiguous()
    r, k = x_q.shape
    n = w_q.shape[1]
    group_n = rows_per_scale(n, w_s.shape[1])
    a_fp8 = x_s is not None
    a_s = x_s if a_fp8 else x_q  # unused when not a_fp8
    out = torch.empty((r, n), dtype=out_dtype, device=x_q.device)
    block_n = 64 if r <= 64 else 128
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_block_fp8_matmul_kernel[grid](
        x_q, w_q, out, a_s, w_s, sorted_rows, block_expert, r, n, k, group_n,
        x_q.stride(0), x_q.stride(1), w_q.stride(0), w_q.stride(1), w_q.stride(2),
        out.stride(0), out.stride(1), a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0,
        w_s.stride(0), w_s.stride(1), w_s.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP_K, A_FP8=a_fp8,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out
