"""Split-KV for the MHA-form prefill of a few new tokens over a long cached prefix (a prefix-cache
hit), on a varlen FlashAttention-2 that has no split-KV of its own.

FA2's forward grid is one CTA per (128 query rows, head, sequence): a 16-new-token hit over 8k
cached tokens on a 16-head model is 16 CTAs on a 132-SM GPU, each reading 8k keys in turn. This
splits the cached prefix into P chunks that run as P sequences of one launch, each with the
same queries, so that launch has P times the CTAs; the new tokens' own keys (the causal part)
take a second launch; the P + 1 partial results merge by their log-sum-exp:

    out = sum_p exp(lse_p - m) out_p / sum_p exp(lse_p - m),   m = max_p lse_p

which is softmax over all keys, exactly up to rounding.

Boundary (`attn`: aten's FA2 as `flash_varlen.py` calls it, returning the log-sum-exp):

    q      [n, H, D]        the sequence's n new tokens (one sequence: bs 1)
    k, v   [L, H, D|Dp]     its whole context, prefix rows 0 .. L - n - 1, then the n new ones
    out_p  [rows, H, Dp]    in q's dtype; lse_p [H, rows] fp32 (FA2's varlen layout: head-major)
    result [n, H, d_v]      in q's dtype, d_v <= Dp (v may come zero-padded); merged in fp32 by
                            `merge` (`ops/attention_merge.py` on the GPU, `merge_partials` here)

Only batches of one sequence split (`plan_split`); several sequences already give FA2 more CTAs,
and their prefixes and new rows interleave in k, which one launch's offsets cannot skip. The
plan is host ints from the batch's host lengths and its offsets (`split_offsets`) are computed
on the device from them, once per forward: nothing waits for the GPU. A prefix hit runs eagerly
between piecewise graphs (`mha_extend.py`), so no captured graph holds a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "SplitOffsets",
    "SplitPlan",
    "merge_partials",
    "plan_split",
    "split_offsets",
    "split_prefix_attention",
]

BLOCK_M = 128  # FA2's query rows per CTA at head dim 192 (Flash_fwd_kernel_traits<192, 128, ...>)
MIN_CHUNK = 512  # keys per chunk: below this a chunk's fixed cost outweighs its parallelism
CTAS_PER_SM = 2  # the launch's target: this many CTAs per SM


@dataclass(frozen=True)
class SplitPlan:
    """One sequence's split: `num_chunks` chunks of `chunk` prefix keys (the last may be
    shorter, never empty) over a prefix of `prefix_len` keys, then `q_len` new tokens."""

    q_len: int
    prefix_len: int
    chunk: int
    num_chunks: int


def plan_split(
    q_lens: tuple[int, ...], kv_lens: tuple[int, ...], num_heads: int, num_sms: int
) -> SplitPlan | None:
    """The split for an EXTEND batch's host lengths, or None where one launch is as good: more
    than one sequence, a prefix shorter than two chunks, or enough CTAs already."""
    if len(q_lens) != 1:
        return None
    n, prefix = q_lens[0], kv_lens[0] - q_lens[0]
    ctas = -(-n // BLOCK_M) * num_heads
    if n <= 0 or prefix < 2 * MIN_CHUNK or ctas >= num_sms:
        return None
    wanted = min(-(-CTAS_PER_SM * num_sms // ctas), prefix // MIN_CHUNK)
    chunk = -(-prefix // wanted)
    num_chunks = -(-prefix // chunk)  # no empty chunk: its softmax would have no keys
    return SplitPlan(q_len=n, prefix_len=prefix, chunk=chunk, num_chunks=num_chunks)


@dataclass(frozen=True)
class SplitOffsets:
    """A plan's launch offsets on the device (int32), shared by every layer of one forward."""

    cu_q: torch.Tensor  # [P + 1]: chunk p's queries are rows p*n .. p*n+n-1 of the repeated q
    cu_k: torch.Tensor  # [P + 1]: chunk p's keys are prefix rows cu_k[p] .. cu_k[p+1]-1
    cu_new: torch.Tensor  # [2] = [0, n]: the new tokens against their own keys


def split_offsets(plan: SplitPlan, device: torch.device) -> SplitOffsets:
    steps = torch.arange(plan.num_chunks + 1, device=device, dtype=torch.int32)
    cu_q = steps * plan.q_len
    cu_k = torch.clamp(steps * plan.chunk, max=plan.prefix_len)
    return SplitOffsets(cu_q=cu_q, cu_k=cu_k, cu_new=cu_q[:2])


# (q, k, v, cu_q, cu_k, max_q, max_k, causal) -> (out, lse [H, rows] fp32)
Attention = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (pre, lse_pre, new, lse_new, num_chunks, d_v) -> [n, H, d_v]: `ops.attention_merge`'s contract
Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def merge_partials(
    pre: torch.Tensor,
    lse_pre: torch.Tensor,
    new: torch.Tensor,
    lse_new: torch.Tensor,
    num_chunks: int,
    d_v: int,
) -> torch.Tensor:
    """`ops.attention_merge.merge_attention` in torch (the CPU, and its test's oracle)."""
    n, heads, width = new.shape
    outs = torch.cat([pre.view(num_chunks, n, heads, width), new.view(1, n, heads, width)])
    lses = torch.cat([lse_pre.view(heads, num_chunks, n), lse_new.view(heads, 1, n)], dim=1)
    lses = lses.permute(1, 2, 0).float()  # [P + 1, n, H]
    weights = torch.exp(lses - lses.amax(dim=0, keepdim=True))  # the largest 1
    total = (weights[..., None] * outs[..., :d_v].float()).sum(dim=0)
    return (total / weights.sum(dim=0)[..., None]).to(new.dtype)


def split_prefix_attention(
    attn: Attention,
    merge: Merge,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SplitPlan,
    offsets: SplitOffsets,
    d_v: int,
) -> torch.Tensor:
    """q, k, v as above -> [n, H, d_v] in q's dtype."""
    n, heads = plan.q_len, q.shape[1]
    p, prefix = plan.num_chunks, plan.prefix_len
    queries = q.unsqueeze(0).expand(p, -1, -1, -1).reshape(p * n, heads, q.shape[-1])
    out_pre, lse_pre = attn(
        queries, k[:prefix], v[:prefix], offsets.cu_q, offsets.cu_k, n, plan.chunk, False
    )
    new_k, new_v = k[prefix:], v[prefix:]
    out_new, lse_new = attn(q, new_k, new_v, offsets.cu_new, offsets.cu_new, n, n, True)
    _check_lse(lse_pre, heads, p * n)
    _check_lse(lse_new, heads, n)
    return merge(out_pre, lse_pre, out_new, lse_new, p, d_v)


def _check_lse(lse: torch.Tensor, heads: int, rows: int) -> None:
    if tuple(lse.shape) != (heads, rows):
        raise RuntimeError(
            f"FA2's log-sum-exp is {tuple(lse.shape)}, expected [heads, rows] = "
            f"{[heads, rows]}: this torch's layout differs, split-KV cannot merge it"
        )
