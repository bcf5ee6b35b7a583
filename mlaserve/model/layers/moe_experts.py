"""A layer's routed experts run over its tokens' (token, expert) pairs, outside the fused kernels.

`FusedExperts` (weights and loading from `ExpertWeights`) runs one of:
    grouped_mm  sort (token, expert) pairs by expert, device-side offsets, two
                `torch._grouped_mm` calls. No host sync on CUDA SM90+ in bf16 (CUDA-graph
                safe); also runs on CPU (tests).
    loop        the same sorted layout, one GEMM per expert with tokens; reads the per-expert
                counts on the host, so CPU only (the default there).
    dense       every expert over every token, weighted by a [T, E] routing matrix that is zero
                off the top-k. No sync, any dtype/device, E times the FLOPs: the CUDA fallback
                when grouped_mm cannot run.
With FP8 weights both GEMMs of the sorted layout run `grouped_block_fp8_linear` (a Triton
block-FP8 grouped GEMM on CUDA, graph-safe; a per-expert loop on CPU).

On CUDA the sorted layout's pairs are sorted by two kernels (`ops/expert_sort.py`, up to its size
limit), in bf16 the gate_up GEMM runs with x's gather and SiLU-and-mul inside it
(`ops/moe_prefill_gemm.py`, up to a few hundred rows an expert; past that `torch._grouped_mm`).
Called with `combine=False`, the sorted path returns its expert rows uncombined
(`SortedExpertRows`): the next residual-add + RMSNorm weights, sums and adds them in its own
launch, so the combined [T, H] tensor is never written.

Expert parallelism (`ExpertWeights.expert_parallel`: this rank holds experts [first, first +
E_local)): the router's global ids become local ones, and a pair whose expert lives on another
rank goes to one more bin, E_local, which sorts after every local expert's rows. The GEMMs read
the counts of the local experts only (the FP8 grouped GEMM's blocks of that bin are marked -1,
skipped), so no FLOP is spent on another rank's expert, and those rows' outputs are set to 0
before the combine: each rank returns its experts' share of every token, the all-reduce sums
them. The dense path scatters that bin into a routing column it drops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from mlaserve.config import QuantizationConfig
from mlaserve.model.layers.linear import NO_TP, TensorParallel, wide_linear
from mlaserve.model.layers.mlp import silu_and_mul
from mlaserve.model.layers.moe_expert_weights import ExpertWeights
from mlaserve.ops import fused_ops_enabled
from mlaserve.ops.fp8_grouped_gemm import (
    GroupedLayout,
    grouped_block_fp8_linear,
    grouped_layout,
)
from mlaserve.ops.moe_partials import SortedExpertRows

__all__ = ["ExpertsImpl", "FusedExperts"]

ExpertsImpl = Literal["auto", "grouped_mm", "loop", "dense"]


def _no_join() -> None:
    """`FusedExperts.forward`'s join when the shared experts ran on this stream."""


@functools.cache
def _has_sync_free_grouped_mm(device: torch.device) -> bool:
    """torch's bf16 `_grouped_mm` runs a CUTLASS kernel with device-side offsets on SM90+;
    below that it falls back to a loop that copies the offsets to the host (a sync)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


class FusedExperts(ExpertWeights):
    """All routed experts of a layer (`ExpertWeights`) and the paths that run them; `impl`
    picks one (`auto`: by device and dtype, `resolved_impl`)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        impl: ExpertsImpl = "auto",
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            num_experts,
            hidden_size,
            intermediate_size,
            params_dtype=params_dtype,
            tp=tp,
            quant=quant,
        )
        self.impl: ExpertsImpl = impl
        # On CUDA the sorted path's SiLU-and-mul and its return to token order (unsort, weight,
        # sum, + shared) are Triton kernels (`ops/silu_and_mul.py`, `ops/moe_sorted_combine.py`);
        # the torch code below is their reference and the CPU path.
        self.act = silu_and_mul
        self._sorted_combine = None
        self._sort_by_expert, self._sort_max_pairs = None, 0
        self._gate_up_silu, self._gate_up_silu_max_rows = None, 0
        if fused_ops_enabled(self.gate_up_proj.device):
            from mlaserve.ops.expert_sort import EXPERT_SORT_MAX_PAIRS, sort_by_expert
            from mlaserve.ops.moe_sorted_combine import moe_sorted_combine
            from mlaserve.ops.silu_and_mul import silu_and_mul as fused_silu_and_mul

            self.act, self._sorted_combine = fused_silu_and_mul, moe_sorted_combine
            self._sort_by_expert, self._sort_max_pairs = sort_by_expert, EXPERT_SORT_MAX_PAIRS
            if quant is None and not self.expert_parallel:  # counts every row: no other bin
                from mlaserve.ops.moe_prefill_gemm import (
                    PREFILL_GATE_UP_MAX_ROWS,
                    expert_gate_up_silu,
                )

                self._gate_up_silu = expert_gate_up_silu
                self._gate_up_silu_max_rows = PREFILL_GATE_UP_MAX_ROWS * num_experts

    def resolved_impl(self, x: torch.Tensor) -> ExpertsImpl:
        if self.impl != "auto":
            return self.impl
        if x.device.type == "cpu":
            return "loop"
        if x.dtype == torch.bfloat16 and _has_sync_free_grouped_mm(x.device):
            return "grouped_mm"
        return "dense"

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None = None,
        join: Callable[[], None] | None = None,
        *,
        combine: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | SortedExpertRows:
        """x [T, H]; topk_weights [T, K] fp32; topk_ids [T, K] global expert ids; shared [T, H]
        (the shared experts' output, added last; x's dtype or fp32) or None -> [T, H] (partial
        under TP or EP) in `out_dtype`: x's by default; fp32 (a tensor-parallel rank's share)
        sums the routed rows and `shared` without rounding.
        `join`: called before `shared` is first read (it is still being computed on another
        stream).
        `combine=False`: the sorted path's fused kernels may return the rows uncombined
        (`SortedExpertRows`), for the next norm to combine in its launch (x's dtype only)."""
        join = join or _no_join
        out_dtype = out_dtype or x.dtype
        if x.shape[0] == 0:
            join()
            return torch.zeros_like(x, dtype=out_dtype)
        if self.expert_parallel:
            topk_ids = self.local_ids(topk_ids)
        args = (x, topk_weights, topk_ids, shared)
        if self.quant is not None:
            return self._forward_sorted(*args, False, join, combine, out_dtype)
        impl = self.resolved_impl(x)
        if impl == "dense":
            y = self._forward_dense(x, topk_weights, topk_ids)  # fp32
            join()
            return _add_shared(y, shared, out_dtype)
        grouped = impl == "grouped_mm"
        return self._forward_sorted(*args, grouped, join, combine, out_dtype)

    def _forward_sorted(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None,
        use_grouped_mm: bool,
        join: Callable[[], None],
        combine: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | SortedExpertRows:
        num_tokens, top_k = topk_ids.shape
        num_rows = topk_ids.numel()
        # EP: one bin more, for the pairs of other ranks' experts (sorted last, read by no GEMM)
        bins = self.num_experts + int(self.expert_parallel)
        pos = None  # pair -> sorted position, where the sort gives it
        if self._sort_by_expert is not None and num_rows <= self._sort_max_pairs:
            # one launch for the torch ops below
            order, token, pos, counts = self._sort_by_expert(topk_ids.contiguous(), bins)
        else:
            flat_ids = topk_ids.reshape(-1)  # [T*K], pair p = (token p // K, slot p % K)
            # Narrow sort keys: one radix pass for up to 256 experts instead of eight for
            # int64 (the same stable order).
            keys = flat_ids.to(torch.uint8 if bins <= 256 else torch.int32)
            order = torch.argsort(keys, stable=True)  # pairs grouped by expert
            counts = torch.zeros(bins, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
            token = order // top_k
        all_counts, counts = counts, counts[: self.num_experts]  # the GEMMs': local experts'
        if self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None:
            xs = x[token]  # [T*K, H], rows of expert e are contiguous
            # one block -> expert map for both GEMMs (CPU: the emulated loop needs none)
            layout = self._layout(all_counts, num_rows) if x.is_cuda else None
            w13, s13 = self.gate_up_proj, self.gate_up_proj_scale_inv
            h = self.act(grouped_block_fp8_linear(xs, counts, w13, s13, layout=layout))
            w2, s2 = self.down_proj, self.down_proj_scale_inv
            out = grouped_block_fp8_linear(h, counts, w2, s2, layout=layout)
        elif use_grouped_mm:
            offs = counts.cumsum(0, dtype=torch.int32)  # [E] end row of each expert
            w13 = self.gate_up_proj
            if self._gate_up_silu is not None and num_rows <= self._gate_up_silu_max_rows:
                # x's rows gathered and SiLU-and-mul applied inside the GEMM
                h = self._gate_up_silu(x.contiguous(), order, counts, w13)
            else:
                h = self.act(torch._grouped_mm(x[token], w13.transpose(1, 2), offs=offs))
            out = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)  # [T*K, H]
        else:
            xs = x[token]
            wide = out_dtype == torch.float32  # a TP rank's share: its rows unrounded too
            out = torch.empty_like(xs, dtype=torch.float32 if wide else xs.dtype)
            start = 0
            for e, n in enumerate(counts.tolist()):  # host sync: CPU path only
                if n:
                    rows = xs[start : start + n]
                    h = silu_and_mul(F.linear(rows, self.gate_up_proj[e]))
                    down = self.down_proj[e]
                    out[start : start + n] = wide_linear(h, down) if wide else F.linear(h, down)
                    start += n
        if self.expert_parallel:  # other ranks' pairs (the last rows) were never written
            out = torch.where(self._local_rows(counts, num_rows)[:, None], out, 0)
        join()
        out_dtype = out_dtype or x.dtype
        if self._sorted_combine is not None:
            if not combine and pos is not None and out_dtype == x.dtype:
                weights = topk_weights.contiguous()  # the next norm combines (the same bits)
                return SortedExpertRows(out, order, pos, weights, shared)
            return self._sorted_combine(
                out, order, topk_weights, shared, pos=pos, out_dtype=out_dtype
            )
        unsorted = torch.empty_like(out).index_copy_(0, order, out)  # back to pair order
        y = (unsorted.view(num_tokens, top_k, -1).float() * topk_weights[..., None]).sum(1)
        return _add_shared(y, shared, out_dtype)

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """EP: global expert ids [T, K] -> this rank's stack index, or E_local (the extra bin)
        for another rank's expert. Device ops only (graph-safe)."""
        local = topk_ids - self.first_expert
        mine = (local >= 0) & (local < self.num_experts)
        return torch.where(mine, local, self.num_experts)

    def _layout(self, all_counts: torch.Tensor, num_rows: int) -> GroupedLayout:
        """The FP8 grouped GEMM's block -> expert map; under EP the extra bin's blocks are
        marked -1 (the kernel skips them), so only local experts' rows are computed."""
        layout = grouped_layout(all_counts, num_rows)
        if not self.expert_parallel:
            return layout
        other = layout.block_expert == self.num_experts
        return layout._replace(block_expert=torch.where(other, -1, layout.block_expert))

    @staticmethod
    def _local_rows(counts: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[R] bool: sorted rows that belong to a local expert (the first sum(counts))."""
        return torch.arange(num_rows, device=counts.device) < counts.sum()

    def _forward_dense(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        bins = self.num_experts + int(self.expert_parallel)  # EP: the last column is dropped
        routing = torch.zeros(x.shape[0], bins, dtype=torch.float32, device=x.device).scatter_(
            1, topk_ids, topk_weights
        )  # [T, E], zero off the top-k
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            h = silu_and_mul(F.linear(x, self.gate_up_proj[e]))
            y += routing[:, e : e + 1] * F.linear(h, self.down_proj[e]).float()
        return y  # fp32: `_add_shared` rounds


def _add_shared(y: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The routed experts' fp32 sum y [T, H] plus `shared`, in `dtype`: rounded, then + shared
    rounded again (the fused combine's roundings, `ops.moe_sorted_combine`); fp32: no rounding."""
    if dtype == torch.float32:
        return y if shared is None else y + shared.float()
    y = y.to(dtype)
    return y if shared is None else y + shared
