"""DeepSeek mixture of experts: a top-k router, routed experts run batched, shared experts.

Routing (`select_experts`, pure function, fp32):
    V2  softmax scores; `greedy` top-k, or `group_limited_greedy` (keep the `topk_group` groups
        with the highest max score, then top-k inside them);
    V3  sigmoid scores; `noaux_tc`: choose with scores + e_score_correction_bias, groups ranked
        by the sum of their two best biased scores, weights are the *unbiased* scores.
    Then optional renormalisation (`norm_topk_prob`) and `routed_scaling_factor`.

Routed experts (`FusedExperts`) keep all experts' weights stacked, [E, 2I, H] (gate | up) and
[E, H, I], and run one of:
    grouped_mm  sort (token, expert) pairs by expert, device-side offsets, two
                `torch._grouped_mm` calls. No host sync on CUDA SM90+ in bf16 (CUDA-graph
                safe); also runs on CPU (tests).
    loop        the same sorted layout, one GEMM per expert with tokens; reads the per-expert
                counts on the host, so CPU only (the default there).
    dense       every expert over every token, weighted by a [T, E] routing matrix that is zero
                off the top-k. No sync, any dtype/device, E times the FLOPs: the CUDA fallback
                when grouped_mm cannot run.

Built with `quant`, the stacked weights are FP8 with block scales (`gate_up_proj_scale_inv`
[E, 2I/128 or 2I, H/128], `down_proj_scale_inv` [E, H/128, I/128]; layout in `fp8_linear.py`)
and both GEMMs of the sorted layout run `grouped_block_fp8_linear` (a Triton block-FP8 grouped
GEMM on CUDA, graph-safe; a per-expert loop on CPU).

Decode-sized batches (at most `DeepseekMoE.decode_max_tokens` tokens) skip all of that on CUDA:
`mlaserve/ops/moe_decode.py` runs routed and shared experts together in three kernels, bf16 or
FP8 weights, the expert selection inside the first (`MLASERVE_MOE_DECODE_MAX_TOKENS=0` turns
it off, `MLASERVE_FUSED_ROUTING=0` selects first, for A/B runs). Batches past that,
up to `grouped_max_tokens` (large decode batches, speculative VERIFY steps), run
`mlaserve/ops/moe_grouped.py`: the shared experts folded in as always-selected experts, one
alignment kernel, two tensor-core grouped GEMMs and the combine (`MLASERVE_MOE_GROUPED_MAX_TOKENS
=0` turns it off). Prefill-sized batches keep the sorted layout: on CUDA the pairs sorted by
two kernels (`ops/expert_sort.py`, up to its size limit), in bf16 the gate_up GEMM with x's
gather and SiLU-and-mul inside it (`ops/moe_prefill_gemm.py`, up to a few hundred rows an
expert; past that CUTLASS's `torch._grouped_mm`), the down GEMM `torch._grouped_mm`, and the
shared experts' dense GEMMs on a side stream beside the router and the routed GEMMs
(H100, V2-Lite, 2048-token prefill TTFT 31.2-31.6 -> 30.6-30.8 ms; `MLASERVE_SHARED_OVERLAP=0`
runs them in line, for A/B runs). Called by a decoder layer (`combine=False`), the sorted path
returns its expert rows uncombined (`SortedExpertRows`): the next residual-add + RMSNorm
weights, sums and adds them in its own launch, so the combined [T, H] tensor is never written.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.layers.fp8_linear import copy_block_rows, make_fp8_weight, needs_per_row_scales
from mlaserve.model.layers.linear import (
    NO_TP,
    TensorParallel,
    all_reduce,
    check_shape,
    narrow_gemv_max_m,
)
from mlaserve.model.layers.mlp import DeepseekMLP, silu_and_mul
from mlaserve.ops import fused_ops_enabled
from mlaserve.ops.fp8_grouped_gemm import grouped_block_fp8_linear, grouped_layout
from mlaserve.ops.moe_partials import MoePartials, SortedExpertRows

if TYPE_CHECKING:
    from mlaserve.ops.moe_decode import MoeDecodeWeights
    from mlaserve.ops.routing import Routing

__all__ = ["DeepseekMoE", "ExpertsImpl", "FusedExperts", "TopKRouter", "select_experts"]

logger = logging.getLogger(__name__)

ExpertsImpl = Literal["auto", "grouped_mm", "loop", "dense"]

# Up to this many tokens the decode kernels (one GEMV per (token, expert) pair) run; past it the
# grouped kernels. On an H100 (bench/RESULTS.md, 2026-11-26 seventh session, after the grouped
# kernels' wider tiles):
# - V2-Lite layer (17 MB an expert in bf16), kernels alone, decode / grouped: bf16 113.6 / 118.9
#   us at 3 tokens, 143.4 / 140.5 at 4, 194.6 / 191.6 at 6, 232.3 / 224.7 at 8; FP8 79.2 / 91.1
#   at 4, 107.0 / 105.4 at 6, 141.7 / 141.4 at 8. In the whole model the grouped kernels gain
#   more than alone (a pair's GEMV re-reads what the grouped GEMM reads once per tile of tokens):
#   V3-lite's bs-1 speculative step (a 4-token VERIFY) 5.781 -> 5.576 ms.
# - The default model (98 KB an expert: every kernel is launch latency), graphed decode step
#   with the decode kernels up to 3 / up to 8 tokens: bs 4 0.396 / 0.367 ms, bs 8 0.507 / 0.481.
# So bf16 layers bound by their weight bytes switch after 3 tokens, the others after 8.
DECODE_MAX_TOKENS = 8
DECODE_MAX_TOKENS_BYTES_BOUND = 3  # bf16 / fp16 experts of >= BYTES_BOUND_EXPERT_BYTES
BYTES_BOUND_EXPERT_BYTES = 1 << 20  # one expert's gate_up + down
# Up to this many tokens the grouped MoE kernels run (past DECODE_MAX_TOKENS): bf16 and FP8
# weights. One V2-Lite layer on an H100 (bench/moe_decode.py, with the sorted path's sort and
# gate_up kernels), sorted / grouped, us: bf16 461.4 / 461.1 at 256 tokens, 477.9 / 486.5 at
# 320, 479.6 / 511.9 at 384, 484.9 / 500.4 at 512; FP8 348.1 / 321.0 at 256, 371.3 / 388.6 at
# 320 (bench/RESULTS.md).
GROUPED_MAX_TOKENS = 256
GROUPED_MAX_TOKENS_FP8 = 256
# Up to this many tokens moe_decode selects the experts inside its first kernel. H100, V2-Lite,
# graph replay (bench/RESULTS.md): bs 1 2.411 -> 2.380 and 2.416 -> 2.377 ms, bs 2 3.54 -> 3.46
# ms; bs 4 within noise (4.956 -> 5.007), bs 8 +0.5% (every routed program recomputes its
# token's selection: 8 tokens, 8x the programs).
SELECT_IN_KERNEL_MAX_TOKENS = 2


def select_experts(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (weights [T, K] fp32, expert ids [T, K] int64)."""
    num_tokens, num_experts = router_logits.shape
    if scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1)
    else:
        scores = router_logits.sigmoid()
    per_group = num_experts // n_group

    if topk_method == "noaux_tc":
        choice = scores if correction_bias is None else scores + correction_bias
        group_scores = (
            choice.view(num_tokens, n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        )  # [T, G]
        choice = choice.masked_fill(
            ~_group_mask(group_scores, topk_group, per_group), float("-inf")
        )
        topk_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    elif topk_method == "group_limited_greedy":
        group_scores = scores.view(num_tokens, n_group, per_group).max(dim=-1).values  # [T, G]
        masked = scores.masked_fill(~_group_mask(group_scores, topk_group, per_group), 0.0)
        topk_weights, topk_ids = masked.topk(top_k, dim=-1, sorted=False)
    else:  # greedy
        topk_weights, topk_ids = scores.topk(top_k, dim=-1, sorted=False)

    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def _no_join() -> None:
    """`FusedExperts.forward`'s join when the shared experts ran on this stream."""


def _data(param: nn.Parameter | None) -> torch.Tensor | None:
    return None if param is None else param.data


def _group_mask(group_scores: torch.Tensor, topk_group: int, per_group: int) -> torch.Tensor:
    """[T, G] group scores -> [T, G * per_group] bool, True for experts in the best groups."""
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return mask.repeat_interleave(per_group, dim=1)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream a prefill-sized MoE layer runs its shared experts on, beside the routed ones:
    one per device, shared by every layer (the caching allocator reuses a block only on the
    stream that allocated it). None off CUDA or with `MLASERVE_SHARED_OVERLAP=0` (A/B runs)."""
    if device.type != "cuda" or os.environ.get("MLASERVE_SHARED_OVERLAP", "1") == "0":
        return None
    return torch.cuda.Stream(device)


@functools.cache
def _has_sync_free_grouped_mm(device: torch.device) -> bool:
    """torch's bf16 `_grouped_mm` runs a CUTLASS kernel with device-side offsets on SM90+;
    below that it falls back to a loop that copies the offsets to the host (a sync)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


class TopKRouter(nn.Module):
    """The gate. Weight and correction bias are kept in fp32 (routing is precision-sensitive;
    transformers also routes in fp32)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts is not None  # internal: only built for MoE layers
        self.config = config
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(
            torch.empty(num_experts, config.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias: nn.Parameter | None = None
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(num_experts, dtype=torch.float32), requires_grad=False
            )
        # On CUDA the whole selection is one Triton kernel (`mlaserve/ops/routing.py`, about 15
        # small kernels fewer per layer); `select_experts` is its reference and the CPU path.
        self.select = select_experts
        # Decode-sized inputs: the logits by `ops.gemv` (bf16 activations against the fp32 gate
        # in registers: one launch for the cast and the cuBLAS GEMM); larger ones by
        # `ops.router_logits` (the same in one tensor-core kernel, tf32x3).
        self.gemv_max_m = 0
        self._router_logits = None
        if fused_ops_enabled(self.weight.device):
            from mlaserve.ops.router_logits import router_logits
            from mlaserve.ops.routing import fused_select_experts

            self.select = fused_select_experts
            self.gemv_max_m = narrow_gemv_max_m(config.hidden_size)
            self._router_logits = router_logits

    def warm_up_gemv(self, act_dtype: torch.dtype) -> None:
        """Compile the logits' and the selection's kernels for every token count they take,
        before serving."""
        if self.gemv_max_m:
            from mlaserve.ops.gemv import gemv_warm_up

            gemv_warm_up(self.weight, None, self.gemv_max_m, act_dtype, torch.float32)
        if self._router_logits is not None and act_dtype != torch.float32:
            from mlaserve.ops.router_logits import router_logits_variants

            num_experts, hidden = self.weight.shape
            for num_tokens in [1, *router_logits_variants(num_experts, hidden)]:
                self(torch.zeros(num_tokens, hidden, dtype=act_dtype, device=self.weight.device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, K] fp32, ids [T, K] int64)"""
        return self.select(self.logits(x), **self._selection())

    def plan(self, x: torch.Tensor) -> Routing:
        """x [T, hidden] -> the logits, and the selection not yet run (fused ops only): for
        `moe_decode` to run inside its first kernel."""
        from mlaserve.ops.routing import plan_routing

        return plan_routing(self.logits(x), **self._selection())

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> router logits [T, E] fp32"""
        if 0 < x.shape[0] <= self.gemv_max_m:
            from mlaserve.ops.gemv import gemv

            return gemv(x.contiguous(), self.weight, out_dtype=torch.float32)
        if self._router_logits is not None and x.dtype != torch.float32:
            return self._router_logits(x, self.weight)
        return F.linear(x.float(), self.weight)

    def _selection(self) -> dict:
        c = self.config
        return {
            "top_k": c.num_experts_per_tok,
            "scoring_func": c.scoring_func,
            "topk_method": c.topk_method,
            "n_group": c.n_group,
            "topk_group": c.topk_group,
            "norm_topk_prob": c.norm_topk_prob,
            "routed_scaling_factor": c.routed_scaling_factor,
            "correction_bias": self.e_score_correction_bias,
        }


class FusedExperts(nn.Module):
    """All routed experts of a layer, weights stacked. Tensor parallel splits each expert's
    intermediate dim (rank r keeps gate/up rows and down columns [r*I/tp, (r+1)*I/tp))."""

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
        super().__init__()
        self.num_experts, self.hidden_size, self.tp = num_experts, hidden_size, tp
        self.intermediate_size = intermediate_size
        local = tp.split(intermediate_size, "moe_intermediate_size")
        self.impl: ExpertsImpl = impl
        self.quant = quant
        # On CUDA the sorted path's SiLU-and-mul and its return to token order (unsort, weight,
        # sum, + shared) are Triton kernels (`ops/silu_and_mul.py`, `ops/moe_sorted_combine.py`);
        # the torch code below is their reference and the CPU path.
        self.act = silu_and_mul
        self._sorted_combine = None
        self._sort_by_expert, self._sort_max_pairs = None, 0
        self._gate_up_silu, self._gate_up_silu_max_rows = None, 0
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        if quant is None:
            self.gate_up_proj = nn.Parameter(
                torch.empty(num_experts, 2 * local, hidden_size, dtype=params_dtype),
                requires_grad=False,
            )  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
            self.down_proj = nn.Parameter(
                torch.empty(num_experts, hidden_size, local, dtype=params_dtype),
                requires_grad=False,
            )  # [E, H, I]
            self.gate_up_proj.weight_loader = self.weight_loader
            self.down_proj.weight_loader = self.weight_loader
        else:
            if tp.size > 1:
                raise NotImplementedError("FP8 block weights under tensor parallelism: not wired")
            self.gate_up_per_row = needs_per_row_scales([local, local], quant)
            self.gate_up_proj, self.gate_up_proj_scale_inv = make_fp8_weight(
                (num_experts,), 2 * local, hidden_size, quant, per_row=self.gate_up_per_row
            )
            self.down_proj, self.down_proj_scale_inv = make_fp8_weight(
                (num_experts,), hidden_size, local, quant, per_row=False
            )
            self.gate_up_proj.weight_loader = self.fp8_weight_loader
            self.down_proj.weight_loader = self.fp8_weight_loader
        if fused_ops_enabled(self.gate_up_proj.device):
            from mlaserve.ops.expert_sort import EXPERT_SORT_MAX_PAIRS, sort_by_expert
            from mlaserve.ops.moe_sorted_combine import moe_sorted_combine
            from mlaserve.ops.silu_and_mul import silu_and_mul as fused_silu_and_mul

            self.act, self._sorted_combine = fused_silu_and_mul, moe_sorted_combine
            self._sort_by_expert, self._sort_max_pairs = sort_by_expert, EXPERT_SORT_MAX_PAIRS
            if quant is None:
                from mlaserve.ops.moe_prefill_gemm import (
                    PREFILL_GATE_UP_MAX_ROWS,
                    expert_gate_up_silu,
                )

                self._gate_up_silu = expert_gate_up_silu
                self._gate_up_silu_max_rows = PREFILL_GATE_UP_MAX_ROWS * num_experts

    def fp8_weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        expert_id: int | None = None,
        shard_id: int | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        """One expert's FP8 `gate_proj`/`up_proj` [I, H] (shard_id 0/1) or `down_proj` [H, I]
        with its block `scale` (a float tensor is quantised here). The fused whole-layer form
        (`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]) is accepted in float
        only: FP8 checkpoints publish per-expert tensors, and no fused scale layout exists."""
        assert self.quant is not None  # internal: only set as loader of FP8 parameters
        h, i = self.hidden_size, self.intermediate_size
        if expert_id is None:
            if scale is not None:
                raise ValueError("FP8 experts must come one tensor per expert (experts.{e}.*)")
            down = param is self.down_proj
            check_shape(loaded, (self.num_experts, h, i) if down else (self.num_experts, 2 * i, h))
            for e in range(self.num_experts):
                if down:
                    self.fp8_weight_loader(param, loaded[e], e)
                else:
                    for s in (0, 1):
                        self.fp8_weight_loader(param, loaded[e, s * i : (s + 1) * i], e, s)
            return
        if param is self.down_proj:
            check_shape(loaded, (h, i))
            dst_scale, row, per_row = self.down_proj_scale_inv, 0, False
        else:
            assert shard_id in (0, 1)  # internal: the loader passes 0 (gate) or 1 (up)
            check_shape(loaded, (i, h))
            dst_scale, row, per_row = (
                self.gate_up_proj_scale_inv,
                shard_id * i,
                self.gate_up_per_row,
            )
        assert dst_scale is not None  # internal: both are set when quant is
        copy_block_rows(
            param.data[expert_id],
            dst_scale.data[expert_id],
            loaded,
            scale,
            row,
            self.quant,
            per_row=per_row,
        )

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,
        expert_id: int | None = None,
        shard_id: int | None = None,
    ) -> None:
        """Either a whole stacked tensor (transformers' fused `experts.gate_up_proj` [E, 2I, H] /
        `experts.down_proj` [E, H, I]) or one expert's `gate_proj`/`up_proj` [I, H]
        (shard_id 0/1) or `down_proj` [H, I]."""
        num_e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        local = i // self.tp.size
        start = self.tp.rank * local
        if param is self.down_proj:
            if expert_id is None:
                check_shape(loaded, (num_e, h, i))
                param.data.copy_(loaded.narrow(2, start, local))
            else:
                check_shape(loaded, (h, i))
                param.data[expert_id].copy_(loaded.narrow(1, start, local))
            return
        if expert_id is None:
            check_shape(loaded, (num_e, 2 * i, h))
            for s in (0, 1):  # gate, up
                param.data[:, s * local : (s + 1) * local].copy_(
                    loaded.narrow(1, s * i + start, local)
                )
        else:
            assert shard_id in (0, 1)  # internal: the loader passes 0 (gate) or 1 (up)
            check_shape(loaded, (i, h))
            param.data[expert_id, shard_id * local : (shard_id + 1) * local].copy_(
                loaded.narrow(0, start, local)
            )

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
    ) -> torch.Tensor | SortedExpertRows:
        """x [T, H]; topk_weights [T, K] fp32; topk_ids [T, K]; shared [T, H] (the shared
        experts' output, added last) or None -> [T, H] (partial under TP). `join`: called
        before `shared` is first read (it is still being computed on another stream).
        `combine=False`: the sorted path's fused kernels may return the rows uncombined
        (`SortedExpertRows`), for the next norm to combine in its launch."""
        join = join or _no_join
        if x.shape[0] == 0:
            join()
            return torch.zeros_like(x)
        if self.quant is not None:
            return self._forward_sorted(x, topk_weights, topk_ids, shared, False, join, combine)
        impl = self.resolved_impl(x)
        if impl == "dense":
            y = self._forward_dense(x, topk_weights, topk_ids)
            join()
            return y if shared is None else y + shared
        grouped = impl == "grouped_mm"
        return self._forward_sorted(x, topk_weights, topk_ids, shared, grouped, join, combine)

    def _forward_sorted(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared: torch.Tensor | None,
        use_grouped_mm: bool,
        join: Callable[[], None],
        combine: bool = True,
    ) -> torch.Tensor | SortedExpertRows:
        num_tokens, top_k = topk_ids.shape
        num_rows = topk_ids.numel()
        pos = None  # pair -> sorted position, where the sort gives it
        if self._sort_by_expert is not None and num_rows <= self._sort_max_pairs:
            # one launch for the torch ops below
            order, token, pos, counts = self._sort_by_expert(
                topk_ids.contiguous(), self.num_experts
            )
        else:
            flat_ids = topk_ids.reshape(-1)  # [T*K], pair p = (token p // K, slot p % K)
            # Narrow sort keys: one radix pass for up to 256 experts instead of eight for
            # int64 (the same stable order).
            keys = flat_ids.to(torch.uint8 if self.num_experts <= 256 else torch.int32)
            order = torch.argsort(keys, stable=True)  # pairs grouped by expert
            counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
            counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
            token = order // top_k
        if self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None:
            xs = x[token]  # [T*K, H], rows of expert e are contiguous
            # one block -> expert map for both GEMMs (CPU: the emulated loop needs none)
            layout = grouped_layout(counts, num_rows) if x.is_cuda else None
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
            out = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(counts.tolist()):  # host sync: CPU path only
                if n:
                    rows = xs[start : start + n]
                    h = silu_and_mul(F.linear(rows, self.gate_up_proj[e]))
                    out[start : start + n] = F.linear(h, self.down_proj[e])
                    start += n
        join()
        if self._sorted_combine is not None:
            if not combine and pos is not None:  # the next norm combines (the same bits)
                weights = topk_weights.contiguous()
                return SortedExpertRows(out, order, pos, weights, shared)
            return self._sorted_combine(out, order, topk_weights, shared, pos=pos)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)  # back to pair order
        y = (unsorted.view(num_tokens, top_k, -1).float() * topk_weights[..., None]).sum(1)
        y = y.to(x.dtype)
        return y if shared is None else y + shared

    def _forward_dense(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        routing = torch.zeros(
            x.shape[0], self.num_experts, dtype=torch.float32, device=x.device
        ).scatter_(1, topk_ids, topk_weights)  # [T, E], zero off the top-k
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            h = silu_and_mul(F.linear(x, self.gate_up_proj[e]))
            y += routing[:, e : e + 1] * F.linear(h, self.down_proj[e]).float()
        return y.to(x.dtype)


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        assert config.n_routed_experts is not None  # internal: only built for MoE layers
        self.tp = tp
        self.gate = TopKRouter(config)  # the router stays fp32 (published FP8 checkpoints: bf16)
        self.experts = FusedExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            params_dtype=params_dtype,
            tp=tp,
            quant=quant,
        )
        self.shared_experts: DeepseekMLP | None = None
        if config.n_shared_experts:
            self.shared_experts = DeepseekMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.n_shared_experts,
                hidden_act=config.hidden_act,
                params_dtype=params_dtype,
                tp=tp,
                reduce_output=False,
                quant=quant,
            )

        # Set by process_weights_after_loading where the decode kernels run (CUDA + Triton):
        # batches of up to decode_max_tokens tokens take moe_decode, then up to
        # grouped_max_tokens moe_grouped.
        self.decode_weights: MoeDecodeWeights | None = None
        self.decode_max_tokens = 0
        self.grouped_max_tokens = 0
        # Up to this many tokens moe_decode selects the experts inside its first kernel (one
        # launch per layer fewer); `MLASERVE_FUSED_ROUTING=0`: never, for A/B runs.
        self.select_in_kernel = 0

    def process_weights_after_loading(self) -> None:
        """Hand the loaded weights to the decode kernels (views, no copies) where they run."""
        weight = self.experts.gate_up_proj
        if not fused_ops_enabled(weight.device) or weight.dtype == torch.float32:
            return
        fp8 = self.experts.quant is not None
        expert_bytes = sum(
            p[0].numel() * p.element_size() for p in (weight, self.experts.down_proj)
        )
        bytes_bound = not fp8 and expert_bytes >= BYTES_BOUND_EXPERT_BYTES
        decode_max = DECODE_MAX_TOKENS_BYTES_BOUND if bytes_bound else DECODE_MAX_TOKENS
        limit = int(os.environ.get("MLASERVE_MOE_DECODE_MAX_TOKENS", decode_max))
        default = GROUPED_MAX_TOKENS_FP8 if fp8 else GROUPED_MAX_TOKENS
        grouped = int(os.environ.get("MLASERVE_MOE_GROUPED_MAX_TOKENS", default))
        if limit <= 0 and grouped <= 0:
            return
        from mlaserve.ops.moe_decode import MoeDecodeWeights, moe_decode
        from mlaserve.ops.moe_grouped import moe_grouped

        self._moe_decode, self._moe_grouped = moe_decode, moe_grouped
        experts, shared = self.experts, self.shared_experts
        try:
            self.decode_weights = MoeDecodeWeights(
                experts.gate_up_proj.data,
                experts.down_proj.data,
                shared.gate_up_proj.weight.data if shared is not None else None,
                shared.down_proj.weight.data if shared is not None else None,
                w13_scale=_data(experts.gate_up_proj_scale_inv),
                w2_scale=_data(experts.down_proj_scale_inv),
                shared_w13_scale=_data(shared.gate_up_proj.weight_scale_inv) if shared else None,
                shared_w2_scale=_data(shared.down_proj.weight_scale_inv) if shared else None,
            )
        except ValueError as exc:  # a layout the kernels do not take: the grouped path serves
            logger.warning("MoE decode kernels off for this layer: %s", exc)
            return
        self.decode_max_tokens = max(limit, 0)
        self.grouped_max_tokens = max(grouped, 0)
        fused = os.environ.get("MLASERVE_FUSED_ROUTING", "1") != "0"
        self.select_in_kernel = SELECT_IN_KERNEL_MAX_TOKENS if fused else 0

    def warm_up_kernels(self, act_dtype: torch.dtype) -> None:
        """Compile every variant of the grouped kernels the token counts they serve take, and
        the sorted path's (SiLU-and-mul of the routed and shared experts) past them: the engine's
        warm-up request alone no longer reaches it."""
        if self.decode_weights is None:
            return
        if self.grouped_max_tokens > self.decode_max_tokens:
            from mlaserve.ops.moe_grouped import moe_grouped_warm_up

            moe_grouped_warm_up(
                self.decode_weights,
                self.gate.config.num_experts_per_tok,
                self.decode_max_tokens + 1,
                self.grouped_max_tokens,
                act_dtype,
            )
        past = max(self.decode_max_tokens, self.grouped_max_tokens) + 1
        device = self.experts.gate_up_proj.device
        self(torch.zeros(past, self.experts.hidden_size, dtype=act_dtype, device=device))

    def forward(
        self, x: torch.Tensor, *, combine: bool = True
    ) -> torch.Tensor | MoePartials | SortedExpertRows:
        """[T, hidden] -> [T, hidden]. `combine=False` lets the fused kernels return their
        output uncombined (`MoePartials`, `SortedExpertRows`) for the next residual-add +
        RMSNorm to combine in its own launch (one kernel fewer per layer); without tensor
        parallelism only (the all-reduce wants the sum), and other paths return the tensor all
        the same."""
        num_tokens, weights = x.shape[0], self.decode_weights
        kw = {"combine": combine or self.tp.size > 1}
        if weights is not None and num_tokens <= self.decode_max_tokens:
            if num_tokens <= self.select_in_kernel:  # the selection inside the first kernel
                plan = self.gate.plan(x)
                y = self._moe_decode(x, plan.weights, plan.ids, weights, routing=plan, **kw)
            else:
                y = self._moe_decode(x, *self.gate(x), weights, **kw)
            return y if isinstance(y, MoePartials) else all_reduce(y, self.tp)
        grouped = num_tokens <= self.grouped_max_tokens and x.dtype != torch.float32
        if weights is not None and grouped:
            y = self._moe_grouped(x, *self.gate(x), weights, **kw)
            return y if isinstance(y, MoePartials) else all_reduce(y, self.tp)
        side = _side_stream(x.device) if self.shared_experts is not None else None
        shared, join = None, None
        if side is not None:
            # The shared experts' dense GEMMs run on a side stream while the router, the sort
            # and the routed grouped GEMMs run on this one; the combine that adds them waits for
            # it (in a captured piece: two branches of the graph). Each stream allocates and
            # frees its own blocks after the fork and before the join, so no block is reused
            # under the other.
            main = torch.cuda.current_stream(x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared = self.shared_experts(x)
            join = functools.partial(main.wait_stream, side)
        elif self.shared_experts is not None:
            shared = self.shared_experts(x)
        topk_weights, topk_ids = self.gate(x)
        y = self.experts(x, topk_weights, topk_ids, shared, join=join, **kw)
        if isinstance(y, SortedExpertRows):
            return y
        return all_reduce(y, self.tp)  # one reduction for routed + shared partial sums
