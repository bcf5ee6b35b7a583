"""The torch forms of the batch-invariant kernels: the deterministic mode's path off CUDA, and
the references the kernels are tested against (`ops/invariant_matmul.py`,
`ops/invariant_mla_attention.py`; shapes and layouts there).

Each computes one row (token) at a time with torch calls whose shapes depend on that row alone
(its own K, or its own position p), in fp32, rounded once: so a row's bits cannot depend on the
batch. Slow (a Python loop over rows) and eager only (the attention reads each row's sequence
and position on the host). Torch only: importable without Triton.

The summation tree that makes the deterministic mode tensor-parallel invariant lives here too
(`TREE_LEAVES`, `tree_sum`): a row-parallel product's K (and an MoE layer's intermediate dim)
is cut into `TREE_LEAVES` equal chunks whatever the TP size, each chunk's fp32 sum is a leaf,
and the leaves are summed in one balanced binary tree of adjacent pairs. A rank of a TP group of
N holds TREE_LEAVES / N consecutive leaves, a whole subtree: it sums them (`tree_sum`, or the
kernels' in-register tree), and `tensor_parallel.tree_all_reduce` sums the N subtrees in the
tree's top levels. Every TP size that divides TREE_LEAVES then adds the same numbers in the same
order: the same bits at TP 1, 2, 4 and 8 (SGLang's and vLLM's "tree-based invariant kernels").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "TREE_LEAVES",
    "check_attention_shapes",
    "check_leaves",
    "dequantized",
    "leaf_width",
    "rowwise_head_matmul",
    "rowwise_matmul",
    "rowwise_mla_attention",
    "scale_row_div",
    "tree_sum",
]

_SCALE_BLOCK = 128  # FP8 block scales: 128 x 128 (`model/layers/fp8_linear.py`)
# The deterministic mode's summation tree (module docstring): leaves of every reduction a TP
# group splits; 8 covers every TP size of one 8-GPU node (1, 2, 4, 8).
TREE_LEAVES = 8


def check_leaves(leaves: int) -> None:
    """ValueError unless `leaves` is a power of two dividing TREE_LEAVES."""
    if leaves < 1 or TREE_LEAVES % leaves:
        raise ValueError(f"summation tree: {leaves} leaves do not divide {TREE_LEAVES}")


def leaf_width(dim: int, leaves: int, what: str, fp8: bool = False) -> int:
    """dim / leaves: the width of one leaf of a sum over `dim` in `leaves` equal chunks.
    ValueError naming `what` unless `leaves` divides TREE_LEAVES and `dim` splits evenly, and,
    with FP8 block weights cut into several leaves, into whole 128-column scale blocks."""
    check_leaves(leaves)
    width = dim // leaves
    if dim % leaves or (fp8 and leaves > 1 and width % _SCALE_BLOCK):
        raise ValueError(
            f"{what} {dim}: the deterministic mode sums it in {leaves} equal leaves (multiples "
            f"of {_SCALE_BLOCK} with FP8 weights)"
        )
    return width


def tree_sum(leaves: torch.Tensor) -> torch.Tensor:
    """leaves [L, ...] (L a power of two, fp32) -> [...]: adjacent pairs summed, level by level
    ((l0 + l1) + (l2 + l3)) ..., the tree the invariant kernels sum in registers."""
    check_leaves(leaves.shape[0])
    while leaves.shape[0] > 1:
        leaves = leaves[0::2] + leaves[1::2]
    return leaves[0]


def scale_row_div(w: torch.Tensor, scale: torch.Tensor) -> int:
    """Weight rows per scale row: 128 for block scales, 1 for per-row ones."""
    n, k = w.shape[-2:]
    blocks = -(-k // _SCALE_BLOCK)
    if scale.dim() != 2 or scale.shape[1] != blocks or scale.stride(1) != 1:
        raise ValueError(f"invariant matmul: scale {list(scale.shape)} for weight [{n}, {k}]")
    if scale.shape[0] == n:
        return 1
    if scale.shape[0] == -(-n // _SCALE_BLOCK):
        return _SCALE_BLOCK
    raise ValueError(f"invariant matmul: scale {list(scale.shape)} for weight [{n}, {k}]")


def check_attention_shapes(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
) -> tuple[int, int, int, int]:
    """(T, H, R, DR) of an invariant attention call; ValueError on inconsistent shapes."""
    num_tokens, heads, r = q_nope.shape
    dr = q_pe.shape[-1]
    if q_pe.shape[:2] != (num_tokens, heads) or kv.shape[-1] != r + dr:
        raise ValueError(
            f"invariant_mla_attention: q_nope {list(q_nope.shape)}, q_pe {list(q_pe.shape)} vs "
            f"cache rows of {kv.shape[-1]}"
        )
    if row_seq.shape != (num_tokens,) or row_pos.shape != (num_tokens,):
        raise ValueError("invariant_mla_attention: row_seq / row_pos must be [T]")
    return num_tokens, heads, r, dr


def dequantized(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """w [N, K] as fp32 (times its FP8 block or row scales): exact, element by element."""
    if scale is None:
        return w.float()
    div = scale_row_div(w, scale)
    s = scale.repeat_interleave(div, 0)[: w.shape[0]].repeat_interleave(_SCALE_BLOCK, 1)
    return w.float() * s[:, : w.shape[1]]


def rowwise_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    leaves: int = 1,
) -> torch.Tensor:
    """`invariant_matmul` in torch: one fp32 [1, K] @ [K, N] per row (the same call whatever
    M is), rounded once. The CPU path of the deterministic mode. `leaves` > 1: K in that many
    equal chunks, one fp32 call each (each chunk's weight columns and each row's chunk copied
    into their own buffers, so a call sees the same operands, alignment included, whatever rank
    holds them: an AVX2 BLAS sums a misaligned row's head apart), summed by `tree_sum`."""
    lead, k = x.shape[:-1], x.shape[-1]
    kc = leaf_width(k, leaves, "rowwise_matmul: K")  # fp32 operands: any leaf width
    if leaves > 1 and bias is not None:
        raise ValueError("rowwise_matmul: a bias with leaves (add it after the tree's sum)")
    wf = dequantized(w, scale)
    chunks = [wf[:, c * kc : (c + 1) * kc].contiguous() for c in range(leaves)]
    rows = []
    for r in x.reshape(-1, 1, k).float():
        parts = [
            F.linear(r[:, c * kc : (c + 1) * kc].clone(), chunk) for c, chunk in enumerate(chunks)
        ]
        rows.append(tree_sum(torch.stack(parts)) if leaves > 1 else parts[0])
    y = torch.cat(rows) if rows else x.new_empty(0, w.shape[0], dtype=torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).view(*lead, w.shape[0])


def rowwise_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`invariant_head_matmul` in torch: one fp32 [H, 1, K] @ [H, K, N] per row."""
    wt = w.float().transpose(1, 2)
    rows = [torch.bmm(r.float().unsqueeze(1), wt).transpose(0, 1) for r in x]
    y = torch.cat(rows) if rows else x.new_empty(0, w.shape[0], w.shape[1], dtype=torch.float32)
    return y.to(x.dtype)


def rowwise_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    k_scale: float,
    block_tables: torch.Tensor,
    row_seq: torch.Tensor,
    row_pos: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """`invariant_mla_attention` in torch, one row at a time (reads row_seq / row_pos on the
    host: not for CUDA graphs). fp32 throughout, rounded once to q_nope's dtype."""
    num_tokens, heads, r, _ = check_attention_shapes(q_nope, q_pe, kv, row_seq, row_pos)
    page = kv.shape[1]
    scale = k_scale if kv.dtype == torch.float8_e4m3fn else 1.0
    out = torch.empty(num_tokens, heads, r, dtype=q_nope.dtype, device=q_nope.device)
    for t, (seq, pos) in enumerate(zip(row_seq.tolist(), row_pos.tolist(), strict=True)):
        pages = block_tables[seq, : pos // page + 1].long()
        keys = kv[pages].flatten(0, 1)[: pos + 1].float() * scale  # [pos + 1, R + DR]
        q = torch.cat([q_nope[t], q_pe[t]], dim=-1).float().unsqueeze(1)  # [H, 1, R + DR]
        # one [1, D] @ [D, P] per head (bmm), not one [H, D] @ [D, P]: a head's bits must not
        # depend on how many heads this rank holds (the tensor-parallel split)
        scores = torch.bmm(q, keys.T.expand(heads, -1, -1))  # [H, 1, pos + 1]
        probs = torch.softmax(scores * softmax_scale, dim=-1)
        out[t] = torch.bmm(probs, keys[:, :r].expand(heads, -1, -1))[:, 0].to(q_nope.dtype)
    return out
