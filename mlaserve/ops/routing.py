"""Fused MoE routing: scores, group-limited top-k, renormalisation and scaling in one kernel.

    logits  [T, E] fp32 (the gate's output), last dim contiguous
    bias    [E] fp32 `e_score_correction_bias` (noaux_tc) or None
    returns (weights [T, K] fp32, ids [T, K] int64)

Same math as `select_experts` in `mlaserve/model/layers/moe_router.py` (the reference):
    scores   softmax(logits) or sigmoid(logits), fp32
    greedy               top-k of scores
    group_limited_greedy keep the `topk_group` groups with the highest max score (others 0),
                         top-k of what is left; weights are those scores
    noaux_tc             choice = scores + bias; groups ranked by the sum of their two best
                         choices, others -inf; top-k of choice; weights are the unbiased scores
    then weights / (sum + 1e-20) if `norm_topk_prob`, then * `routed_scaling_factor`.

The K results come in descending order of the choice value (the reference's `sorted=False`
leaves its order unspecified; experts are summed, so order does not matter). Ties go to the
lowest expert id. One program per token; the E scores live in registers as a
[n_group, E / n_group] tile, so E up to a few thousand.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.ops.pdl import pdl_args, wait_for_previous_kernel

__all__ = ["TOPK_METHODS", "Routing", "fused_select_experts", "plan_routing", "route_token"]

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@triton.jit
def route_token(
    t, logits_ptr, bias_ptr, logits_stride, split_stride, scaling,
    SPLITS: tl.constexpr, G: tl.constexpr, PG: tl.constexpr, TOPK_GROUP: tl.constexpr,
    K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr,
    METHOD: tl.constexpr,  # 0 greedy, 1 group_limited_greedy, 2 noaux_tc
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    """Token t's selection (after the PDL wait) -> (weights [BLOCK_K] fp32, ids [BLOCK_K]
    int64; entries K.. are padding). Also run inside `moe_decode`'s first kernel."""
    g_idx = tl.arange(0, BLOCK_G)[:, None]
    j_idx = tl.arange(0, BLOCK_PG)[None, :]
    valid = (g_idx < G) & (j_idx < PG)
    expert = g_idx * PG + j_idx  # [BLOCK_G, BLOCK_PG] expert ids
    x = tl.load(logits_ptr + t * logits_stride + expert, mask=valid, other=float("-inf"))
    for s in tl.static_range(1, SPLITS):  # split-K partials of the logits, summed in order
        x += tl.load(logits_ptr + s * split_stride + t * logits_stride + expert, mask=valid)

    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        m = tl.max(tl.max(x, axis=1), axis=0)
        e = tl.exp(x - m)
        scores = e / tl.sum(tl.sum(e, axis=1), axis=0)
    scores = tl.where(valid, scores, float("-inf"))

    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0)

    if METHOD != 0:
        # Group scores [BLOCK_G, 1]: max (group_limited_greedy) or sum of the best two (noaux_tc).
        top1 = tl.max(choice, axis=1, keep_dims=True)
        if METHOD == 2 and PG > 1:
            first = tl.min(tl.where(choice == top1, j_idx, BLOCK_PG), axis=1, keep_dims=True)
            top2 = tl.max(tl.where(j_idx == first, float("-inf"), choice), axis=1, keep_dims=True)
            gscore = top1 + top2
        else:
            gscore = top1
        gscore = tl.where(g_idx < G, gscore, float("-inf"))
        keep = g_idx < 0  # all False, [BLOCK_G, 1]
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=0, keep_dims=True)
            g = tl.min(tl.where(gscore == best, g_idx, BLOCK_G), axis=0, keep_dims=True)
            keep = keep | (g_idx == g)
            gscore = tl.where(g_idx == g, float("-inf"), gscore)
        if METHOD == 1:
            # The reference fills dropped experts with 0 (not -inf) before its top-k.
            choice = tl.where(keep & valid, choice, 0.0)
            choice = tl.where(valid, choice, float("-inf"))
        else:
            choice = tl.where(keep, choice, float("-inf"))

    k_idx = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(K):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        eid = tl.min(tl.min(tl.where(choice == best, expert, G * PG), axis=1), axis=0)
        hit = expert == eid
        if METHOD == 2:
            w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        else:
            w = best
        weights = tl.where(k_idx == k, w, weights)
        ids = tl.where(k_idx == k, eid.to(tl.int64), ids)
        choice = tl.where(hit, float("-inf"), choice)

    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    return weights * scaling, ids


@triton.jit(do_not_specialize=["split_stride"])  # T * E: one compiled kernel for every T
def _routing_kernel(
    logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, logits_stride, split_stride, scaling,
    SPLITS: tl.constexpr, G: tl.constexpr, PG: tl.constexpr, TOPK_GROUP: tl.constexpr,
    K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_K: tl.constexpr,
    METHOD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    wait_for_previous_kernel(PDL)
    weights, ids = route_token(
        t, logits_ptr, bias_ptr, logits_stride, split_stride, scaling, SPLITS, G, PG,
        TOPK_GROUP, K, BLOCK_G, BLOCK_PG, BLOCK_K, METHOD, SIGMOID, HAS_BIAS, NORM,
    )  # fmt: skip
    k_idx = tl.arange(0, BLOCK_K)
    k_mask = k_idx < K
    tl.store(w_out_ptr + t * K + k_idx, weights, mask=k_mask)
    tl.store(id_out_ptr + t * K + k_idx, ids, mask=k_mask)


class Routing(NamedTuple):
    """A checked selection, not yet run: `route_token`'s arguments by parameter name, and the
    [T, K] outputs its runner fills: weights fp32, ids int64."""

    args: dict[str, object]
    weights: torch.Tensor
    ids: torch.Tensor


def fused_select_experts(
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
    """router_logits [T, E] fp32, or split-K partials [S, T, E] fp32 whose sum (in order of S)
    is the logits -> (weights [T, K] fp32, expert ids [T, K] int64)."""
    routing = plan_routing(
        router_logits, top_k=top_k, scoring_func=scoring_func, topk_method=topk_method,
        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=routed_scaling_factor, correction_bias=correction_bias,
    )  # fmt: skip
    num_tokens, num_experts = routing.weights.shape[0], router_logits.shape[-1]
    if num_tokens:
        _routing_kernel[(num_tokens,)](
            **routing.args,
            w_out_ptr=routing.weights,
            id_out_ptr=routing.ids,
            num_warps=_num_warps(num_experts),
            **pdl_args(router_logits.device),
        )
    return routing.weights, routing.ids


def _num_warps(num_experts: int) -> int:
    """4 warps (8 past 512 experts). Not fewer: one warp was faster at prefill sizes, but a
    reduction's order follows the warps, and the
    selection inside `moe_decode`'s first kernel must give this kernel's bits (a speculative
    VERIFY step and a plain decode step select through the two)."""
    return 4 if num_experts <= 512 else 8


def plan_routing(
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
) -> Routing:
    """`fused_select_experts`' checks and outputs, without the launch: `moe_decode` runs the
    selection inside its first kernel. Raises ValueError on a configuration it cannot run."""
    if router_logits.dim() == 2:
        router_logits = router_logits.unsqueeze(0)
    splits, num_tokens, num_experts = router_logits.shape
    if topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method: one of {TOPK_METHODS}, got {topk_method!r}")
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: 'softmax' or 'sigmoid', got {scoring_func!r}")
    if router_logits.dtype != torch.float32 or router_logits.stride(-1) != 1:
        raise ValueError("router_logits: need fp32 with a contiguous last dim")
    groups = 1 if topk_method == "greedy" else n_group
    if groups > 1 and (num_experts % groups or not 1 <= topk_group <= groups):
        raise ValueError(f"n_group {n_group} / topk_group {topk_group} do not fit {num_experts}")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    per_group = num_experts // groups
    has_bias = topk_method == "noaux_tc" and correction_bias is not None
    args = {
        "logits_ptr": router_logits,
        "bias_ptr": correction_bias if has_bias else router_logits,
        "logits_stride": router_logits.stride(1),
        "split_stride": router_logits.stride(0),
        "scaling": float(routed_scaling_factor),
        "SPLITS": splits,
        "G": groups,
        "PG": per_group,
        "TOPK_GROUP": topk_group if groups > 1 else 1,
        "K": top_k,
        "BLOCK_G": triton.next_power_of_2(groups),
        "BLOCK_PG": triton.next_power_of_2(per_group),
        "BLOCK_K": triton.next_power_of_2(top_k),
        "METHOD": TOPK_METHODS.index(topk_method),
        "SIGMOID": scoring_func == "sigmoid",
        "HAS_BIAS": has_bias,
        "NORM": norm_topk_prob,
    }
    return Routing(args, weights, ids)
