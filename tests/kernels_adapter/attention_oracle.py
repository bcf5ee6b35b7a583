"""A dense, unpaged MLA attention used to check every paged backend.

For one sequence: q [q_len, H, R+P], kv [L, R+P] (the whole sequence, new tokens last),
query i sees keys 0 .. L - q_len + i. Returns [q_len, H, R]. Computed in float64.
"""

from __future__ import annotations

import torch


def dense_mla_attention(q: torch.Tensor, kv: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    q, kv = q.double(), kv.double()
    q_len, seq_len = q.shape[0], kv.shape[0]
    scores = torch.einsum("qhd,sd->qhs", q, kv) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > q_pos, float("-inf"))
    return torch.einsum("qhs,sc->qhc", torch.softmax(scores, dim=-1), kv[:, :rank])
