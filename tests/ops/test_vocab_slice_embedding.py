"""The fused slice lookup vs `mlaserve.model.layers.embedding.slice_lookup`: bit for bit (both
copy rows). Ids cover this slice, the padded rows past the vocabulary, and other ranks' slices
(zero rows). The slice is a view into a table whose other ranks' rows are NaN, so a read
outside it would show."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.embedding import slice_lookup
from tests.ops.cases import GPU_TOKENS, cpu_case, gpu_case, model_dtype

# (vocab, hidden, ranks): V3's table at TP2 / TP4 / TP8; a small odd vocabulary padded at TP4.
CASES = [gpu_case(t, 129280, 7168, r) for t in GPU_TOKENS for r in (2, 4, 8)] + [
    gpu_case(7, 1003, 96, 4),
    cpu_case(5, 1003, 96, 4),
]


@pytest.mark.parametrize("num_tokens,vocab,hidden,ranks,device", CASES)
def test_vocab_slice_embedding_matches_reference(num_tokens, vocab, hidden, ranks, device):
    from mlaserve.ops.vocab_slice_embedding import vocab_slice_embedding

    share = -(-vocab // ranks)
    g = torch.Generator(device=device).manual_seed(vocab + num_tokens)
    table = torch.empty(share * ranks, hidden, device=device, dtype=model_dtype(device))
    for rank in range(ranks):
        start = rank * share
        rows = max(0, min(share, vocab - start))
        table[start : start + rows] = torch.randn(rows, hidden, generator=g, device=device).to(
            table.dtype
        )
        table[start + rows : start + share] = 0  # the padding's rows, as the loader zeroes them
    ids = torch.randint(0, vocab, (num_tokens,), generator=g, device=device)
    ids[0] = vocab - 1  # the last real row (next to the padding)
    for rank in range(ranks):
        start = rank * share
        poisoned = torch.full_like(table, float("nan"))  # every other rank's rows NaN
        poisoned[start : start + share] = table[start : start + share]
        weight = poisoned[start : start + share]  # a contiguous view inside the NaNs
        got = vocab_slice_embedding(ids, weight, start)
        want = slice_lookup(ids, weight, start)
        assert got.shape == (num_tokens, hidden) and got.dtype == weight.dtype
        assert not got.isnan().any()
        assert torch.equal(got, want), f"rank {rank}"
        mine = (ids >= start) & (ids < start + share)
        assert torch.equal(got[mine], table[ids[mine]]) and not got[~mine].any()


def test_vocab_slice_embedding_refuses_what_it_cannot_read() -> None:
    from mlaserve.ops.vocab_slice_embedding import vocab_slice_embedding

    weight = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="int64"):
        vocab_slice_embedding(torch.zeros(3, dtype=torch.int32), weight, 0)
    with pytest.raises(ValueError, match="contiguous"):
        vocab_slice_embedding(torch.zeros(3, dtype=torch.int64), weight.t(), 0)
