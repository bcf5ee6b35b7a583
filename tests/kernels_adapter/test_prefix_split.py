"""Split-KV of a prefix-cache hit (`prefix_split.py`) on the CPU: the plan's host arithmetic, and
the split-and-merge against one softmax over all keys, with a plain-torch stand-in for aten's FA2
(same call, same [heads, rows] log-sum-exp). The real FA2 and the Triton merge run in
test_flashmla_extend.py's long-prefix cases on the GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mlaserve.kernels_adapter.prefix_split import (
    MIN_CHUNK,
    SplitPlan,
    merge_partials,
    plan_split,
    split_offsets,
    split_prefix_attention,
)

SCALE = 0.3


def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal) -> Any:
    """Plain-torch varlen attention with FA2's conventions: bottom-right causal."""
    cu_q, cu_k, scale = cu_q.tolist(), cu_k.tolist(), SCALE
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b] : cu_q[b + 1]].float()
        kb, vb = k[cu_k[b] : cu_k[b + 1]].float(), v[cu_k[b] : cu_k[b + 1]].float()
        assert qb.shape[0] <= max_q and kb.shape[0] <= max_k
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        if causal:
            n, length = qb.shape[0], kb.shape[0]
            seen = torch.arange(length)[None] <= torch.arange(n)[:, None] + length - n
            scores = scores.masked_fill(~seen, float("-inf"))
        lses.append(torch.logsumexp(scores, dim=-1))  # [H, n]
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)


def test_plan_splits_one_long_prefix_only() -> None:
    plan = plan_split((16,), (8192 + 16,), num_heads=16, num_sms=132)
    assert plan is not None and plan.q_len == 16 and plan.prefix_len == 8192
    assert plan.num_chunks == 16 and plan.chunk == 512  # 16 heads x 17 wanted, 8192 / 512 at most
    assert plan_split((16, 16), (8208, 8208), 16, 132) is None  # several sequences
    assert plan_split((16,), (16 + 2 * MIN_CHUNK - 1,), 16, 132) is None  # prefix too short
    assert plan_split((64,), (8256,), 128, 132) is not None  # 128 CTAs: one wave, split
    assert plan_split((256,), (8448,), 128, 132) is None  # 256 CTAs: enough already
    assert plan_split((16,), (16,), 16, 132) is None  # a fresh prompt


@pytest.mark.parametrize("prefix", [5000, 4097, 2048])
def test_plan_has_no_empty_chunk(prefix: int) -> None:
    plan = plan_split((3,), (prefix + 3,), 16, 132)
    assert plan is not None and plan.chunk >= MIN_CHUNK
    assert (plan.num_chunks - 1) * plan.chunk < prefix <= plan.num_chunks * plan.chunk


@pytest.mark.parametrize("prefix,chunk,n", [(50, 16, 5), (48, 16, 1), (40, 40, 7)])
def test_split_equals_one_softmax_over_all_keys(prefix: int, chunk: int, n: int) -> None:
    torch.manual_seed(prefix + n)
    heads, dim, d_v = 3, 8, 6
    q = torch.randn(n, heads, dim)
    k, v = torch.randn(prefix + n, heads, dim), torch.randn(prefix + n, heads, dim)
    plan = SplitPlan(q_len=n, prefix_len=prefix, chunk=chunk, num_chunks=-(-prefix // chunk))
    offsets = split_offsets(plan, q.device)
    assert offsets.cu_k.tolist()[-1] == prefix and offsets.cu_new.tolist() == [0, n]
    got = split_prefix_attention(varlen_attn, merge_partials, q, k, v, plan, offsets, d_v)
    cu_q, cu_k = torch.tensor([0, n]), torch.tensor([0, prefix + n])
    want, _ = varlen_attn(q, k, v, cu_q, cu_k, n, prefix + n, True)
    assert got.shape == (n, heads, d_v)
    torch.testing.assert_close(got, want[..., :d_v], rtol=1e-5, atol=1e-5)


def test_merge_of_one_partial_with_no_weight_is_that_partial() -> None:
    pre, new = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    lse_pre, lse_new = torch.zeros(2, 4), torch.full((2, 4), -float("inf"))
    assert torch.allclose(merge_partials(pre, lse_pre, new, lse_new, 1, 3), pre)


def test_a_different_lse_layout_is_refused() -> None:
    def transposed(*args: Any) -> Any:
        out, lse = varlen_attn(*args)
        return out, lse.T.contiguous()

    q, k = torch.randn(4, 3, 8), torch.randn(40, 3, 8)
    plan = SplitPlan(q_len=4, prefix_len=36, chunk=12, num_chunks=3)
    with pytest.raises(RuntimeError, match=r"log-sum-exp is \(12, 3\)"):
        split_prefix_attention(transposed, merge_partials, q, k, k, plan,
                               split_offsets(plan, q.device), 8)  # fmt: skip
