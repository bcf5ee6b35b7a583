"""One MoE layer's routed experts as parameters: this rank's experts' weights stacked, and their
loading.

    gate_up_proj  [E_local, 2I_local, H]  rows [0, I_local) gate, [I_local, 2I_local) up
    down_proj     [E_local, H, I_local]

How the routed experts are placed over the tensor-parallel ranks (`TensorParallel`):
    tensor parallel (default)  every rank holds all E experts, each split along its intermediate
                               dim: E_local = E, I_local = I / tp (rank r: gate/up rows and down
                               columns [r*I/tp, (r+1)*I/tp))
    expert parallel            `tp.expert_parallel` (`--enable-expert-parallel`): rank r holds
                               whole experts [r*E/tp, (r+1)*E/tp): E_local = E / tp, I_local = I
Either way a rank's output is a partial sum the MoE layer all-reduces. The weight loaders take
`CheckpointTensor`s and read only this rank's part: its I slice, or its experts (another rank's
expert is not read at all).

Built with `quant`, both are FP8 with block scales (`gate_up_proj_scale_inv` [E_local,
2I_local/128 or 2I_local, H/128], `down_proj_scale_inv` [E_local, H/128, I_local/128]; layout in
`fp8_linear.py`). How the experts run is `moe_experts.FusedExperts`, which builds on this.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.config import QuantizationConfig
from mlaserve.model.checkpoint_tensor import CheckpointTensor
from mlaserve.model.layers.fp8_linear import (
    check_block_aligned,
    copy_block_rows,
    make_fp8_weight,
    needs_per_row_scales,
)
from mlaserve.model.layers.linear import NO_TP, TensorParallel, check_shape

__all__ = ["ExpertWeights"]


class ExpertWeights(nn.Module):
    """This rank's routed experts of a layer, weights stacked (see the module docstring for the
    tensor- and expert-parallel placements). `num_experts` is the experts held here (E_local),
    `first_expert` the global id of the first; `num_global_experts` the layer's E."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.tp = hidden_size, tp
        self.intermediate_size, self.num_global_experts = intermediate_size, num_experts
        self.expert_parallel = tp.expert_parallel and tp.size > 1
        # The split of each expert's intermediate dim: none under expert parallelism.
        self.split = NO_TP if self.expert_parallel else tp
        if self.expert_parallel:
            self.num_experts = tp.split(
                num_experts, "n_routed_experts (expert parallelism holds whole experts a rank)"
            )
            self.first_expert = tp.rank * self.num_experts
        else:
            self.num_experts, self.first_expert = num_experts, 0
        local = self.split.split(intermediate_size, "moe_intermediate_size")
        self.local_intermediate = local
        e_local = self.num_experts
        self.quant = quant
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        if quant is None:
            self.gate_up_proj = nn.Parameter(
                torch.empty(e_local, 2 * local, hidden_size, dtype=params_dtype),
                requires_grad=False,
            )  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
            self.down_proj = nn.Parameter(
                torch.empty(e_local, hidden_size, local, dtype=params_dtype),
                requires_grad=False,
            )  # [E, H, I]
            self.gate_up_proj.weight_loader = self.weight_loader
            self.down_proj.weight_loader = self.weight_loader
        else:
            what = f"routed experts ({num_experts} x [{intermediate_size}, {hidden_size}])"
            check_block_aligned(
                intermediate_size, self.split, quant.block_n, f"{what} moe_intermediate_size"
            )
            self.gate_up_per_row = needs_per_row_scales([local, local], quant)
            self.gate_up_proj, self.gate_up_proj_scale_inv = make_fp8_weight(
                (e_local,), 2 * local, hidden_size, quant, per_row=self.gate_up_per_row
            )
            self.down_proj, self.down_proj_scale_inv = make_fp8_weight(
                (e_local,), hidden_size, local, quant, per_row=False
            )
            self.gate_up_proj.weight_loader = self.fp8_weight_loader
            self.down_proj.weight_loader = self.fp8_weight_loader

    def local_expert(self, expert_id: int) -> int | None:
        """Global expert id -> its index in this rank's stack, or None: another rank's."""
        e = expert_id - self.first_expert
        return e if 0 <= e < self.num_experts else None

    def _shard(self, loaded: CheckpointTensor, dim: int) -> CheckpointTensor:
        """This rank's slice of the intermediate dim `dim` (the whole of it under EP)."""
        local = self.local_intermediate
        return loaded.narrow(dim, self.split.rank * local, local)

    def _local_stack(self, loaded: CheckpointTensor) -> CheckpointTensor:
        """A fused [E, ...] tensor's experts that this rank holds (nothing read)."""
        return loaded.narrow(0, self.first_expert, self.num_experts)

    def fp8_weight_loader(
        self,
        param: nn.Parameter,
        loaded: CheckpointTensor,
        expert_id: int | None = None,
        shard_id: int | None = None,
    ) -> None:
        """One expert's FP8 `gate_proj`/`up_proj` [I, H] (shard_id 0/1) or `down_proj` [H, I]
        with its block scale (a float tensor is quantised here). The fused whole-layer form
        (`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]) is accepted in float
        only: FP8 checkpoints publish per-expert tensors, and no fused scale layout exists.
        Reads this rank's slice along I (TP) or nothing for another rank's expert (EP)."""
        assert self.quant is not None  # internal: only set as loader of FP8 parameters
        h, i = self.hidden_size, self.intermediate_size
        if expert_id is None:
            if loaded.is_fp8:
                raise ValueError("FP8 experts must come one tensor per expert (experts.{e}.*)")
            down = param is self.down_proj
            check_shape(
                loaded,
                (self.num_global_experts, h, i) if down else (self.num_global_experts, 2 * i, h),
            )
            for e in range(self.first_expert, self.first_expert + self.num_experts):
                one = loaded.select(e)
                if down:
                    self.fp8_weight_loader(param, one, e)
                else:
                    for s in (0, 1):
                        self.fp8_weight_loader(param, one.narrow(0, s * i, i), e, s)
            return
        local_e = self.local_expert(expert_id)
        if local_e is None:
            return  # another rank's expert: not read
        if param is self.down_proj:
            check_shape(loaded, (h, i))
            loaded = self._shard(loaded, 1)
            dst_scale, row, per_row = self.down_proj_scale_inv, 0, False
        else:
            assert shard_id in (0, 1)  # internal: the loader passes 0 (gate) or 1 (up)
            check_shape(loaded, (i, h))
            loaded = self._shard(loaded, 0)
            dst_scale, row, per_row = (
                self.gate_up_proj_scale_inv,
                shard_id * self.local_intermediate,
                self.gate_up_per_row,
            )
        assert dst_scale is not None  # internal: both are set when quant is
        copy_block_rows(
            param.data[local_e],
            dst_scale.data[local_e],
            loaded.load(),
            loaded.load_scale(),
            row,
            self.quant,
            per_row=per_row,
        )

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: CheckpointTensor,
        expert_id: int | None = None,
        shard_id: int | None = None,
    ) -> None:
        """Either a whole stacked tensor (transformers' fused `experts.gate_up_proj` [E, 2I, H] /
        `experts.down_proj` [E, H, I]) or one expert's `gate_proj`/`up_proj` [I, H]
        (shard_id 0/1) or `down_proj` [H, I]. Reads this rank's part only."""
        num_e, h, i = self.num_global_experts, self.hidden_size, self.intermediate_size
        local = self.local_intermediate
        if param is self.down_proj:
            if expert_id is None:
                check_shape(loaded, (num_e, h, i))
                param.data.copy_(self._shard(self._local_stack(loaded), 2).load())
            else:
                check_shape(loaded, (h, i))
                local_e = self.local_expert(expert_id)
                if local_e is not None:
                    param.data[local_e].copy_(self._shard(loaded, 1).load())
            return
        if expert_id is None:
            check_shape(loaded, (num_e, 2 * i, h))
            stack = self._local_stack(loaded)
            for s in (0, 1):  # gate, up
                part = self._shard(stack.narrow(1, s * i, i), 1)
                param.data[:, s * local : (s + 1) * local].copy_(part.load())
        else:
            assert shard_id in (0, 1)  # internal: the loader passes 0 (gate) or 1 (up)
            check_shape(loaded, (i, h))
            local_e = self.local_expert(expert_id)
            if local_e is not None:
                param.data[local_e, shard_id * local : (shard_id + 1) * local].copy_(
                    self._shard(loaded, 0).load()
                )
