"""Split-KV's merge (`ops/attention_merge.py`) against one softmax over all keys: P + 1 partials
of real attention over disjoint key sets, merged, equal full attention (fp32 math: 1e-5; bf16
partials and output: the output's rounding, 1e-2), over the layout the prefix split passes
(partials padded to Dp columns, only d_v of them merged)."""

from __future__ import annotations

import pytest
import torch

from tests.ops.cases import cpu_case, gpu_case


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    scores = torch.einsum("qhd,khd->hqk", q, k)
    if causal:
        n = q.shape[0]
        seen = (
            torch.arange(k.shape[0], device=q.device)[None]
            <= torch.arange(n, device=q.device)[:, None]
        )
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v), torch.logsumexp(scores, -1)


CASES = [
    gpu_case(16, 16, 4, torch.bfloat16),
    gpu_case(64, 128, 3, torch.float32),
    gpu_case(1, 16, 1, torch.bfloat16),
]
CASES += [cpu_case(3, 2, 3, torch.float32), cpu_case(1, 3, 1, torch.float32)]  # fmt: skip


@pytest.mark.parametrize("n,heads,chunks,dtype,device", CASES)
def test_merge_equals_one_softmax(n, heads, chunks, dtype, device):
    from mlaserve.ops.attention_merge import merge_attention

    g = torch.Generator(device=device).manual_seed(n * heads + chunks)
    dim, d_v, width, chunk = 24, 16, 24, 5  # partials padded from d_v to `width` columns
    q = torch.randn(n, heads, dim, generator=g, device=device)
    k = torch.randn(chunks * chunk + n, heads, dim, generator=g, device=device)
    v = torch.randn(chunks * chunk + n, heads, width, generator=g, device=device)
    parts = [_partial(q, k[p * chunk : (p + 1) * chunk], v[p * chunk : (p + 1) * chunk], False)
             for p in range(chunks)]  # fmt: skip
    new, lse_new = _partial(q, k[chunks * chunk :], v[chunks * chunk :], True)
    pre = torch.cat([o for o, _ in parts]).to(dtype)  # [P * n, H, width]
    lse_pre = torch.cat([lse for _, lse in parts], dim=1)  # [H, P * n]
    got = merge_attention(pre, lse_pre, new.to(dtype), lse_new, chunks, d_v)
    # All keys at once: the prefix is fully visible, the new tokens causal among themselves.
    scores = torch.einsum("qhd,khd->hqk", q, k)
    seen = (
        torch.arange(k.shape[0], device=device)[None]
        <= chunks * chunk + torch.arange(n, device=device)[:, None]
    )
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)
    assert got.shape == (n, heads, d_v) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want[..., :d_v], rtol=tol, atol=tol)


def test_merge_refuses_what_does_not_fit():
    from mlaserve.ops.attention_merge import merge_attention

    new, lse = torch.zeros(2, 3, 8), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="do not fit 2 chunks"):
        merge_attention(torch.zeros(2, 3, 8), torch.zeros(3, 4), new, lse, 2, 8)
    with pytest.raises(ValueError, match="float32"):
        merge_attention(torch.zeros(4, 3, 8), torch.zeros(3, 4).half(), new, lse, 2, 8)
