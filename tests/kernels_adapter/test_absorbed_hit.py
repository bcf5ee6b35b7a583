"""Which EXTEND batches FlashMLA attends in the absorbed form (`kernels_adapter/absorbed_hit.py`):
host lengths only. The attention itself is tested on the GPU (`test_flashmla_extend.py`)."""

from __future__ import annotations

import pytest

from mlaserve.kernels_adapter.absorbed_hit import MAX_NEW_TOKENS, MIN_PREFIX, takes_absorbed_hit

H100_SMS = 132


@pytest.mark.parametrize(
    ("q_lens", "kv_lens", "heads", "want"),
    [
        ((16,), (8192 + 16,), 16, True),  # the hit: 16 new over 8k cached
        ((1,), (MIN_PREFIX + 1,), 16, True),  # the shortest prefix, one new token
        ((MAX_NEW_TOKENS,), (4096 + MAX_NEW_TOKENS,), 16, True),  # 2048 rows: 32 blocks
        ((MAX_NEW_TOKENS + 1,), (4096 + MAX_NEW_TOKENS + 1,), 16, False),  # past the crossover
        ((16,), (MIN_PREFIX - 1 + 16,), 16, False),  # prefix too short to matter
        ((64,), (64,), 16, False),  # a fresh prompt: no prefix
        ((16, 16), (8192, 8192), 16, False),  # two sequences
        ((64,), (8192,), 128, False),  # 8192 rows: 128 blocks, one SM part each
        ((32,), (8192,), 128, True),  # 4096 rows: 64 blocks, two parts each
        ((0,), (8192,), 16, False),
        ((16,), (), 16, False),  # no context lengths: not a hit (extend_layout names the problem)
    ],
)
def test_takes_absorbed_hit(
    q_lens: tuple[int, ...], kv_lens: tuple[int, ...], heads: int, want: bool
) -> None:
    assert takes_absorbed_hit(q_lens, kv_lens, heads, H100_SMS) is want
