"""MLA's absorbed per-head projections at decode sizes: y[t, h] = x[t, h] @ W[h], one launch.

    x    [T, H, K]  bf16 / fp16 / fp32; any strides with a contiguous last dim (q_nope is a
                    view into the q projection's output rows); 1 <= T <= HEAD_GEMV_MAX_M
    w    [H, K, N]  x's dtype; any strides with one unit stride, along K or along N:
                    W_UK is [H, d_n, r] with r contiguous, W_UV [H, r, d_v] with r contiguous
                    (both views of kv_b_proj's weight, no copies)
    out  [T, H, N]  x's dtype; any strides with a contiguous last dim (W_UV writes straight
                    into o_proj's [T, H * d_v] input rows); allocated when not given

fp32 accumulation over K, one rounding to x's dtype (cuBLAS's bmm accumulates in fp32 too, in
another order: the two agree to bf16 rounding, not bit for bit).

Joined query (`tail`, W_UK only): FlashMLA's whole query [q_nope @ W_UK | q_pe] in one launch,
instead of this GEMV then `q_prep.prepare_q`'s cat + cast:

    tail [T, H, DR]     x's dtype (q_pe, RoPE applied); any strides with a contiguous last dim
    out  [T, H, N + DR] required; x's dtype or float8_e4m3fn; contiguous last dim

The products are rounded to x's dtype first, then, for an fp8 `out`, widened to fp32, clamped
to +-448 and cast (the tail likewise), exactly as `prepare_q(head_gemv(x, w), tail, fp8)`: the
same bits. FlashMLA runs next and reads q without waiting, so this variant lets it launch only
when its grid has ended (`ops/pdl.py`, `wait_and_hold_next_kernel`).

Why: these are the two batched GEMMs of an MLA decode step (q_nope -> latent, latent -> v). At a
few tokens each reads 2 MB of weights (V2-Lite; 16.8 MB on V3), which cuBLAS's bmm streams at
a fraction of the copy bandwidth (measured: bench/RESULTS.md, "Session of 2026-11-23 (fourth)"),
and as a library kernel it cannot launch early under PDL (`ops/pdl.py`). Here each
program owns BLOCK_N output columns of one head and walks K once, loading each weight tile once
for every token row (plain FMAs: at T <= 8 a tensor-core tile would be mostly padding).
Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.mla_norm_rope import rope_pair
from mlaserve.ops.pdl import pdl_args, wait_and_hold_next_kernel, wait_for_previous_kernel

__all__ = [
    "HEAD_GEMV_MAX_M",
    "HEAD_GEMV_MAX_ROWS",
    "HeadGemvLaunch",
    "head_gemv",
    "head_gemv_buckets",
    "head_gemv_launch",
    "head_gemv_max_m",
    "head_gemv_program",
    "head_gemv_warm_up_tasks",
]

# Token rows per launch: each is a static unroll step of the kernel; past it the bmm's tensor
# cores win.
HEAD_GEMV_MAX_M = 8
# ... and at most this many (token, head) rows: at V3's 64 heads a TP2 rank's W_UK / W_UV at 8
# tokens ran faster as cuBLAS's bmm (bench/RESULTS.md, thirty-first session); the limit of 8 was
# measured at V2-Lite's 16 heads.
HEAD_GEMV_MAX_ROWS = 256
_TILE = 8192  # elements of a [BLOCK_K, BLOCK_N] weight tile: 64 fp32 per thread at 4 warps
_PROGRAMS = 256  # about two per SM of an H100
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max  # 448: saturate, as `q_prep` and the KV write do


@triton.jit
def _round_for(v, x_ty: tl.constexpr, y_ty: tl.constexpr, FP8_MAX: tl.constexpr):
    """fp32 or x-typed v -> y's dtype: rounded to x's dtype first (what the unjoined path
    stores), then for e4m3 saturated in fp32 before the cast."""
    v = v.to(x_ty)
    if y_ty == tl.float8e4nv:
        v = tl.clamp(v.to(tl.float32), -FP8_MAX, FP8_MAX)
    return v.to(y_ty)


@triton.jit
def head_gemv_program(
    pid_n, h, x_ptr, w_ptr, y_ptr, t_ptr, M,
    x_st, x_sh, w_sh, w_sk, w_sn, y_st, y_sh, t_st, t_sh, cos_ptr, sin_ptr, cs_stride,
    K: tl.constexpr, N: tl.constexpr, DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DR: tl.constexpr, TAIL: tl.constexpr, ROPE_TAIL: tl.constexpr,
    INTERLEAVED: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Column block pid_n of head h (int64), the PDL wait included: also one role of
    `mla_decode_prologue`'s kernel. ROPE_TAIL: the tail is q_pe before RoPE, applied here
    (cos / sin [T, DR / 2] fp32, `mla_norm_rope`'s math and rounding)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    w_cols = w_ptr + h * w_sh + offs_n[None, :] * w_sn  # [1, BLOCK_N]
    x_row = x_ptr + h * x_sh
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The weights are constants: the first tile is loaded before the wait (under PDL its DRAM
    # latency overlaps the previous kernel; at V2-Lite's shapes it is the program's whole
    # share), each later one a step ahead (a register double buffer).
    offs_k = tl.arange(0, BLOCK_K)
    mask_w = (offs_k < K)[:, None] & mask_n[None, :]
    w_next = tl.load(w_cols + offs_k[:, None] * w_sk, mask=mask_w, other=0.0)
    # x (and the tail) are the previous kernel's output. A joined query is FlashMLA's input,
    # and FlashMLA never waits: no early trigger then (`ops/pdl.py`).
    if TAIL:
        wait_and_hold_next_kernel(PDL)
    else:
        wait_for_previous_kernel(PDL)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = w_next.to(tl.float32)  # [BLOCK_K, BLOCK_N]
        nk = offs_k + BLOCK_K
        mask_w = (nk < K)[:, None] & mask_n[None, :]
        w_next = tl.load(w_cols + nk[:, None] * w_sk, mask=mask_w, other=0.0)
        for m in tl.static_range(BLOCK_M):  # the weight tile is read once for all rows
            xm = tl.load(x_row + m * x_st + offs_k, mask=mask_k & (m < M), other=0.0)
            part = tl.sum(w * xm.to(tl.float32)[:, None], axis=0)  # [BLOCK_N]
            # m is static: the select folds away, each row adds to its own registers
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    x_ty: tl.constexpr = x_ptr.dtype.element_ty
    y_ty: tl.constexpr = y_ptr.dtype.element_ty
    y_rows = y_ptr + h * y_sh + offs_m[:, None] * y_st  # [BLOCK_M, 1]
    mask_m = offs_m[:, None] < M
    tl.store(y_rows + offs_n[None, :], _round_for(acc, x_ty, y_ty, FP8_MAX), mask=mask_m & mask_n)
    if TAIL and ROPE_TAIL:  # column block 0 ropes the tail, one program per head
        half = tl.arange(0, BLOCK_DR // 2)[None, :]
        mask = mask_m & (half < DR // 2) & (pid_n == 0)
        cs = offs_m[:, None] * cs_stride + half
        cos = tl.load(cos_ptr + cs, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + cs, mask=mask, other=0.0)
        t_rows = t_ptr + h * t_sh + offs_m[:, None] * t_st
        o1, o2 = rope_pair(t_rows, half, mask, cos, sin, INTERLEAVED, DR // 2)
        tl.store(y_rows + N + half, _round_for(o1, x_ty, y_ty, FP8_MAX), mask=mask)
        tl.store(y_rows + N + DR // 2 + half, _round_for(o2, x_ty, y_ty, FP8_MAX), mask=mask)
    elif TAIL:  # the programs of column block 0 copy the tail, one per head: y[:, h, N:]
        offs_d = tl.arange(0, BLOCK_DR)[None, :]
        mask = mask_m & (offs_d < DR) & (pid_n == 0)
        tail = tl.load(t_ptr + h * t_sh + offs_m[:, None] * t_st + offs_d, mask=mask)
        tl.store(y_rows + N + offs_d, _round_for(tail, x_ty, y_ty, FP8_MAX), mask=mask)


# M is a runtime value (not specialised): one compile per power-of-two bucket (BLOCK_M).
@triton.jit(do_not_specialize=["M"])
def _head_gemv_kernel(
    x_ptr, w_ptr, y_ptr, t_ptr, M,
    x_st, x_sh, w_sh, w_sk, w_sn, y_st, y_sh, t_st, t_sh, cos_ptr, sin_ptr, cs_stride,
    K: tl.constexpr, N: tl.constexpr, DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DR: tl.constexpr, TAIL: tl.constexpr, ROPE_TAIL: tl.constexpr,
    INTERLEAVED: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    head_gemv_program(
        tl.program_id(0), tl.program_id(1).to(tl.int64), x_ptr, w_ptr, y_ptr, t_ptr, M,
        x_st, x_sh, w_sh, w_sk, w_sn, y_st, y_sh, t_st, t_sh, cos_ptr, sin_ptr, cs_stride,
        K, N, DR, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_DR, TAIL, ROPE_TAIL, INTERLEAVED, FP8_MAX,
        PDL,
    )  # fmt: skip


class HeadGemvLaunch(NamedTuple):
    """A checked launch of the kernel: its arguments by parameter name (PDL aside), its grid
    (column blocks, heads) and the output."""

    args: dict[str, object]
    grid: tuple[int, int]
    out: torch.Tensor


def head_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H, K], w [H, K, N] -> y [T, H, N] (into `out` when given), or with `tail`
    [T, H, DR] the joined y [T, H, N + DR] into `out` (see the module docstring). Raises
    ValueError on inputs that do not fit."""
    launch = head_gemv_launch(x, w, out, tail)
    _head_gemv_kernel[launch.grid](**launch.args, **pdl_args(x.device))
    return launch.out


def head_gemv_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
) -> HeadGemvLaunch:
    """`head_gemv`'s checks, output and tiles, without the launch (`mla_decode_prologue` runs
    the same programs inside its own kernel). `rope` = (cos, sin, interleaved), with a tail
    only: the tail is q_pe before RoPE, and the joined query takes rope(q_pe) (the bits of
    `mla_norm_rope`'s, then the tail's rounding)."""
    if x.dim() != 3 or w.dim() != 3:
        raise ValueError(f"head_gemv: x {list(x.shape)} and w {list(w.shape)} must be 3-D")
    (m, heads, k), n = x.shape, w.shape[2]
    if w.shape[:2] != (heads, k):
        raise ValueError(f"head_gemv: w {list(w.shape)} does not fit x {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        raise ValueError(f"head_gemv: x {x.dtype} and w {w.dtype} must be one float dtype")
    if not 1 <= m <= HEAD_GEMV_MAX_M:
        raise ValueError(f"head_gemv: {m} token rows, expected 1..{HEAD_GEMV_MAX_M}")
    if x.stride(2) != 1 or 1 not in w.stride()[1:]:
        raise ValueError("head_gemv: x needs a contiguous last dim, w a unit stride along K or N")
    dr = 0
    if tail is not None:
        if tail.dim() != 3 or tail.shape[:2] != (m, heads) or tail.dtype != x.dtype:
            raise ValueError(
                f"head_gemv: tail must be [{m}, {heads}, DR] {x.dtype}, got "
                f"{list(tail.shape)} {tail.dtype}"
            )
        if tail.stride(2) != 1:
            raise ValueError("head_gemv: tail needs a contiguous last dim")
        if out is None:
            raise ValueError("head_gemv: a tail needs `out` [T, H, N + DR] (the joined query)")
        dr = tail.shape[2]
    width, dtypes = (n, (x.dtype,)) if tail is None else (n + dr, (x.dtype, _FP8))
    if out is None:
        out = torch.empty(m, heads, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, heads, width) or out.dtype not in dtypes or out.stride(2) != 1:
        raise ValueError(
            f"head_gemv: out must be [{m}, {heads}, {width}] {' or '.join(map(str, dtypes))}, "
            f"last dim unit; got {list(out.shape)} {out.dtype} strides {out.stride()}"
        )
    block_n = 16
    while block_n < 64 and triton.cdiv(n, block_n * 2) * heads >= _PROGRAMS:
        block_n *= 2
    block_k = min(triton.next_power_of_2(k), _TILE // block_n)
    t = x if tail is None else tail  # unread without TAIL
    if rope is not None:
        cos, sin, interleaved = rope
        if tail is None or dr % 2 or cos.shape != (m, dr // 2) or cos.stride() != sin.stride():
            raise ValueError("head_gemv: rope needs a tail and cos / sin [T, DR / 2], alike")
        if cos.stride(1) != 1 or cos.dtype != torch.float32:
            raise ValueError("head_gemv: cos / sin must be fp32 with a contiguous last dim")
    else:
        cos, sin, interleaved = x, x, False  # unread without ROPE_TAIL
    args = {
        "x_ptr": x,
        "w_ptr": w,
        "y_ptr": out,
        "t_ptr": t,
        "M": m,
        "x_st": x.stride(0),
        "x_sh": x.stride(1),
        "w_sh": w.stride(0),
        "w_sk": w.stride(1),
        "w_sn": w.stride(2),
        "y_st": out.stride(0),
        "y_sh": out.stride(1),
        "t_st": t.stride(0),
        "t_sh": t.stride(1),
        "cos_ptr": cos,
        "sin_ptr": sin,
        "cs_stride": cos.stride(0),
        "K": k,
        "N": n,
        "DR": dr,
        "BLOCK_M": triton.next_power_of_2(m),
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "BLOCK_DR": triton.next_power_of_2(max(dr, 1)),
        "TAIL": tail is not None,
        "ROPE_TAIL": rope is not None,
        "INTERLEAVED": interleaved,
        "FP8_MAX": _FP8_MAX,
        "num_warps": 4,
    }
    return HeadGemvLaunch(args, (triton.cdiv(n, block_n), heads), out)


def head_gemv_warm_up_tasks(
    x_strides: tuple[int, int],
    heads: int,
    w: torch.Tensor,
    max_m: int,
    tail: tuple[int, tuple[int, int]] | None = None,
    out_dtypes: tuple[torch.dtype, ...] = (),
) -> list[Callable[[], None]]:
    """One task per variant, each running it once on zeros so that it compiles before serving:
    every M bucket up to `max_m` for x rows laid out with `x_strides` (token, head; Triton
    specialises on their divisibility) and weight `w` [H, K, N]; with `tail` = (DR, its (token,
    head) strides), also the joined-query variant for each of `out_dtypes` (out contiguous
    [T, H, N + DR], as the layer allocates it). Tasks are independent (run on threads)."""
    variants = [(None, None)] + ([(tail, dtype) for dtype in out_dtypes] if tail else [])
    return [
        functools.partial(_head_gemv_once, m, x_strides, heads, w, *variant)
        for m in head_gemv_buckets(max_m)
        for variant in variants
    ]


def head_gemv_max_m(heads: int) -> int:
    """Tokens up to which a layer with `heads` heads (on this rank) takes the head GEMV: 8 up to
    32 heads, 4 at 64, 2 at 128."""
    return max(1, min(HEAD_GEMV_MAX_M, HEAD_GEMV_MAX_ROWS // max(heads, 1)))


def head_gemv_buckets(max_m: int) -> list[int]:
    """The M buckets (powers of two) up to `max_m` tokens, HEAD_GEMV_MAX_M at most: one
    compiled variant each."""
    return [1 << i for i in range(max(0, min(max_m, HEAD_GEMV_MAX_M)).bit_length())]


def _head_gemv_once(
    m: int,
    x_strides: tuple[int, int],
    heads: int,
    w: torch.Tensor,
    tail: tuple[int, tuple[int, int]] | None,
    out_dtype: torch.dtype | None,
) -> None:
    k, n = w.shape[1:]
    rows = torch.zeros(m * x_strides[0], dtype=w.dtype, device=w.device)
    x = rows.as_strided((m, heads, k), (*x_strides, 1))
    if tail is None:
        head_gemv(x, w)
        return
    dr, strides = tail
    pe = torch.zeros(m * strides[0], dtype=w.dtype, device=w.device)
    pe = pe.as_strided((m, heads, dr), (*strides, 1))
    out = torch.empty(m, heads, n + dr, dtype=out_dtype, device=w.device)
    head_gemv(x, w, out=out, tail=pe)
