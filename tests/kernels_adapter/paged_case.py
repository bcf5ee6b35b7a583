"""One paged-attention problem run through a backend against the dense float64 oracle: a
NaN-poisoned pool (unused pages and slots must never be read) with shuffled page tables and
cached prefixes, and one batch of new tokens. Shared by the reference and FlashMLA backend tests
and the joined-query tests."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.kernels_adapter import get_backend_class
from mlaserve.kv_cache import MLAKVPool, PageAllocator
from tests.kernels_adapter.attention_oracle import dense_mla_attention

RANK, ROPE, HEADS = 32, 16, 4


def model_config(rank: int = RANK, rope: int = ROPE, heads: int = HEADS) -> ModelConfig:
    return ModelConfig(
        model_type="deepseek_v3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope,
        v_head_dim=16,
    )


@dataclasses.dataclass
class Case:
    prefix_lens: list[int]  # tokens already in cache per sequence
    q_lens: list[int]  # new tokens per sequence
    page_size: int
    kv_dtype: torch.dtype


def run_case(
    case: Case,
    device: torch.device,
    backend_name: str = "reference",
    dims: tuple[int, int, int] = (RANK, ROPE, HEADS),
    q_dtype: torch.dtype = torch.float32,
    tolerance: float = 1e-5,
    q_seen_by_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """Run one case through `backend_name`; returns the worst relative error (asserted <= tol).

    The oracle gets the query the backend received (in `q_dtype`), or, where a backend rounds
    it further on purpose (fp8 kernels take an e4m3 query), `q_seen_by_kernel(q)`: the test then
    measures the kernel's own error, not the designed rounding."""
    torch.manual_seed(0)
    rng = random.Random(0)
    RANK, ROPE, HEADS = dims
    mc = model_config(RANK, ROPE, HEADS)
    bs = len(case.q_lens)
    seq_lens = [p + q for p, q in zip(case.prefix_lens, case.q_lens)]
    max_pages = max(-(-s // case.page_size) for s in seq_lens) + 2
    num_pages = 2 + sum(-(-s // case.page_size) for s in seq_lens) + 5
    pool = MLAKVPool(
        1,
        num_pages,
        case.page_size,
        RANK,
        ROPE,
        case.kv_dtype,
        device,
        k_scale=0.5 if case.kv_dtype == torch.float8_e4m3fn else 1.0,
    )
    if case.kv_dtype != torch.float8_e4m3fn:
        pool.kv_buffers[0].fill_(float("nan"))  # unused pages and slots must never be read
    else:
        pool.kv_buffers[0].view(torch.uint8).fill_(0x7F)  # e4m3 NaN bit pattern
    alloc = PageAllocator(num_pages)
    free = alloc.allocate(alloc.num_free_pages)
    rng.shuffle(free)  # non-contiguous page tables

    full_kv, tables, slots = [], [], []
    for s in seq_lens:
        pages = [free.pop() for _ in range(-(-s // case.page_size))]
        tables.append(pages + [0] * (max_pages - len(pages)))
        full_kv.append(torch.randn(s, RANK + ROPE, device=device))
        slots.append(
            [pages[t // case.page_size] * case.page_size + t % case.page_size for t in range(s)]
        )
    # The prefix is already cached; write it the way a previous step would have.
    for b, p in enumerate(case.prefix_lens):
        if p:
            idx = torch.tensor(slots[b][:p], device=device)
            pool.write(0, idx, full_kv[b][:p, :RANK], full_kv[b][:p, RANK:])

    q = torch.randn(sum(case.q_lens), HEADS, RANK + ROPE, device=device)
    new_rows = torch.cat([full_kv[b][p:] for b, p in enumerate(case.prefix_lens)])
    cu = [0]
    for n in case.q_lens:
        cu.append(cu[-1] + n)
    uniform = len(set(case.q_lens)) == 1
    backend = get_backend_class(backend_name)(mc, case.page_size, case.kv_dtype, device, bs, 1024)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if uniform else ForwardMode.EXTEND,
        bs=bs,
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
    )
    backend.prepare(batch)
    qm, new_rows = q.to(q_dtype), new_rows.to(q_dtype)
    out = backend.forward(
        0, qm[..., :RANK], qm[..., RANK:], new_rows[:, :RANK], new_rows[:, RANK:], batch
    )
    assert out.shape == (cu[-1], HEADS, RANK)
    assert torch.isfinite(out).all()
    worst = 0.0
    for b in range(bs):
        kv = full_kv[b]
        kv = pool.quantize(kv).float() * pool.k_scales[0]  # the oracle sees the stored values
        q_ref = qm.float() if q_seen_by_kernel is None else q_seen_by_kernel(qm).float()
        ref = dense_mla_attention(q_ref[cu[b] : cu[b + 1]].cpu(), kv.cpu(), RANK, mc.softmax_scale)
        got = out[cu[b] : cu[b + 1]].double().cpu()
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < tolerance, f"seq {b}: relative error {err:.2e}"
        worst = max(worst, err)
    return worst
