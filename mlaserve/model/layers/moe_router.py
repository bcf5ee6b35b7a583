"""The MoE router: which K experts each token takes, and their weights (fp32).

Routing (`select_experts`, pure function, fp32):
    V2  softmax scores; `greedy` top-k, or `group_limited_greedy` (keep the `topk_group` groups
        with the highest max score, then top-k inside them);
    V3  sigmoid scores; `noaux_tc`: choose with scores + e_score_correction_bias, groups ranked
        by the sum of their two best biased scores, weights are the *unbiased* scores.
    Then optional renormalisation (`norm_topk_prob`) and `routed_scaling_factor`.

`TopKRouter` is the gate module: the logits GEMM, then that selection (one Triton kernel on CUDA,
`ops/routing.py`; `select_experts` is its reference and the CPU path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import ModelConfig
from mlaserve.model.layers.linear import narrow_gemv_max_m
from mlaserve.ops import fused_ops_enabled

if TYPE_CHECKING:
    from mlaserve.ops.routing import Routing

__all__ = ["TopKRouter", "select_experts"]


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


def _group_mask(group_scores: torch.Tensor, topk_group: int, per_group: int) -> torch.Tensor:
    """[T, G] group scores -> [T, G * per_group] bool, True for experts in the best groups."""
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return mask.repeat_interleave(per_group, dim=1)


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

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The logits' and the selection's compiles for every token count they take, a task
        each (`model/kernel_warm_up.py`), for before serving."""
        tasks: list[Callable[[], None]] = []
        if self.gemv_max_m:
            from mlaserve.ops.gemv import gemv_warm_up_tasks

            tasks += gemv_warm_up_tasks(
                self.weight, None, self.gemv_max_m, act_dtype, torch.float32
            )
        if self._router_logits is not None and act_dtype != torch.float32:
            from mlaserve.ops.router_logits import router_logits_variants

            num_experts, hidden = self.weight.shape
            for num_tokens in [1, *router_logits_variants(num_experts, hidden)]:
                tasks.append(functools.partial(self._run_zeros, num_tokens, act_dtype))
        return tasks

    def _run_zeros(self, num_tokens: int, act_dtype: torch.dtype) -> None:
        hidden = self.weight.shape[1]
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
