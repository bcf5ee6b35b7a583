"""One EXTEND problem for the MHA form of `kernels_adapter/mha_extend.py`: a NaN-poisoned pool
with every sequence's prefix written, shuffled page tables, and the EXTEND batch of the new
tokens on the reference backend. Shared by the CPU MHA-form tests and FlashMLA's EXTEND tests."""

from __future__ import annotations

import dataclasses
import random

import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.kernels_adapter.reference import ReferenceBackend
from mlaserve.kv_cache import MLAKVPool, PageAllocator
from tests.kernels_adapter.paged_case import model_config

RANK, ROPE, HEADS, NOPE, V_DIM = 32, 16, 4, 16, 16


@dataclasses.dataclass
class Case:
    prefix_lens: list[int]
    q_lens: list[int]
    page_size: int
    kv_dtype: torch.dtype = torch.float32


def extend_setup(
    case: Case,
    device: torch.device,
    seed: int = 0,
    dims: tuple[int, int, int] = (RANK, ROPE, HEADS),
):
    """A pool with every sequence's prefix written, and the EXTEND batch of the new tokens.
    dims: (kv_lora_rank, qk_rope_head_dim, heads)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    RANK, ROPE, HEADS = dims
    mc = model_config(RANK, ROPE, HEADS)
    seq_lens = [p + q for p, q in zip(case.prefix_lens, case.q_lens)]
    max_pages = max(-(-s // case.page_size) for s in seq_lens) + 2
    num_pages = 2 + sum(-(-s // case.page_size) for s in seq_lens) + 5
    fp8 = case.kv_dtype == torch.float8_e4m3fn
    pool = MLAKVPool(
        1, num_pages, case.page_size, RANK, ROPE, case.kv_dtype, device, 0.5 if fp8 else 1.0
    )
    if fp8:
        pool.kv_buffers[0].view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    else:
        pool.kv_buffers[0].fill_(float("nan"))
    alloc = PageAllocator(num_pages)
    free = alloc.allocate(alloc.num_free_pages)
    rng.shuffle(free)
    tables, slots, full_kv = [], [], []
    for s in seq_lens:
        pages = [free.pop() for _ in range(-(-s // case.page_size))]
        tables.append(pages + [0] * (max_pages - len(pages)))
        slots.append(
            [pages[t // case.page_size] * case.page_size + t % case.page_size for t in range(s)]
        )
        full_kv.append(torch.randn(s, RANK + ROPE, device=device))
    for b, p in enumerate(case.prefix_lens):
        if p:
            idx = torch.tensor(slots[b][:p], device=device)
            pool.write(0, idx, full_kv[b][:p, :RANK], full_kv[b][:p, RANK:])
    cu = [0]
    for n in case.q_lens:
        cu.append(cu[-1] + n)
    new_rows = torch.cat([full_kv[b][p:] for b, p in enumerate(case.prefix_lens)])
    backend = ReferenceBackend(mc, case.page_size, case.kv_dtype, device, len(seq_lens), 1024)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        bs=len(seq_lens),
        num_tokens=cu[-1],
        q_len=max(case.q_lens),
        max_seq_len=max(seq_lens),
        input_ids=torch.zeros(cu[-1], dtype=torch.long, device=device),
        positions=torch.zeros(cu[-1], dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(
            [s for b, p in enumerate(case.prefix_lens) for s in slots[b][p:]], device=device
        ),
        logits_indices=torch.zeros(0, dtype=torch.long, device=device),
        kv_pool=pool,
        attn_backend=backend,
        seq_lens_host=seq_lens,
        q_lens_host=list(case.q_lens),
    )
    return mc, backend, batch, new_rows, cu


def clone_pool(pool: MLAKVPool) -> MLAKVPool:
    twin = MLAKVPool(
        pool.num_layers,
        pool.num_pages,
        pool.page_size,
        pool.kv_lora_rank,
        pool.qk_rope_head_dim,
        pool.dtype,
        pool.device,
        pool.k_scales if pool.is_fp8 else 1.0,
    )
    for dst, src in zip(twin.kv_buffers, pool.kv_buffers):
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    return twin
