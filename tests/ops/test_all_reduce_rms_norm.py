"""The fused all-reduce + residual-add + RMSNorm kernel (mlaserve/ops/all_reduce_rms_norm.py)
on the CPU, under the interpreter: W ranks' exchange regions are plain tensors in one process,
and the ranks' calls run one after another. Rank k's call finds the pushes (data slot and flag)
of ranks < k, which ran before it; those of ranks > k are written for it beforehand, as those
ranks' first half would (data into its slot of the call's parity, flag = the call's number), so
no call waits. Checks, over calls of changing T and slot count (both parities, rows skipped
by short calls): every rank's output against `add_partials_rms_norm` on the sum over ranks
summed in rank order (the residual exactly; the normed output within fp16 rounding), and the
counters and flags. The real protocol, across GPUs and in CUDA graphs, is tested in
tests/test_custom_all_reduce_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU emulation of the peers (GPU: the 2-GPU test)"
)

N, ROWS = 48, 4
TOL = {"rtol": 1e-2, "atol": 1e-2}  # fp16 normed output: one rounding of the sum of squares


def _push_for(k: int, r: int, parts: torch.Tensor, regions, exchanges, slot: int) -> None:
    """Rank r's first half of a call, seen by rank k: its rows' sums in k's data slots of r's
    parity, and k's flags [t, r] set to r's call number."""
    world = len(regions)
    flags = regions[k].view(torch.int32)[2 * ROWS * world * slot :]
    for t in range(parts.shape[0]):
        epoch = int(exchanges[r].epochs[t])
        start = (((epoch % 2) * ROWS + t) * world + r) * slot
        regions[k][start : start + N] = parts[t].sum(0)  # one slot or two: exact in fp32
        flags[t * world + r] = epoch + 1


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_with_the_unfused_path(world):
    pytest.importorskip("triton")
    from mlaserve.ops.all_reduce_rms_norm import (
        Exchange,
        all_reduce_add_rms_norm,
        exchange_bytes,
    )
    from mlaserve.ops.rms_norm import add_partials_rms_norm

    regions = [torch.zeros(exchange_bytes(ROWS, world) // 4) for _ in range(world)]
    bases = torch.tensor([r.data_ptr() for r in regions], dtype=torch.int64)
    exchanges = [
        Exchange(k, world, ROWS, bases, torch.zeros(ROWS, dtype=torch.int32)) for k in range(world)
    ]
    slot = exchanges[0].row_width
    g = torch.Generator().manual_seed(world)
    weight = (torch.rand(N, generator=g) + 0.5).half()
    calls = [(2, 1), (3, 2), (1, 1), (4, 2), (3, 1)]  # (T, slots)
    for num_tokens, slots in calls:
        # small integers in the slots: exact in fp32 whatever the order; the ranks' sum too
        parts = [
            torch.randint(-8, 9, (num_tokens, slots, N), generator=g).float() / 4
            for _ in range(world)
        ]
        residual = (torch.randn(num_tokens, N, generator=g) * 3).half()
        total = parts[0].sum(1)
        for p in parts[1:]:
            total = total + p.sum(1)
        want_out, want_res = add_partials_rms_norm(total[:, None].contiguous(), residual, weight,
                                                   1e-6)  # fmt: skip
        for k in range(world):
            for r in range(k + 1, world):
                _push_for(k, r, parts[r], regions, exchanges, slot)
            out, res = all_reduce_add_rms_norm(parts[k], residual, weight, 1e-6, exchanges[k])
            torch.testing.assert_close(res, want_res, rtol=0, atol=0)
            torch.testing.assert_close(out, want_out, **TOL)
    counts = [sum(t < num_tokens for num_tokens, _ in calls) for t in range(ROWS)]
    for k in range(world):
        assert exchanges[k].epochs.tolist() == counts
        flags = regions[k].view(torch.int32)[2 * ROWS * world * slot :].view(ROWS, world)
        for r in range(world):
            if r != k:
                assert flags[:, r].tolist() == counts, (k, r)


def test_names_what_does_not_fit():
    pytest.importorskip("triton")
    from mlaserve.ops.all_reduce_rms_norm import Exchange, all_reduce_add_rms_norm

    ex = Exchange(0, 2, 2, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    w = torch.ones(8)
    with pytest.raises(ValueError, match="past the exchange"):
        all_reduce_add_rms_norm(torch.zeros(3, 1, 8), torch.zeros(3, 8), w, 1e-6, ex)
    with pytest.raises(ValueError, match="contiguous fp32"):
        all_reduce_add_rms_norm(torch.zeros(2, 1, 8).half(), torch.zeros(2, 8), w, 1e-6, ex)
    with pytest.raises(ValueError, match="epochs"):
        Exchange(0, 2, 2, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32))
