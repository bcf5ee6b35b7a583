"""Causal varlen (ragged) attention through torch's own FlashAttention-2 kernels, for the MHA form
of MLA prefill on GPUs whose vendor packages ship no dense prefill kernel (Hopper: FlashMLA's
dense kernels are decode only).

Kernel boundary (`torch.ops.aten._flash_attention_forward`, aten's FA2, varlen form):

    q    [T, H, D]   bf16/fp16, D = d_n + d_r (192 for DeepSeek), last dim contiguous
    k    [S, H, D]   same dtype
    v    [S, H, D_v] same dtype; FA2 wants D_v == D on the torch builds that reject otherwise:
                     then v is zero-padded to D and the output sliced back (the padded columns
                     of P @ V are zero, so the first D_v columns are exact)
    cu_q [bs + 1] int32, cu_k [bs + 1] int32: row offsets of each sequence in q and k/v
    out  [T, H, D_v] in q's dtype; lse [H, T] fp32 (each row's log-sum-exp, for split-KV)

Causal with more keys than queries is FA2's bottom-right alignment: query row i of a sequence
with q_len new tokens and L keys sees keys 0 .. L - q_len + i, the mask of `mha_extend.py`, so a
prefill chunk over a cached prefix is exact.

Why aten's op and not `torch.nn.attention.varlen.varlen_attn`, the public wrapper over it:
importing that module imports torch._dynamo (1.4 s on the CPU build machine, ~3.7 s of an H200
host's engine start-up, bench/RESULTS.md), for a custom-op registration this path never uses.

Why this kernel (bench/prefill_attention.py; measured: bench/RESULTS.md, "Prefill attention
kernels, one layer, V2-Lite heads (16)"): torch 2.11's FA2 rejects v 128 with q 192 (so v is
padded); cuDNN's SDPA is faster but its causal mask is top-left, so it only takes fresh prompts
(`cudnn_fresh.py`); SDPA's flash backend has no kernel for these head dims. A hit of a few new
tokens over a long cached prefix splits the prefix over more CTAs (`prefix_split.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from mlaserve import switches
from mlaserve.kernels_adapter.prefix_split import (
    SplitOffsets,
    SplitPlan,
    merge_partials,
    plan_split,
    split_offsets,
    split_prefix_attention,
)

if TYPE_CHECKING:
    from mlaserve.kernels_adapter.mha_extend import ExtendLayout

__all__ = ["FlashVarlenAttention", "flash_varlen_available"]

_DTYPES = (torch.float16, torch.bfloat16)


def flash_varlen_available(device: torch.device) -> bool:
    """`device` is a CUDA GPU torch's FA2 kernels run on (SM80+, a build with them)."""
    return (
        device.type == "cuda"
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(device)[0] >= 8
    )


class FlashVarlenAttention:
    """`__call__(q, k, v, layout, softmax_scale) -> [T, H, D_v]`: one FA2 launch per layer for
    the whole ragged batch (two and a merge for a split prefix-cache hit). Construction probes,
    on `device`, whether this torch's FA2 takes a value head dim different from the query's (one
    tiny launch, at start-up, never per step). `fused_merge_shape` = (heads, qk head dim, v head
    dim) of the layers: split hits merge in one Triton launch (`ops/attention_merge.py`),
    compiled for those shapes by `warm_up_tasks`; None: in torch."""

    def __init__(
        self, device: torch.device, fused_merge_shape: tuple[int, int, int] | None = None
    ) -> None:
        if not flash_varlen_available(device):
            raise RuntimeError("FlashVarlenAttention: needs torch's FA2 on an SM80+ CUDA GPU")
        self.device = device
        self.pads_v = not self._accepts_narrow_v()
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._merge = merge_partials
        if fused_merge_shape is not None:
            from mlaserve.ops.attention_merge import merge_attention

            self._merge = merge_attention
        self._fused_merge_shape = fused_merge_shape
        self._splits = switches.prefix_split()
        # The last forward's split, keyed by its layout (one object per forward, shared by its
        # layers; held here, so no later layout can take its identity): planned once a forward.
        self._split: tuple[ExtendLayout, tuple[SplitPlan, SplitOffsets] | None] | None = None

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return out, lse

    def _accepts_narrow_v(self) -> bool:
        q = torch.randn(8, 2, 64, dtype=torch.bfloat16, device=self.device)
        v = torch.randn(8, 2, 32, dtype=torch.bfloat16, device=self.device)
        cu = torch.tensor([0, 8], dtype=torch.int32, device=self.device)
        try:
            out, _ = self._attend(q, q, v, cu, cu, 8, 8, True)
        except RuntimeError:
            return False
        return out.shape[-1] == 32

    def warm_up_tasks(self) -> list[Callable[[], None]]:
        """The fused merge's compile for the layers' shapes, as a task (none with the torch
        merge)."""
        shape = self._fused_merge_shape
        return [] if shape is None else [partial(self._warm_up_merge, *shape)]

    def _warm_up_merge(self, heads: int, qk_dim: int, v_dim: int) -> None:
        """Compile the merge for the layers' shapes (its runtime sizes are not specialised)."""
        width = qk_dim if self.pads_v else v_dim
        new = torch.zeros(2, heads, width, dtype=torch.bfloat16, device=self.device)
        lse = torch.zeros(heads, 4, device=self.device)
        self._merge(torch.cat([new, new]), lse, new, lse[:, :2].contiguous(), 2, v_dim)

    def _split_of(
        self, layout: ExtendLayout, heads: int, device: torch.device
    ) -> tuple[SplitPlan, SplitOffsets] | None:
        """The forward's split plan and its device offsets, or None: one launch."""
        if self._split is None or self._split[0] is not layout:
            plan = None
            if self._splits:
                plan = plan_split(layout.q_lens, layout.kv_lens, heads, self._num_sms)
            split = None if plan is None else (plan, split_offsets(plan, device))
            self._split = (layout, split)
        return self._split[1]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: ExtendLayout,
        softmax_scale: float,
    ) -> torch.Tensor:
        out_dtype, d_v = q.dtype, v.shape[-1]
        dtype = q.dtype if q.dtype in _DTYPES else torch.bfloat16
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if self.pads_v and d_v != q.shape[-1]:
            padded = v.new_zeros(*v.shape[:-1], q.shape[-1])
            padded[..., :d_v] = v
            v = padded
        q = q.contiguous() if q.stride(-1) != 1 else q
        split = self._split_of(layout, q.shape[1], q.device)
        if split is not None:
            attend = partial(self._attend, scale=softmax_scale)
            out = split_prefix_attention(attend, self._merge, q, k, v, *split, d_v)
            return out.to(out_dtype)
        out, _ = self._attend(
            q, k, v, layout.cu_q, layout.cu_kv, layout.max_q_len, layout.max_kv_len, True,
            scale=softmax_scale,
        )  # fmt: skip
        return out[..., :d_v].to(out_dtype)
