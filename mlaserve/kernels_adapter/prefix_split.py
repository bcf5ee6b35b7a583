"""Split-KV for the MHA-form prefill of a few new tokens over a long cached prefix (a prefix-cache
hit), on a varlen FlashAttention-2 that has no split-KV of its own.

FA2's forward grid is one CTA per (128 query rows, head, sequence): a 16-new-token hit over 8k
cached tokens on a 16-head model is 16 CTAs on a 132-SM GPU, each reading 8k keys in turn. This
splits the cached prefix into P chunks that run as P sequences of one launch, each with the
same queries, so that launch has P times the CTAs; the new tokens' own keys (the causal part)
take a second launch; the P + 1 partial results merge by their log-sum-exp:

    out = sum_p exp(lse_p - m) out_p / sum_p exp(lse_p - m),   m = max_p lse_p

which is softmax over all keys, exactly up to rounding.

Boundary (`varlen_attn` as `flash_varlen.py` calls it, `return_aux=AuxRequest(lse=True)`):

    q      [n, H, D]        the sequence's n new tokens (one sequence: bs 1)
    k, v   [L, H, D|D_v]    its whole context, prefix rows 0 .. L - n - 1, then the n new ones
    out_p  [rows, H, D_v]   in q's dtype; lse_p [H, rows] fp32 (FA2's varlen layout: head-major)
    result [n, H, D_v]      in q's dtype; merged in fp32

Only batches of one sequence split (`plan_split`); several sequences already give FA2 more CTAs,
and their prefixes and new rows interleave in k, which one launch's offsets cannot skip. The
plan is host ints from the batch's host lengths and the launches' offsets are computed on the
device from them: nothing waits for the GPU. A prefix hit runs eagerly between piecewise
graphs (`mha_extend.py`), so no captured graph holds a plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SplitPlan", "merge_partials", "plan_split", "split_prefix_attention"]

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


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """outs [P, n, H, D_v], lses [P, n, H] fp32 (natural log) -> [n, H, D_v] in `dtype`."""
    lses = lses.float()
    top = lses.amax(dim=0, keepdim=True)
    weights = torch.exp(lses - top)  # [P, n, H], the largest 1
    total = (weights[..., None] * outs.float()).sum(dim=0)
    return (total / weights.sum(dim=0)[..., None]).to(dtype)


def split_prefix_attention(
    attn: Callable[..., Any],
    lse_request: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: SplitPlan,
    causal: dict[str, Any],
    extra: dict[str, Any],
) -> torch.Tensor:
    """`attn` is `varlen_attn`; `causal` its causal keyword, `extra` the rest (scale); q, k, v as
    above, v possibly zero-padded to D. -> [n, H, v's width] in q's dtype."""
    n, heads = plan.q_len, q.shape[1]
    p, chunk, prefix = plan.num_chunks, plan.chunk, plan.prefix_len
    steps = torch.arange(p + 1, device=q.device, dtype=torch.int32)
    cu_q = steps * n
    cu_k = torch.clamp(steps * chunk, max=prefix)
    queries = q.unsqueeze(0).expand(p, -1, -1, -1).reshape(p * n, heads, q.shape[-1])
    out_pre, lse_pre = attn(
        queries, k[:prefix], v[:prefix], cu_q, cu_k, n, chunk, return_aux=lse_request, **extra
    )
    cu_new = cu_q[:2]  # [0, n]: the new tokens attend their own keys, causal (square)
    out_new, lse_new = attn(
        q, k[prefix:], v[prefix:], cu_new, cu_new, n, n, return_aux=lse_request, **causal, **extra
    )
    _check_lse(lse_pre, heads, p * n)
    _check_lse(lse_new, heads, n)
    outs = torch.cat([out_pre.view(p, n, heads, -1), out_new.view(1, n, heads, -1)])
    lses = torch.cat([lse_pre.view(heads, p, n), lse_new.view(heads, 1, n)], dim=1)
    return merge_partials(outs, lses.permute(1, 2, 0), q.dtype)


def _check_lse(lse: torch.Tensor, heads: int, rows: int) -> None:
    if tuple(lse.shape) != (heads, rows):
        raise RuntimeError(
            f"varlen_attn's log-sum-exp is {tuple(lse.shape)}, expected [heads, rows] = "
            f"{[heads, rows]}: this torch's FA2 layout differs, split-KV cannot merge it"
        )
