"""One MoE layer's expert weights as the fused kernels (`moe_decode`, `moe_grouped`) read them.

`MoeDecodeWeights` checks the layout once, after loading (views of the model's parameters, no
copies): routed w13 [E, 2I, H] (gate rows [0, I), up [I, 2I)) and w2 [E, H, I], the shared MLP's
merged gate_up [2SI, H] and down [H, SI] or none, fp32 FP8 scales where quantised (`fp8_linear.py`
layout). The two `@triton.jit` helpers say where an expert's rows live in that layout; both
kernel families call them, so the addressing is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MoeDecodeWeights", "expert_down_cols", "expert_gate_up_rows", "scale_args"]

_SCALE_BLOCK = 128  # the FP8 block size along K (both GEMMs)


@triton.jit
def expert_gate_up_rows(
    routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
    INTER: tl.constexpr, S: tl.constexpr, ROW_DIV: tl.constexpr, SHARED_ROW_DIV: tl.constexpr,
):  # fmt: skip
    """Where the gate and up rows `offs_n` of one width-I expert live: routed expert `index`
    (rows of w13 seen as [E * 2I, H]) or shared slice `index` (rows of the shared MLP's
    [gate (SI) | up (SI)]). -> (weight base, gate rows, up rows, scale base, gate and up scale
    offsets: add the K block). Called by `moe_decode`'s and `moe_grouped`'s gate_up kernels."""
    if routed:
        base = w_ptr
        gate_rows = index * (2 * INTER) + offs_n
        up_rows = gate_rows + INTER
        sbase = s_ptr
        sg = index * s_e_stride + (offs_n // ROW_DIV) * s_r_stride
        su = index * s_e_stride + ((offs_n + INTER) // ROW_DIV) * s_r_stride
    else:
        base = sw_ptr
        gate_rows = index * INTER + offs_n
        up_rows = gate_rows + S * INTER
        sbase = ss_ptr
        sg = (gate_rows // SHARED_ROW_DIV) * ss_r_stride
        su = (up_rows // SHARED_ROW_DIV) * ss_r_stride
    return base, gate_rows, up_rows, sbase, sg, su


@triton.jit
def expert_down_cols(
    routed, index, offs_n, w_ptr, s_ptr, sw_ptr, ss_ptr, s_e_stride, s_r_stride, ss_r_stride,
    H: tl.constexpr, INTER: tl.constexpr, S: tl.constexpr,
):  # fmt: skip
    """Where the down projection's output rows `offs_n` of one width-I expert live: w2[index]
    [H, I] for a routed expert, columns [s*I, (s+1)*I) of the shared MLP's [H, S*I] for shared
    slice s = `index`. -> (base, row stride, first column, scale pointers of the rows: add the
    K block); element (n, k) is at base + n * row stride + first column + k. Called by
    `moe_decode`'s and `moe_grouped`'s down kernels."""
    row_stride = tl.where(routed, INTER, S * INTER)
    col0 = tl.where(routed, 0, index * INTER)
    if routed:
        base = w_ptr + index * H * INTER
        srow = s_ptr + index * s_e_stride + (offs_n // 128) * s_r_stride
    else:
        base = sw_ptr
        srow = ss_ptr + (offs_n // 128) * ss_r_stride + col0 // 128
    return base, row_stride, col0, srow


class MoeDecodeWeights:
    """One MoE layer's weights as the kernels read them, checked once (at the first forward,
    after loading): the routed stack, the shared MLP's (or none), FP8 scales where quantised.

    Raises ValueError naming what does not fit."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        shared_w13_scale: torch.Tensor | None = None,
        shared_w2_scale: torch.Tensor | None = None,
    ) -> None:
        num_experts, two_i, hidden = w13.shape
        inter = two_i // 2
        if tuple(w2.shape) != (num_experts, hidden, inter):
            raise ValueError(f"moe_decode: w2 {list(w2.shape)} vs w13 {list(w13.shape)}")
        self.hidden, self.inter = hidden, inter
        self.num_shared = 0
        if shared_w13 is not None:
            assert shared_w2 is not None  # internal: both or neither
            width = shared_w13.shape[0] // 2
            if width % inter or tuple(shared_w2.shape) != (hidden, width):
                raise ValueError(
                    f"moe_decode: shared MLP {list(shared_w13.shape)} / {list(shared_w2.shape)} "
                    f"is not S slices of the experts' width {inter}"
                )
            if shared_w13.dtype != w13.dtype:
                raise ValueError("moe_decode: shared and routed weights differ in dtype")
            self.num_shared = width // inter
        self.quantized = w13_scale is not None
        if self.quantized:
            assert w2_scale is not None  # internal: scales come together
            if self.num_shared and (shared_w13_scale is None or shared_w2_scale is None):
                raise ValueError("moe_decode: FP8 experts with unquantised shared experts")
            if self.num_shared and inter % _SCALE_BLOCK:
                raise ValueError(f"moe_decode: FP8 shared slices need I % 128 == 0, I = {inter}")
        for t in (
            w13,
            w2,
            shared_w13,
            shared_w2,
            w13_scale,
            w2_scale,
            shared_w13_scale,
            shared_w2_scale,
        ):
            if t is not None and not t.is_contiguous():
                raise ValueError("moe_decode: weights and scales must be contiguous")
        self.w13, self.w2 = w13, w2
        # Absent tensors are passed as a harmless stand-in of the right pointer type; the
        # kernels never read them (S = 0 or HAS_SCALE off).
        self.shared_w13 = shared_w13 if shared_w13 is not None else w13
        self.shared_w2 = shared_w2 if shared_w2 is not None else w2
        self.w13_scale = w13_scale
        self.w2_scale = w2_scale
        self.shared_w13_scale = shared_w13_scale
        self.shared_w2_scale = shared_w2_scale
        self.row_div = self._row_div(w13_scale, two_i)
        self.shared_row_div = self._row_div(shared_w13_scale, 2 * inter * self.num_shared)
        # Gate and up rows of every expert (and shared slice) start on 128-row scale blocks:
        # a tile of up to 128 rows then has one scale per K block (moe_decode's x scaling).
        self.block_scaled = (
            self.row_div == _SCALE_BLOCK
            and (self.num_shared == 0 or self.shared_row_div == _SCALE_BLOCK)
            and inter % _SCALE_BLOCK == 0
        )
        for scale in (w2_scale, shared_w2_scale):
            if scale is not None and scale.shape[-2] != triton.cdiv(hidden, _SCALE_BLOCK):
                raise ValueError("moe_decode: down-projection scales must be 128-row blocks")

    @staticmethod
    def _row_div(scale: torch.Tensor | None, rows: int) -> int:
        """Output rows per scale row: 1 (per-row scales) or 128 (block scales)."""
        if scale is None or rows == 0 or scale.shape[-2] == rows:
            return 1
        if scale.shape[-2] == triton.cdiv(rows, _SCALE_BLOCK):
            return _SCALE_BLOCK
        raise ValueError(f"moe_decode: {scale.shape[-2]} scale rows for {rows} weight rows")


def scale_args(scale: torch.Tensor | None, stand_in: torch.Tensor) -> tuple:
    """(pointer, expert stride, row stride); strides are 0 where there is no such dim."""
    if scale is None:
        return stand_in, 0, 0
    if scale.dim() == 3:
        return scale, scale.stride(0), scale.stride(1)
    return scale, 0, scale.stride(0)
