"""DeepSeek mixture of experts: the layer, which picks how its routed and shared experts run.

The parts: the router (`moe_router.TopKRouter`, `select_experts`), the routed experts' weights
and their torch / sorted paths (`moe_expert_weights.ExpertWeights`, `moe_experts.FusedExperts`),
the shared experts (a `DeepseekMLP`). `DeepseekMoE.forward` picks a path by token count:

    up to `decode_max_tokens`   `ops/moe_decode.py`: routed and shared experts together in three
                                kernels, bf16 or FP8 weights, the expert selection inside the
                                first up to `select_in_kernel` tokens
    up to `grouped_max_tokens`  `ops/moe_grouped.py` (large decode batches, speculative VERIFY
                                steps): the shared experts folded in as always-selected experts,
                                one alignment kernel, two tensor-core grouped GEMMs, the combine
    past that (prefill)         the router, then `FusedExperts`' sorted layout, with the shared
                                experts' dense GEMMs on a side stream beside them on CUDA

The two kernel paths are set up where they run (CUDA + Triton, `process_weights_after_loading`);
their limits are the module constants below. A/B switches (README, "Switches"):
`MLASERVE_MOE_DECODE_MAX_TOKENS`, `MLASERVE_MOE_GROUPED_MAX_TOKENS`, `MLASERVE_FUSED_ROUTING`,
`MLASERVE_SHARED_OVERLAP`. Called by a decoder layer
(`combine=False`), the kernel paths return per-slot partials (`MoePartials`) and the sorted path
its expert rows (`SortedExpertRows`), for the next residual-add + RMSNorm to combine.

Built with `deterministic=True` (`EngineConfig.deterministic_inference`), every token count takes
one batch-invariant path (`_forward_invariant`): the router logits by `ops.invariant_matmul`
(fp32), the selection one program per token (`ops/routing.py`), then `moe_decode` with its tiles
and warps fixed (`decode_tiles` at several tokens): one program per (token, expert) pair and
output block, and the pairs' partials summed in slot order, so a token's result never depends on
the others'. Its cost grows with the pairs (each re-reads its expert; no tensor cores): cheap at
decode sizes, much slower than the grouped GEMMs at prefill sizes (README, "Deterministic
inference"). Off CUDA, the torch path one token at a time. Both sum the intermediate dim in the
fixed tree of `ops/invariant_rowwise.py` (each leaf: the slots in order over one chunk; this
rank's subtree, then the ranks' by `tree_all_reduce`), so the bits do not depend on the TP size.

Under tensor parallelism every routed and shared expert is split along its intermediate dim and
the layer all-reduces routed + shared partial sums once, in fp32, rounding the sum once
(`_reduce`). Expert parallelism
(`--enable-expert-parallel`, `TensorParallel.expert_parallel`) keeps whole routed experts per
rank (E / tp each, `moe_expert_weights.py`) over the same group, as SGLang and vLLM run EP over
the TP group without an all-to-all: the router is replicated, each rank computes its experts'
share of every token, the shared experts stay tensor-parallel, and the same single all-reduce sums
it all. Under EP every token count takes the sorted path (its other-rank bin skips the GEMMs):
the decode and grouped kernels index every routed id into the local stack, and would need to
skip other ranks' experts first.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve import switches
from mlaserve.config import ModelConfig, QuantizationConfig
from mlaserve.model.layers.linear import NO_TP, TensorParallel, all_reduce, tree_all_reduce
from mlaserve.model.layers.mlp import DeepseekMLP, silu_and_mul
from mlaserve.model.layers.moe_experts import ExpertsImpl, FusedExperts
from mlaserve.model.layers.moe_router import TopKRouter, select_experts
from mlaserve.ops import fused_ops_enabled
from mlaserve.ops.fp8_gemm import W8A16_MAX_M
from mlaserve.ops.invariant_rowwise import TREE_LEAVES, leaf_width
from mlaserve.ops.moe_partials import MoePartials, SortedExpertRows
from mlaserve.tensor_parallel import RankPartials

if TYPE_CHECKING:
    from mlaserve.ops.moe_weights import MoeDecodeWeights

# ExpertsImpl, FusedExperts, TopKRouter, select_experts: re-exported (their import path before
# the router and the experts moved to moe_router / moe_expert_weights / moe_experts).
__all__ = ["DeepseekMoE", "ExpertsImpl", "FusedExperts", "TopKRouter", "select_experts"]

logger = logging.getLogger(__name__)

# Up to this many tokens the decode kernels (one GEMV per (token, expert) pair) run, past it the
# grouped kernels: a pair's GEMV re-reads what the grouped GEMM reads once per tile of tokens, so
# layers bound by their weight bytes (bf16 / fp16 experts of >= BYTES_BOUND_EXPERT_BYTES) switch
# sooner; small experts are launch latency, where the decode kernels' one launch fewer wins.
DECODE_MAX_TOKENS = 8
DECODE_MAX_TOKENS_BYTES_BOUND = 3  # bf16 / fp16 experts of >= BYTES_BOUND_EXPERT_BYTES
BYTES_BOUND_EXPERT_BYTES = 1 << 20  # one expert's gate_up + down
# FP8 experts wider than one of the decode kernels' FP8 runs (`moe_decode.FP8_RUN`, 2048; V3's
# and K2's 7168) take their long-K tiles (`decode_tiles`) up to WIDE_FP8_DECODE_MAX_TOKENS tokens,
# up to twice that where a rank's expert is at most WIDE_NARROW_INTER wide (TP4's V3 share), then
# the grouped kernels. The layer as the step calls it (router, selection, experts; H200): one TP2
# rank's V3 layer 67 / 117 us at 1 / 2 tokens against the grouped kernels' 94 / 131, even at 3;
# TP4's 42 / 127 us at 1 / 4 against 69 / 136. They select the experts outside the kernel: every
# routed program re-reading V3's split router logits took 122 us at one token (bench/RESULTS.md).
WIDE_FP8_DECODE_MAX_TOKENS = 2
WIDE_NARROW_INTER = 512
# Up to this many tokens the grouped MoE kernels run (past DECODE_MAX_TOKENS), bf16 and FP8
# weights; past it the sorted path is as fast or faster.
GROUPED_MAX_TOKENS = 256
GROUPED_MAX_TOKENS_FP8 = 256
# Up to this many tokens moe_decode selects the experts inside its first kernel (one launch
# fewer); past it every routed program recomputing its token's selection costs more.
SELECT_IN_KERNEL_MAX_TOKENS = 2


def _data(param: nn.Parameter | None) -> torch.Tensor | None:
    return None if param is None else param.data


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream a prefill-sized MoE layer runs its shared experts on, beside the routed ones:
    one per device, shared by every layer (the caching allocator reuses a block only on the
    stream that allocated it). None off CUDA or with `MLASERVE_SHARED_OVERLAP=0` (A/B runs)."""
    if device.type != "cuda" or not switches.shared_overlap():
        return None
    return torch.cuda.Stream(device)


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        assert config.n_routed_experts is not None  # internal: only built for MoE layers
        self.tp = tp
        self.deterministic = deterministic
        # the deterministic mode's moe_decode tiles (block_n, block_k, num_warps), set with its
        # weights in process_weights_after_loading (CUDA); None: the per-token torch path
        self._invariant_tiles: tuple | None = None
        self.gate = TopKRouter(config)  # the router stays fp32 (published FP8 checkpoints: bf16)
        if deterministic:  # its logits go through the invariant matmul: no GEMV / kernel of its own
            self.gate.gemv_max_m, self.gate._router_logits = 0, None
            # the tree's chunks of the whole intermediate dim
            leaf_width(config.moe_intermediate_size, TREE_LEAVES, "moe_intermediate_size",
                       fp8=quant is not None)  # fmt: skip
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
                deterministic=deterministic,
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
        if self.deterministic:
            self._set_up_invariant()
            return
        if not fused_ops_enabled(weight.device) or weight.dtype == torch.float32:
            return
        if self.experts.expert_parallel:  # their ids must be local: the sorted path serves EP
            logger.info("expert parallel: MoE decode / grouped kernels off, the sorted path runs")
            return
        fp8 = self.experts.quant is not None
        expert_bytes = sum(
            p[0].numel() * p.element_size() for p in (weight, self.experts.down_proj)
        )
        from mlaserve.ops.moe_decode import FP8_RUN, moe_decode
        from mlaserve.ops.moe_grouped import MAX_PAIRS, moe_grouped

        bytes_bound = not fp8 and expert_bytes >= BYTES_BOUND_EXPERT_BYTES
        decode_max = DECODE_MAX_TOKENS_BYTES_BOUND if bytes_bound else DECODE_MAX_TOKENS
        wide = fp8 and self.experts.hidden_size > FP8_RUN
        if wide:
            narrow = self.experts.local_intermediate <= WIDE_NARROW_INTER
            decode_max = WIDE_FP8_DECODE_MAX_TOKENS * (2 if narrow else 1)
        limit = switches.moe_decode_max_tokens(decode_max)
        default = GROUPED_MAX_TOKENS_FP8 if fp8 else GROUPED_MAX_TOKENS
        grouped = switches.moe_grouped_max_tokens(default)
        if limit <= 0 and grouped <= 0:
            return
        self._moe_decode, self._moe_grouped = moe_decode, moe_grouped
        try:
            self.decode_weights = self._decode_weights()
        except ValueError as exc:  # a layout the kernels do not take: the grouped path serves
            logger.warning("MoE decode kernels off for this layer: %s", exc)
            return
        slots = self.gate.config.num_experts_per_tok + self.decode_weights.num_shared
        if grouped > MAX_PAIRS // slots:
            raise switches.SwitchError(
                f"MLASERVE_MOE_GROUPED_MAX_TOKENS={grouped}: the grouped MoE kernels take at most "
                f"{MAX_PAIRS // slots} tokens at this layer's {slots} slots a token (MAX_PAIRS = "
                f"{MAX_PAIRS} (token, slot) pairs); past that the sorted path serves"
            )
        self.decode_max_tokens = max(limit, 0)
        self.grouped_max_tokens = max(grouped, 0)
        fused = switches.fused_routing()
        self.select_in_kernel = SELECT_IN_KERNEL_MAX_TOKENS if fused and not wide else 0

    def _decode_weights(self) -> MoeDecodeWeights:
        """This layer's routed (and shared) expert weights as `moe_decode` takes them; a layout
        it refuses is a ValueError."""
        from mlaserve.ops.moe_weights import MoeDecodeWeights

        experts, shared = self.experts, self.shared_experts
        return MoeDecodeWeights(
            experts.gate_up_proj.data,
            experts.down_proj.data,
            shared.gate_up_proj.weight.data if shared is not None else None,
            shared.down_proj.weight.data if shared is not None else None,
            w13_scale=_data(experts.gate_up_proj_scale_inv),
            w2_scale=_data(experts.down_proj_scale_inv),
            shared_w13_scale=_data(shared.gate_up_proj.weight_scale_inv) if shared else None,
            shared_w2_scale=_data(shared.down_proj.weight_scale_inv) if shared else None,
        )

    def _set_up_invariant(self) -> None:
        """The deterministic mode's moe_decode weights and fixed tiles, where fused ops run."""
        if not fused_ops_enabled(self.experts.gate_up_proj.device):
            return
        from mlaserve.ops.invariant_matmul import invariant_matmul
        from mlaserve.ops.moe_decode import decode_tiles, moe_decode

        self._moe_decode, self._invariant_matmul = moe_decode, invariant_matmul
        # a layout moe_decode refuses is a ValueError: this mode has no other CUDA path
        self.decode_weights = self._decode_weights()
        # the multi-token tiles, the down step within one leaf of this rank's subtree
        tiles = decode_tiles(self.decode_weights, num_tokens=2, leaves=self.tp.tree_leaves)
        self._invariant_tiles = (tiles.block_n, tiles.block_k, tiles.num_warps)

    def _forward_invariant(self, x: torch.Tensor, combine: bool) -> torch.Tensor | MoePartials:
        """The deterministic mode's MoE (module docstring): x [T, hidden] -> [T, hidden], always
        combined (its slots are summed per leaf, inside the tree), whatever `combine` says."""
        gate, tp = self.gate, self.tp
        out_dtype = x.dtype if tp.size == 1 else torch.float32  # a rank's subtree: fp32
        if self._invariant_tiles is None:  # torch, one token at a time
            y = torch.zeros_like(x, dtype=out_dtype)
            for t in range(x.shape[0]):
                row = x[t : t + 1]
                weights, ids = gate.select(F.linear(row.float(), gate.weight), **gate._selection())
                y[t] = self._row_tree(row, weights, ids)[0]
        else:
            logits = self._invariant_matmul(x, gate.weight, out_dtype=torch.float32)
            weights, ids = gate.select(logits, **gate._selection())
            block_n, block_k, num_warps = self._invariant_tiles
            y = self._moe_decode(
                x.contiguous(), weights, ids, self.decode_weights, block_n=block_n,
                block_k=block_k, num_warps=num_warps, leaves=tp.tree_leaves, out_dtype=out_dtype,
            )  # fmt: skip
        return y if tp.size == 1 else tree_all_reduce(y, tp).to(x.dtype)

    def _row_tree(
        self, row: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """The torch form of the deterministic MoE for one token row [1, H] -> [1, H] fp32, this
        rank's subtree: per leaf (a chunk of each expert's intermediate; of the shared MLP's,
        one run of S chunks as `moe_decode` takes it), the routed experts' weighted partials in
        slot order, then the shared MLP's, and `tree_sum` over the leaves."""
        from mlaserve.ops.invariant_rowwise import dequantized, rowwise_matmul, tree_sum

        experts, shared, leaves = self.experts, self.shared_experts, self.tp.tree_leaves
        s13, s2 = experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
        slots = [
            (w, dequantized(experts.gate_up_proj[e], None if s13 is None else s13[e]),
             dequantized(experts.down_proj[e], None if s2 is None else s2[e]))
            for w, e in zip(weights[0].tolist(), ids[0].tolist(), strict=True)
        ]  # fmt: skip
        if shared is not None:
            gu, down = shared.gate_up_proj, shared.down_proj
            slots.append((1.0, dequantized(gu.weight, gu.weight_scale_inv),
                          dequantized(down.weight, down.weight_scale_inv)))  # fmt: skip
        acc = None
        for weight, w13, w2 in slots:
            h = silu_and_mul(rowwise_matmul(row, w13))
            chunk = h.shape[-1] // leaves
            parts = torch.stack([
                rowwise_matmul(h[:, c * chunk : (c + 1) * chunk],
                               w2[:, c * chunk : (c + 1) * chunk], out_dtype=torch.float32)
                for c in range(leaves)
            ]) * weight  # fmt: skip
            acc = parts if acc is None else acc + parts
        return tree_sum(acc)

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The compiles of every variant of the grouped kernels the token counts they serve
        take, and of the sorted path's (SiLU-and-mul of the routed and shared experts) past them
        (the engine's warm-up request alone no longer reaches it), as tasks
        (`model/kernel_warm_up.py`) for before serving."""
        if self.decode_weights is None:
            return []
        if self.deterministic:  # one path: its kernels at one token
            return [functools.partial(self._run_zeros, 1, act_dtype)]
        tasks: list[Callable[[], None]] = []
        if self.grouped_max_tokens > self.decode_max_tokens:
            from mlaserve.ops.moe_grouped import moe_grouped_warm_up_tasks

            tasks += moe_grouped_warm_up_tasks(
                self.decode_weights,
                self.gate.config.num_experts_per_tok,
                self.decode_max_tokens + 1,
                self.grouped_max_tokens,
                act_dtype,
            )
        past = max(self.decode_max_tokens, self.grouped_max_tokens) + 1
        return [functools.partial(self._run_zeros, past, act_dtype), *tasks]

    def _run_zeros(self, num_tokens: int, act_dtype: torch.dtype) -> None:
        device = self.experts.gate_up_proj.device
        self(torch.zeros(num_tokens, self.experts.hidden_size, dtype=act_dtype, device=device))

    def forward(
        self, x: torch.Tensor, *, combine: bool = True
    ) -> torch.Tensor | MoePartials | SortedExpertRows | RankPartials:
        """[T, hidden] -> [T, hidden]. `combine=False` lets the fused kernels return their
        output uncombined (`MoePartials`, `SortedExpertRows`) for the next residual-add +
        RMSNorm to combine in its own launch (one kernel fewer per layer), and other paths
        return the tensor all the same; under tensor parallelism on CUDA (fp32 partial sums)
        this rank's partials (`RankPartials`), which that norm all-reduces too."""
        if self.deterministic:
            return self._forward_invariant(x, combine)
        num_tokens, weights = x.shape[0], self.decode_weights
        reduce, wide = self.tp.size > 1, self.tp.wide_partials
        # under TP the kernels combine (wide: into fp32 partials, which `_reduce` sums)
        kw = {"combine": (combine or reduce) and not wide}
        if weights is not None and num_tokens <= self.decode_max_tokens:
            if num_tokens <= self.select_in_kernel:  # the selection inside the first kernel
                plan = self.gate.plan(x)
                y = self._moe_decode(x, plan.weights, plan.ids, weights, routing=plan, **kw)
            else:
                y = self._moe_decode(x, *self.gate(x), weights, **kw)
            return self._reduce(y, x.dtype, combine)
        grouped = num_tokens <= self.grouped_max_tokens and x.dtype != torch.float32
        if weights is not None and grouped:
            y = self._moe_grouped(x, *self.gate(x), weights, **kw)
            return self._reduce(y, x.dtype, combine)
        # The side stream only past the FP8 decode GEMMs' sizes, so no split-K kernel runs on
        # it beside one on this stream (`ops/split_counters.py`'s invariant).
        overlap = self.shared_experts is not None and num_tokens > W8A16_MAX_M
        side = _side_stream(x.device) if overlap else None
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
        y = self.experts(
            x, topk_weights, topk_ids, shared, join=join, combine=combine or reduce,
            out_dtype=torch.float32 if wide else None,
        )  # fmt: skip
        if isinstance(y, SortedExpertRows):
            return y
        return self._reduce(y, x.dtype, combine)

    def _reduce(
        self, y: torch.Tensor | MoePartials, dtype: torch.dtype, combine: bool
    ) -> torch.Tensor | MoePartials | RankPartials:
        """Under TP, this rank's routed + shared partial sums (fp32: `MoePartials` or [T, H])
        summed over the ranks in fp32 by one all-reduce, then rounded once to `dtype`, as one
        rank's combine rounds its whole sum: TP1's bits up to fp32 summation order. On CUDA
        with `combine=False` the all-reduce and the rounding are left to the next norm
        (`RankPartials`, its slots uncombined). Without `tp.wide_partials` the all-reduce of
        `y` as it is (rounded by each rank), and on one rank `y` as it is."""
        if not self.tp.wide_partials:
            return y if isinstance(y, MoePartials) else all_reduce(y, self.tp)
        parts = y.parts if isinstance(y, MoePartials) else y.unsqueeze(1)
        mine = RankPartials(parts, dtype, self.tp)
        if not combine and parts.is_cuda:
            return mine
        return mine.all_reduced().to(dtype)
