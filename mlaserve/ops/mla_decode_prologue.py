"""An MLA decode step's two kernels between the q | kv_a projection and attention, as one launch:
`mla_norm_rope` (latent RMSNorm, RoPE on k_pe and q_pe, the paged KV write) and `head_gemv`'s
W_UK absorption (q_nope -> q_latent).

    kv_c, k_pe, q_pe, weight, cos, sin, kv_cache, slot_mapping, kv_scale: as `mla_norm_rope`
                         (the KV write path: the cache is the latent's only consumer)
    q_nope   [T, H, d_n] as `head_gemv`'s x (a view of the q projection's rows)
    w_uk     [H, d_n, r] as `head_gemv`'s w
    returns  q_latent [T, H, r] (x's dtype), q_pe_roped [T, H, d_r] (new tensors)

The same programs as the two kernels, with the same bits: programs 0..T-1 are `mla_norm_rope`'s
(one per token), the rest `head_gemv`'s (column block, head). The attention kernel that follows
reads q_latent, q_pe_roped and the cache.

Why: the two only read the projection's output, yet as two launches the GEMV waits for the norm
kernel's grid to finish (`ops/pdl.py`: a kernel waits for the whole previous grid). At batch 1
each is a few microseconds of latency, not of bytes (measured: bench/RESULTS.md, "Session of
2026-11-26 (second)", "Where a bs-1 decode step goes"); one launch runs them side by side.

Joined query (`joined`, FlashMLA's query [q_nope @ W_UK | rope(q_pe)] [T, H, r + d_r] in its
dtype, `head_gemv`'s tail variant): the GEMV's column-block-0 programs rope q_pe themselves
(ROPE_TAIL) instead of copying the norm programs' output, so the two roles still share no data;
no program lets the next kernel launch early, since FlashMLA reads without waiting.

Launches read no device value on the host: CUDA-graph safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mlaserve.ops.head_gemv import head_gemv_buckets, head_gemv_launch, head_gemv_program
from mlaserve.ops.mla_norm_rope import norm_rope_launch, norm_rope_program, warm_up_rows
from mlaserve.ops.pdl import pdl_args, wait_and_hold_next_kernel, wait_for_previous_kernel

__all__ = [
    "mla_decode_prologue",
    "mla_decode_prologue_warm_up_tasks",
]


# M (the token count) is a runtime value: one compile per power-of-two bucket (BLOCK_M).
@triton.jit(do_not_specialize=["M"])
def _prologue_kernel(
    kv_c_ptr, k_pe_ptr, q_pe_ptr, gamma_ptr, cos_ptr, sin_ptr,
    kv_c_out_ptr, k_pe_out_ptr, q_pe_out_ptr, cache_ptr, slot_ptr, kv_scale,
    kv_c_stride, k_pe_stride, q_pe_stride_t, q_pe_stride_h, q_out_stride_t, q_out_stride_h,
    cs_stride, eps, H,
    x_ptr, w_ptr, y_ptr, t_ptr, M,
    x_st, x_sh, w_sh, w_sk, w_sn, y_st, y_sh, t_st, t_sh,
    R: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, WRITE: tl.constexpr, FP8: tl.constexpr,
    K: tl.constexpr, N: tl.constexpr, DR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_DR: tl.constexpr, TAIL: tl.constexpr, ROPE_TAIL: tl.constexpr, FP8_MAX: tl.constexpr,
    COL_BLOCKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < M:  # token pid's norm, RoPEs (q_pe's unless the joined query takes it) and KV write
        # A joined query is FlashMLA's input, and FlashMLA never waits: no program of this
        # grid may let it launch early (`ops/pdl.py`), the cache rows written here included.
        if TAIL:
            wait_and_hold_next_kernel(PDL)
        else:
            wait_for_previous_kernel(PDL)
        norm_rope_program(
            pid.to(tl.int64), kv_c_ptr, k_pe_ptr, q_pe_ptr, gamma_ptr, cos_ptr, sin_ptr,
            kv_c_out_ptr, k_pe_out_ptr, q_pe_out_ptr, cache_ptr, slot_ptr, kv_scale,
            kv_c_stride, k_pe_stride, q_pe_stride_t, q_pe_stride_h, q_out_stride_t,
            q_out_stride_h, cs_stride, eps, H, R, HALF, BLOCK_R, BLOCK_HALF, BLOCK_H,
            INTERLEAVED, WRITE, FP8, FP8_MAX, not TAIL,
        )  # fmt: skip
    else:  # one column block of one head of q_nope @ W_UK (waits inside, after its first load)
        g = pid - M
        head_gemv_program(
            g % COL_BLOCKS, (g // COL_BLOCKS).to(tl.int64), x_ptr, w_ptr, y_ptr, t_ptr, M,
            x_st, x_sh, w_sh, w_sk, w_sn, y_st, y_sh, t_st, t_sh, cos_ptr, sin_ptr, cs_stride,
            K, N, DR, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_DR, TAIL, ROPE_TAIL, INTERLEAVED,
            FP8_MAX, PDL,
        )  # fmt: skip


def mla_decode_prologue(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    w_uk: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float,
    joined: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (q_nope @ W_UK per head [T, H, r], rope(q_pe) [T, H, d_r]); kv_a_layernorm(kv_c) and
    rope(k_pe) are written to `kv_cache` at `slot_mapping`. With `joined` [T, H, r + d_r] (the
    attention kernel's query, bf16 or e4m3): both go there instead, `head_gemv(tail=...)`'s
    layout and roundings, and (joined, None) comes back. Raises ValueError on inputs either
    kernel refuses, or on more than HEAD_GEMV_MAX_M tokens (0 tokens: empty outputs)."""
    num_tokens = kv_c.shape[0]
    if q_nope.shape[0] != num_tokens:
        raise ValueError(
            f"mla_decode_prologue: q_nope has {q_nope.shape[0]} tokens, not {num_tokens}"
        )
    norm = norm_rope_launch(
        kv_c, k_pe, q_pe, weight, eps, cos, sin, interleaved, kv_cache, slot_mapping, kv_scale
    )
    q_pe_out = None if joined is not None else norm.result[2]
    if num_tokens == 0:
        heads, rank = w_uk.shape[0], w_uk.shape[2]
        return (joined if joined is not None else q_nope.new_empty(0, heads, rank)), q_pe_out
    if joined is None:  # checks 1 <= T <= HEAD_GEMV_MAX_M
        gemv = head_gemv_launch(q_nope, w_uk)
    else:
        gemv = head_gemv_launch(q_nope, w_uk, joined, q_pe, rope=(cos, sin, interleaved))
    col_blocks, heads = gemv.grid
    # Both name cos / sin / their stride / INTERLEAVED (the GEMV's are stand-ins without a
    # joined query), FP8_MAX and num_warps: the norm's values serve both.
    args = {**gemv.args, **norm.args}
    _prologue_kernel[(num_tokens + col_blocks * heads,)](
        **args, COL_BLOCKS=col_blocks, **pdl_args(kv_c.device)
    )
    return gemv.out, q_pe_out


def mla_decode_prologue_warm_up_tasks(
    q_strides: tuple[int, int],
    kv_stride: int,
    dims: tuple[int, int, int],
    weight: torch.Tensor,
    w_uk: torch.Tensor,
    interleaved: bool,
    cache_dtypes: tuple[torch.dtype, ...],
    max_m: int,
) -> list[Callable[[], None]]:
    """One task per variant, each running it once on zeros so that it compiles before serving:
    every token bucket up to `max_m` (<= HEAD_GEMV_MAX_M) for each cache dtype, with and
    without a joined query of that dtype (FlashMLA's: e4m3 for an fp8 cache, else the model's),
    for q rows with `q_strides` (token, head) and latent rows [kv_c | k_pe] `kv_stride` apart,
    as the layer's projections lay them out (Triton specialises on the strides' divisibility).
    dims = (d_n, d_r, r); weight: kv_a_layernorm's. Tasks are independent (run on threads)."""
    layout = (q_strides, kv_stride, dims, weight, w_uk, interleaved)
    return [
        functools.partial(_prologue_once, bucket, layout, cache_dtype, joined)
        for bucket in head_gemv_buckets(max_m)
        for cache_dtype in cache_dtypes
        for joined in (False, True)
    ]


def _prologue_once(m: int, layout: tuple, cache_dtype: torch.dtype, joined: bool) -> None:
    """One warm-up launch (`mla_decode_prologue_warm_up_tasks`'s layout)."""
    q_strides, kv_stride, dims, weight, w_uk, interleaved = layout
    nope, rope, rank = dims
    heads, dev = w_uk.shape[0], w_uk.device
    q, kv_c, k_pe, cos = warm_up_rows(m, heads, q_strides, kv_stride, dims, w_uk.dtype, dev)
    slots = torch.arange(m, device=dev)
    cache = torch.zeros(m, 1, rank + rope, dtype=cache_dtype, device=dev)
    out = torch.empty(m, heads, rank + rope, dtype=cache_dtype, device=dev) if joined else None
    mla_decode_prologue(
        kv_c, k_pe, q[..., :nope], q[..., nope:], weight, 1e-6, cos, cos,
        interleaved, w_uk, cache, slots, 1.0, joined=out,
    )  # fmt: skip
