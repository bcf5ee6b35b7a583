"""A prefix-cache hit in the absorbed form: which EXTEND batches FlashMLA attends as a decode.

A hit is a few new tokens over a long cached prefix. The MHA form (`mha_extend.py`) up-projects
the whole context to per-head keys and values first; the absorbed form attends the latent cache
as decode does, the new tokens a causal q_len of one sequence (bottom-right aligned, as VERIFY):

    q_latent = q_nope W_UK   [T, H, r]   then  [q_latent | q_pe]  [1, T, H, r + d_r] to FlashMLA
    o        = o_latent W_UV [T, H, d_v]

FLOPs per layer, S keys (prefix + new), T new tokens, H heads, r = 512, d_r = 64, d_n = d_v = 128:

    MHA form      2 S H r (d_n + d_v)  +  2 T H S (d_n + d_r + d_v)    up-projection + attention
    absorbed form 2 T H S (r + d_r + r)                                 (W_UK / W_UV: T rows only)

so the absorbed form does less work while T (r + d_r + r - d_n - d_r - d_v) < r (d_n + d_v):
T < 170 at DeepSeek's dims, whatever S is, and it reads the latent context once (S x 576 fp8
bytes) instead of writing and reading K and V (S x H x (d_n + d_r + d_v) bf16 values). It also
launches a handful of kernels per layer where the MHA form launches about twenty: a hit runs
eagerly between piecewise graphs, where launches are what bound it.

FlashMLA's legacy schedule packs T x H query rows into 64-row blocks and gives each block
`num_sms // blocks` SM parts over the keys; fewer than two parts leaves the keys of each block
to one CTA, so `takes_absorbed_hit` also bounds T x H by that.

Numerics are decode's: over an FP8 cache FlashMLA takes an e4m3 query, so a hit's attention
output carries the query's rounding (about 4e-2 of its largest value, where the MHA form's bf16
keys give 4e-3), the error every decoded and verified token already has. On by default;
`MLASERVE_ABSORBED_HIT=0` keeps the MHA form (read when the backend is built).
"""

from __future__ import annotations

__all__ = ["MAX_NEW_TOKENS", "MIN_PREFIX", "takes_absorbed_hit"]

MIN_PREFIX = 1024  # below this the MHA form's up-projection is small either way
MAX_NEW_TOKENS = 128  # under the T < 170 crossover of the module docstring
ROWS_PER_BLOCK = 64  # FlashMLA's query rows per block (legacy SM90 kernel)
MIN_SM_PARTS = 2  # SM parts per row block: the keys split at least in two


def takes_absorbed_hit(
    q_lens: tuple[int, ...], kv_lens: tuple[int, ...], heads: int, num_sms: int
) -> bool:
    """Whether an EXTEND batch (host lengths: new tokens and whole context per sequence) is one
    sequence of at most MAX_NEW_TOKENS new tokens over a cached prefix of at least MIN_PREFIX
    keys, whose T x H query rows leave every 64-row block at least MIN_SM_PARTS SM parts."""
    if len(q_lens) != 1 or len(kv_lens) != 1:
        return False
    (q_len,), (kv_len,) = q_lens, kv_lens
    blocks = -(-q_len * heads // ROWS_PER_BLOCK)
    return (
        0 < q_len <= MAX_NEW_TOKENS
        and kv_len - q_len >= MIN_PREFIX
        and blocks * MIN_SM_PARTS <= num_sms
    )
