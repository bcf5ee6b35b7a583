"""The MHA form of MLA's keys for prefill: per head [k_nope | k_pe], one launch.

    kv    [S, H, d_n + d_v]  the up-projected context (one GEMM's output viewed per head:
                             k_nope then v); any strides with a contiguous last dim
    k_pe  [S, d_r]           the context's roped key part (shared by all heads), kv's dtype;
                             any strides with a contiguous last dim
    d_n   int                k_nope's width
    returns k [S, H, d_n + d_r], new, contiguous, kv's dtype: k[s, h] = [kv[s, h, :d_n] | k_pe[s]]

Why: `torch.cat([kv[..., :d_n], k_pe.expand(...)], -1)` reads a strided and a broadcast input;
torch's concatenation kernel runs far below the copy bandwidth there (measured:
bench/RESULTS.md, "Router logits and the prefill's query and keys"). Here each program copies a
block of tokens of one head as whole rows. A copy: the same bits as the concatenation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mha_key"]

_BLOCK_S = 32


# S (the context's token count) is a runtime value, not specialised: one compile (at start-up's
# warm-up prefill) serves every prompt length; the strides are fixed per model.
@triton.jit(do_not_specialize=["S"])
def _mha_key_kernel(
    kv_ptr, pe_ptr, k_ptr, S, kv_ss, kv_sh, pe_ss,
    H: tl.constexpr, DN: tl.constexpr, DR: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_DN: tl.constexpr, BLOCK_DR: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    rows = offs_s.to(tl.int64)[:, None]
    dn = tl.arange(0, BLOCK_DN)[None, :]
    dr = tl.arange(0, BLOCK_DR)[None, :]
    nope = tl.load(kv_ptr + rows * kv_ss + h * kv_sh + dn, mask=mask_s[:, None] & (dn < DN))
    pe = tl.load(pe_ptr + rows * pe_ss + dr, mask=mask_s[:, None] & (dr < DR))
    out = k_ptr + (rows * H + h) * (DN + DR)
    tl.store(out + dn, nope, mask=mask_s[:, None] & (dn < DN))
    tl.store(out + DN + dr, pe, mask=mask_s[:, None] & (dr < DR))


def mha_key(kv: torch.Tensor, k_pe: torch.Tensor, d_n: int) -> torch.Tensor:
    """-> k [S, H, d_n + d_r] (see the module docstring). Raises ValueError on inputs that do
    not fit."""
    if kv.dim() != 3 or k_pe.dim() != 2 or k_pe.shape[0] != kv.shape[0] or d_n > kv.shape[2]:
        raise ValueError(
            f"mha_key: kv {list(kv.shape)} ([S, H, d_n + d_v]) and k_pe {list(k_pe.shape)} "
            f"([S, d_r]) do not fit d_n = {d_n}"
        )
    if k_pe.dtype != kv.dtype or kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("mha_key: kv and k_pe need one dtype and contiguous last dims")
    num_tokens, heads, _ = kv.shape
    d_r = k_pe.shape[1]
    k = torch.empty(num_tokens, heads, d_n + d_r, dtype=kv.dtype, device=kv.device)
    if num_tokens == 0:
        return k
    _mha_key_kernel[(triton.cdiv(num_tokens, _BLOCK_S), heads)](
        kv, k_pe, k, num_tokens, kv.stride(0), kv.stride(1), k_pe.stride(0),
        H=heads, DN=d_n, DR=d_r, BLOCK_S=_BLOCK_S, BLOCK_DN=triton.next_power_of_2(d_n),
        BLOCK_DR=triton.next_power_of_2(d_r), num_warps=4,
    )  # fmt: skip
    return k
