"""Attention backends under tensor parallelism, on the CPU: each rank's backend is built for the
heads it attends (`num_heads` = num_attention_heads // tp_size), validates that count, and the
reference backend on a rank's heads gives exactly TP1's output sliced to those heads.

The Blackwell kernels' per-rank limits (tokenspeed's heads x q_len, trtllm-gen's head counts,
their buffers) are checked against the real packages in `test_blackwell_contract.py`.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.kernels_adapter import (
    BackendUnsupportedError,
    get_backend_class,
    make_backend,
    per_rank_heads,
    resolve_backend_name,
)
from mlaserve.kernels_adapter.mha_extend import reference_extend_mha
from mlaserve.kernels_adapter.reference import ReferenceBackend
from mlaserve.kv_cache import MLAKVPool, PageAllocator
from tests.kernels_adapter.blackwell_problem import deepseek_config
from tests.kernels_adapter.paged_case import model_config

CPU = torch.device("cpu")
V3_HEADS = 128
RANK, ROPE, NOPE, V_DIM, HEADS = 32, 16, 16, 16, 16  # small dims, 16 heads: up to TP8


@pytest.mark.parametrize(("tp", "heads"), [(1, 128), (2, 64), (4, 32), (8, 16)])
def test_v3_heads_per_rank(tp: int, heads: int) -> None:
    v3 = deepseek_config(heads=V3_HEADS)
    assert per_rank_heads(v3, V3_HEADS // tp) == heads
    backend = make_backend("reference", v3, 64, torch.bfloat16, CPU, 8, 256, num_heads=heads)
    assert isinstance(backend, ReferenceBackend) and backend.num_heads == heads
    assert backend.model_config.num_attention_heads == V3_HEADS  # the model keeps its count


def test_default_is_all_heads() -> None:
    v3 = deepseek_config(heads=V3_HEADS)
    assert per_rank_heads(v3, None) == V3_HEADS
    assert ReferenceBackend(v3, 64, torch.bfloat16, CPU, 8, 256).num_heads == V3_HEADS


@pytest.mark.parametrize("bad", [0, -16, 3, 48, 256, 16.0, True, "16"])
def test_num_heads_must_divide_the_model_heads(bad) -> None:
    v3 = deepseek_config(heads=V3_HEADS)
    match = r"num_heads: .*positive divisor of the model's num_attention_heads 128"
    with pytest.raises(ValueError, match=match):
        per_rank_heads(v3, bad)
    with pytest.raises(ValueError, match=match):
        ReferenceBackend(v3, 64, torch.bfloat16, CPU, 8, 256, num_heads=bad)
    for name in ("auto", "reference", "flashmla", "trtllm", "tokenspeed"):
        with pytest.raises(ValueError, match=match) as info:  # before any device check
            resolve_backend_name(name, v3, 64, torch.bfloat16, CPU, num_heads=bad)
        assert not isinstance(info.value, BackendUnsupportedError)
    with pytest.raises(ValueError, match=match):
        make_backend("reference", v3, 64, torch.bfloat16, CPU, 8, 256, num_heads=bad)


def test_flashmla_checks_per_rank_heads_and_q_len() -> None:
    cls = get_backend_class("flashmla")
    v3 = deepseek_config(heads=V3_HEADS)
    with pytest.raises(ValueError, match="num_heads"):
        cls.check_supported(v3, 64, torch.bfloat16, CPU, num_heads=48)
    with pytest.raises(BackendUnsupportedError, match=r"max_q_len: .* with 16 heads a rank"):
        cls.check_supported(v3, 64, torch.bfloat16, CPU, num_heads=16, max_q_len=9)
    with pytest.raises(BackendUnsupportedError, match="CUDA"):  # the shape itself is fine
        cls.check_supported(v3, 64, torch.bfloat16, CPU, num_heads=16, max_q_len=8)


@pytest.mark.parametrize(("heads", "tokens"), [(3, 4), (16, 4), (32, 2), (64, 1), (128, 1)])
def test_flashmla_small_batches_by_heads_a_rank(heads: int, tokens: int, monkeypatch) -> None:
    """The Triton small-batch kernel takes up to 4 tokens, fewer past 64 query rows (V3 at TP2
    and TP1: one token), and `MLASERVE_MLA_DECODE_ROWS` overrides it at every head count."""
    from mlaserve.kernels_adapter.flashmla import small_batch_max_rows

    monkeypatch.delenv("MLASERVE_MLA_DECODE_ROWS", raising=False)
    assert small_batch_max_rows(heads) == tokens
    monkeypatch.setenv("MLASERVE_MLA_DECODE_ROWS", "3")
    assert small_batch_max_rows(heads) == 3


def test_auto_logs_the_per_rank_shape(caplog) -> None:
    v3 = deepseek_config(heads=V3_HEADS)
    with caplog.at_level(logging.INFO, logger="mlaserve.kernels_adapter.registry"):
        got = resolve_backend_name("auto", v3, 64, torch.bfloat16, CPU, num_heads=16, max_q_len=8)
    assert got == "reference"
    assert "16 heads a rank, q_len <= 8" in caplog.text


def test_query_with_another_head_count_is_refused() -> None:
    mc = model_config(RANK, ROPE, HEADS)
    backend = ReferenceBackend(mc, 4, torch.float32, CPU, 4, 64, num_heads=4)
    case = _problem(backend, [3], [1], torch.float32)
    backend.prepare(case.batch)
    q = torch.randn(1, HEADS, RANK + ROPE)  # all 16 heads, to a backend of 4
    rows = case.new_rows
    with pytest.raises(ValueError, match=r"must have 4 heads on dim 1.*num_heads=4 of .* 16"):
        backend.forward(0, q[..., :RANK], q[..., RANK:], rows[:, :RANK], rows[:, RANK:],
                        case.batch)  # fmt: skip


# --------------------------------------------------------------------------------------------
# The reference backend per rank == TP1 sliced to the rank's heads
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Problem:
    batch: ForwardBatch
    new_rows: torch.Tensor  # [T, r + d_r] the new tokens' latent | k_pe


def _problem(
    backend, prefix_lens: list[int], q_lens: list[int], kv_dtype: torch.dtype, page_size: int = 4
) -> _Problem:
    """A NaN-poisoned paged pool (unused pages and slots must never be read) with shuffled page
    tables and cached prefixes, and one batch of new tokens (uniform q_len: DECODE, else
    EXTEND)."""
    torch.manual_seed(0)
    rng = random.Random(0)
    seq_lens = [p + q for p, q in zip(prefix_lens, q_lens)]
    max_pages = max(-(-s // page_size) for s in seq_lens) + 2
    num_pages = 2 + sum(-(-s // page_size) for s in seq_lens) + 5
    fp8 = kv_dtype == torch.float8_e4m3fn
    pool = MLAKVPool(1, num_pages, page_size, RANK, ROPE, kv_dtype, CPU, 0.5 if fp8 else 1.0)
    if fp8:
        pool.kv_buffers[0].view(torch.uint8).fill_(0x7F)  # e4m3 NaN
    else:
        pool.kv_buffers[0].fill_(float("nan"))
    alloc = PageAllocator(num_pages)
    free = alloc.allocate(alloc.num_free_pages)
    rng.shuffle(free)
    tables, slots = [], []
    for s in seq_lens:
        pages = [free.pop() for _ in range(-(-s // page_size))]
        tables.append(pages + [0] * (max_pages - len(pages)))
        slots.append([pages[t // page_size] * page_size + t % page_size for t in range(s)])
    for b, p in enumerate(prefix_lens):
        if p:
            rows = torch.randn(p, RANK + ROPE)
            pool.write(0, torch.tensor(slots[b][:p]), rows[:, :RANK], rows[:, RANK:])
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    uniform = len(set(q_lens)) == 1
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if uniform else ForwardMode.EXTEND,
        bs=len(q_lens),
        num_tokens=cu[-1],
        q_len=max(q_lens),
        max_seq_len=max(seq_lens),
        input_ids=torch.zeros(cu[-1], dtype=torch.long),
        positions=torch.zeros(cu[-1], dtype=torch.long),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor([s for b, p in enumerate(prefix_lens) for s in slots[b][p:]]),
        logits_indices=torch.zeros(0, dtype=torch.long),
        kv_pool=pool,
        attn_backend=backend,
        seq_lens_host=None if uniform else seq_lens,
        q_lens_host=None if uniform else list(q_lens),
    )
    return _Problem(batch=batch, new_rows=torch.randn(cu[-1], RANK + ROPE))


def _on_twin_pool(batch: ForwardBatch, pool_bytes: torch.Tensor, backend) -> ForwardBatch:
    """The batch over a fresh copy of the pool as it was (each rank holds all of the latent)."""
    pool = batch.kv_pool
    twin = MLAKVPool(1, pool.num_pages, pool.page_size, RANK, ROPE, pool.dtype, CPU, pool.k_scales)
    twin.kv_buffers[0].view(torch.uint8).copy_(pool_bytes)
    return dataclasses.replace(batch, kv_pool=twin, attn_backend=backend, attn_metadata=None)


CASES = {
    "extend": ([0, 7, 30], [5, 9, 1]),  # ragged: a fresh prompt, chunks over cached prefixes
    "decode": ([10, 3, 40, 1], [1, 1, 1, 1]),
    "verify": ([10, 3, 40], [4, 4, 4]),  # q_len k + 1 = 4
}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_reference_per_rank_equals_tp1_head_slice(tp: int, case: str, kv_dtype) -> None:
    """TP1 attends all 16 heads; rank r's backend, built for heads [r*h/tp, (r+1)*h/tp), attends
    that slice of the same query over its own copy of the same latent cache (writing the same
    new tokens), and must give TP1's output for those heads. NaN-poisoned unused pages."""
    mc = model_config(RANK, ROPE, HEADS)
    prefix_lens, q_lens = CASES[case]
    full = ReferenceBackend(mc, 4, kv_dtype, CPU, len(q_lens), 128, max_q_len=4)
    problem = _problem(full, prefix_lens, q_lens, kv_dtype)
    pool_bytes = problem.batch.kv_pool.kv_buffers[0].view(torch.uint8).clone()
    q = torch.randn(problem.batch.num_tokens, HEADS, RANK + ROPE)
    kv_c, k_pe = problem.new_rows[:, :RANK], problem.new_rows[:, RANK:]

    batch = _on_twin_pool(problem.batch, pool_bytes, full)
    full.prepare(batch)
    ref = full.forward(0, q[..., :RANK], q[..., RANK:], kv_c, k_pe, batch)
    assert ref.shape == (problem.batch.num_tokens, HEADS, RANK) and torch.isfinite(ref).all()

    h = HEADS // tp
    for rank in range(tp):
        heads = slice(rank * h, (rank + 1) * h)
        backend = make_backend(
            "reference", mc, 4, kv_dtype, CPU, len(q_lens), 128, max_q_len=4, num_heads=h
        )
        assert backend.num_heads == h
        rb = _on_twin_pool(problem.batch, pool_bytes, backend)
        backend.prepare(rb)
        qr = q[:, heads].contiguous()
        out = backend.forward(0, qr[..., :RANK], qr[..., RANK:], kv_c, k_pe, rb)
        assert out.shape == (problem.batch.num_tokens, h, RANK)
        assert torch.isfinite(out).all()
        # Heads are independent: the same numbers, to fp32 summation order at most.
        torch.testing.assert_close(out, ref[:, heads], rtol=1e-6, atol=1e-6)
        # The cache each rank wrote is the same latent TP1 wrote (no head axis).
        assert torch.equal(
            rb.kv_pool.kv_buffers[0].view(torch.uint8),
            batch.kv_pool.kv_buffers[0].view(torch.uint8),
        )


@pytest.mark.parametrize("tp", [2, 8])
def test_mha_form_per_rank_equals_tp1_head_slice(tp: int) -> None:
    """The MHA-form prefill (`reference_extend_mha`, what the kernel backends' EXTEND path
    reproduces) on a rank's q / W_UK / W_UV heads is TP1's, sliced."""
    mc = model_config(RANK, ROPE, HEADS)
    prefix_lens, q_lens = CASES["extend"]
    full = ReferenceBackend(mc, 4, torch.float32, CPU, len(q_lens), 128)
    problem = _problem(full, prefix_lens, q_lens, torch.float32)
    pool_bytes = problem.batch.kv_pool.kv_buffers[0].view(torch.uint8).clone()
    torch.manual_seed(1)
    q = torch.randn(problem.batch.num_tokens, HEADS, NOPE + ROPE)
    w_uk = torch.randn(HEADS, NOPE, RANK) / RANK**0.5
    w_uv = torch.randn(HEADS, RANK, V_DIM) / RANK**0.5
    kv_c, k_pe = problem.new_rows[:, :RANK], problem.new_rows[:, RANK:]
    ref = reference_extend_mha(
        0, q, kv_c, k_pe, w_uk, w_uv, _on_twin_pool(problem.batch, pool_bytes, full),
        mc.softmax_scale,
    )  # fmt: skip
    assert torch.isfinite(ref).all()
    h = HEADS // tp
    for rank in range(tp):
        heads = slice(rank * h, (rank + 1) * h)
        out = reference_extend_mha(
            0, q[:, heads], kv_c, k_pe, w_uk[heads], w_uv[heads],
            _on_twin_pool(problem.batch, pool_bytes, full), mc.softmax_scale,
        )  # fmt: skip
        torch.testing.assert_close(out, ref[:, heads], rtol=1e-6, atol=1e-6)
