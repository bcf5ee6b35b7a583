"""Fused RMSNorm and residual-add + RMSNorm, DeepSeek/transformers semantics.

    rms_norm(x, w, eps)                  x [T, N] -> [T, N]
    add_rms_norm(x, residual, w, eps)    -> (normed [T, N], new residual [T, N])
    add_partials_rms_norm(parts, residual, w, eps)   the same for x = an MoE layer's per-slot
                                         partials [T, S, N] fp32 summed in order (its combine)
    add_sorted_rms_norm(rows, pos, weights, shared, residual, w, eps)   the same for x = the
                                         sorted MoE path's combine (`ops.moe_sorted_combine`)

with, per row, exactly the reference's roundings (`mlaserve/model/layers/norm.py`):

    s = residual + x                     in the model dtype (rounded, as `x + residual` is)
    y = (s.float() * rsqrt(mean(s.float()^2) + eps)).to(dtype)   normalize in fp32, round
    out = (w * y)                        product in fp32, rounded to result_type(w, x)

x / residual: bf16, fp16 or fp32, rows contiguous in the last dim (row stride free); w: [N] in
the params dtype. Outputs are new contiguous tensors (inputs are never written: the captured
graph's static buffers stay what the caller gave). One program per row; N <= 16384 (one block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.ops.moe_sorted_combine import combined_token_row
from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = [
    "add_and_normalise",
    "add_partials_rms_norm",
    "add_rms_norm",
    "add_sorted_rms_norm",
    "rms_norm",
]

_MAX_N = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    eps,
    pos_ptr,
    weights_ptr,
    shared_ptr,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    PARTS: tl.constexpr,
    SORTED_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_previous_kernel(PDL)
    if SORTED_K > 0:  # x: rows sorted by expert; this token's K of them weighted, summed in order
        x = combined_token_row(
            x_ptr, x_stride, pos_ptr, weights_ptr, shared_ptr, row, offs, mask,
            N, SORTED_K, HAS_SHARED, res_out_ptr.dtype.element_ty,
        )  # fmt: skip
    else:
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    for p in tl.static_range(1, PARTS):  # x: PARTS fp32 partial sums per row, summed in order
        x += tl.load(x_ptr + row * x_stride + p * N + offs, mask=mask, other=0.0)
    add_and_normalise(
        x, w, res_ptr, res_stride, out_ptr, res_out_ptr, row, offs, mask, eps, N, ADD
    )  # fmt: skip


@triton.jit
def add_and_normalise(
    x, w, res_ptr, res_stride, out_ptr, res_out_ptr, row, offs, mask, eps, N: tl.constexpr,
    ADD: tl.constexpr,
):  # fmt: skip
    """One row's tail of the norms here (and of `ops.all_reduce_rms_norm`'s, which must give the
    same bits): with ADD, x rounded once to the residual's dtype (a no-op unless x holds fp32
    partial sums: one part included, as a tensor-parallel all-reduce leaves them), the residual
    row added and rounded like the unfused `x + residual`, the sum stored as the new residual;
    then x normalised in fp32, rounded, scaled by w (fp32 [BLOCK]) and stored."""
    if ADD:
        x = x.to(res_out_ptr.dtype.element_ty)
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    parts: int = 1,
    sorted_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """parts > 1: x is [T, parts * N] fp32 partial sums (residual required). `sorted_rows`:
    (pos [T*K] int32, weights [T, K] fp32, shared [T, N] or None), x the sorted MoE rows [T*K,
    N] (residual required): see `add_sorted_rms_norm`."""
    n = x.shape[-1] // parts
    if n > _MAX_N:
        raise ValueError(f"rms_norm: hidden size {n} above the one-block limit {_MAX_N}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm: need [T, N] with a contiguous last dim, got {x.shape}")
    like = x if residual is None else residual
    pos, weights, shared = sorted_rows if sorted_rows is not None else (None, None, None)
    out = torch.empty(like.shape, dtype=torch.result_type(weight, like), device=x.device)
    res_out = (
        torch.empty_like(residual, memory_format=torch.contiguous_format)
        if residual is not None
        else None
    )
    if like.shape[0] == 0:
        return out, res_out
    if residual is not None and residual.stride(-1) != 1:
        raise ValueError("add_rms_norm: residual needs a contiguous last dim")
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(like.shape[0],)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out if res_out is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        float(eps),
        pos if pos is not None else x,
        weights if weights is not None else x,
        shared if shared is not None else x,
        N=n,
        BLOCK=block,
        ADD=residual is not None,
        PARTS=parts,
        SORTED_K=weights.shape[1] if weights is not None else 0,
        HAS_SHARED=shared is not None,
        num_warps=min(max(block // 256, 1), 16),
        **pdl_args(x.device),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> RMSNorm(x) * weight [T, N]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (RMSNorm(x + residual) * weight, x + residual); x and residual [T, N], same dtype."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} must match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    out, res_out = _launch(x, residual, weight, eps)
    assert res_out is not None  # internal: ADD path allocates it
    return out, res_out


def add_partials_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [T, S, N] fp32 (an MoE layer's per-slot outputs, `ops.moe_decode` / `moe_grouped`
    with combine=False) -> `add_rms_norm(x, residual, ...)` for x = their sum over S in order,
    rounded to residual's dtype: the same bits as the MoE's combine kernel followed by
    `add_rms_norm`, one launch instead of two."""
    num_tokens, num_parts, n = parts.shape
    if (
        parts.dtype != torch.float32
        or not parts.is_contiguous()
        or residual.shape != (num_tokens, n)
    ):
        raise ValueError(
            f"add_partials_rms_norm: parts {tuple(parts.shape)} {parts.dtype} (contiguous fp32 "
            f"[T, S, N]) vs residual {tuple(residual.shape)}"
        )
    out, res_out = _launch(parts.view(num_tokens, num_parts * n), residual, weight, eps, num_parts)
    assert res_out is not None  # internal: ADD path allocates it
    return out, res_out


def add_sorted_rms_norm(
    rows: torch.Tensor,
    pos: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [T*K, N] (the sorted MoE path's expert outputs, residual's dtype), pos [T*K] int32
    (pair -> row), weights [T, K] fp32, shared [T, N] or None (`ops.moe_partials.
    SortedExpertRows`) -> `add_rms_norm(x, residual, ...)` for x = their combine: the same bits
    as `moe_sorted_combine` followed by `add_rms_norm`, one launch instead of two, and the
    combined [T, N] tensor is neither written nor read back."""
    num_tokens, top_k = weights.shape
    n = residual.shape[-1]
    if (
        rows.shape != (num_tokens * top_k, n)
        or rows.dtype != residual.dtype
        or residual.shape != (num_tokens, n)
        or pos.shape != (num_tokens * top_k,)
        or pos.dtype != torch.int32
        or weights.dtype != torch.float32
        or not (weights.is_contiguous() and pos.is_contiguous())
    ):
        raise ValueError(
            f"add_sorted_rms_norm: rows {tuple(rows.shape)} {rows.dtype}, pos {tuple(pos.shape)} "
            f"{pos.dtype}, weights {tuple(weights.shape)} {weights.dtype} (contiguous fp32 [T, "
            f"K]) vs residual {tuple(residual.shape)} {residual.dtype}"
        )
    if shared is not None and (shared.shape != residual.shape or not shared.is_contiguous()):
        raise ValueError(f"add_sorted_rms_norm: shared must be contiguous {tuple(residual.shape)}")
    out, res_out = _launch(rows, residual, weight, eps, sorted_rows=(pos, weights, shared))
    assert res_out is not None  # internal: ADD path allocates it
    return out, res_out
