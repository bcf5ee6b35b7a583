"""The paged pool's byte layout, quantization and the page allocator's accounting."""

from __future__ import annotations

import pytest
import torch

from mlaserve.kv_cache import MLAKVPool, OutOfPagesError, PageAllocator
from mlaserve.kv_cache.kv_pool import FP8_E4M3_MAX


def test_write_lands_at_page_and_row() -> None:
    pool = MLAKVPool(
        2,
        num_pages=4,
        page_size=4,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        dtype=torch.float32,
        device="cpu",
    )
    kv_c, k_pe = torch.randn(2, 8), torch.randn(2, 4)
    pool.write(1, torch.tensor([2 * 4 + 3, 1 * 4 + 0]), kv_c, k_pe)
    assert torch.equal(pool.kv_buffers[1][2, 3], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(pool.kv_buffers[1][1, 0], torch.cat([kv_c[1], k_pe[1]]))
    assert pool.kv_buffers[0].abs().sum() == 0  # other layers untouched
    got = pool.gather(1, torch.tensor([[2, 1]], dtype=torch.int32))
    assert got.shape == (1, 8, 12)
    assert torch.equal(got[0, 3], torch.cat([kv_c[0], k_pe[0]]))


def test_fp8_layout_scale_and_saturation() -> None:
    pool = MLAKVPool(
        1,
        num_pages=2,
        page_size=2,
        kv_lora_rank=4,
        qk_rope_head_dim=2,
        dtype=torch.float8_e4m3fn,
        device="cpu",
        k_scale=2.0,
    )
    assert pool.bytes_per_token == 6  # one byte per value, no inline scales
    kv_c = torch.tensor([[1.0, -3.0, 1e6, 0.5]])
    k_pe = torch.tensor([[-1e6, 8.0]])
    pool.write(0, torch.tensor([2]), kv_c, k_pe)
    stored = pool.kv_buffers[0][1, 0].float()
    assert torch.isfinite(stored).all()
    assert stored.abs().max() == FP8_E4M3_MAX  # saturated, not inf/NaN
    back = pool.gather(0, torch.tensor([[1]], dtype=torch.int32))[0, 0]
    assert torch.allclose(back[[0, 1, 3, 5]], torch.tensor([1.0, -3.0, 0.5, 8.0]), rtol=0.07)


def test_allocator_reserves_page_zero_and_accounts() -> None:
    alloc = PageAllocator(5)
    assert alloc.num_usable_pages == 4
    pages = alloc.allocate(4)
    assert 0 not in pages and sorted(pages) == [1, 2, 3, 4]
    assert not alloc.can_allocate(1)
    with pytest.raises(OutOfPagesError):
        alloc.allocate(1)
    alloc.free(pages[:2])
    assert alloc.num_free_pages == 2
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages[:1])
    with pytest.raises(ValueError):
        alloc.free([0])
