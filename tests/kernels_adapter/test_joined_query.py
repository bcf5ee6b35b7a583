"""The joined query (`AttentionBackend.joined_q_dtype` / `forward_joined`): which backends and
batches take it, and, on an H100, that FlashMLA attends the query W_UK's GEMV wrote whole
exactly as it attends q_nope / q_pe through its own q preparation (the same bits).

FlashMLABackend cannot be built without CUDA and sgl-flash-mla; the CPU test builds it with the
package and the prefill helpers stubbed (`MLASERVE_FUSED_OPS=1`, as the kernel tests run), which
is enough for its host-side choice."""

from __future__ import annotations

import types

import pytest
import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.kernels_adapter import flashmla, get_backend_class
from mlaserve.kv_cache import MLAKVPool
from mlaserve.ops import triton_available
from tests.kernels_adapter.paged_case import model_config

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
DIMS = (512, 64, 16)  # kv_lora_rank, qk_rope_head_dim, heads: FlashMLA's


def test_backends_take_no_joined_query_by_default() -> None:
    cpu = torch.device("cpu")
    backend = get_backend_class("reference")(model_config(), 4, torch.float32, cpu, 2, 64)
    batch = types.SimpleNamespace(mode=ForwardMode.DECODE, attn_metadata=None)
    assert backend.joined_q_dtype(batch) is None
    with pytest.raises(NotImplementedError, match="no joined queries"):
        backend.forward_joined(0, torch.zeros(1, 4, 48), batch)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_flashmla_takes_joined_queries_for_the_batches_it_attends(monkeypatch) -> None:
    monkeypatch.setattr(flashmla, "_import_flash_mla", lambda: object())
    monkeypatch.setattr(flashmla, "FlashVarlenAttention", lambda device, **_: None)
    monkeypatch.setattr(flashmla, "CudnnFreshAttention", lambda device: None)
    monkeypatch.delenv("MLASERVE_MLA_DECODE_ROWS", raising=False)

    def backend(kv_dtype, fused="1", joined=None):
        monkeypatch.setenv("MLASERVE_FUSED_OPS", fused)
        if joined is None:
            monkeypatch.delenv("MLASERVE_JOINED_Q", raising=False)
        else:
            monkeypatch.setenv("MLASERVE_JOINED_Q", joined)
        mc = model_config(*DIMS)
        return flashmla.FlashMLABackend(mc, 64, kv_dtype, torch.device("cpu"), 4, 256)

    scheduled = flashmla._Metadata(sched=None)  # what prepare() builds for FlashMLA's batches

    def batch(mode=ForwardMode.DECODE, meta=scheduled):
        return types.SimpleNamespace(mode=mode, attn_metadata=meta)

    assert backend(BF16).joined_q_dtype(batch()) == BF16
    fp8 = backend(FP8)
    assert fp8.joined_q_dtype(batch()) == FP8
    assert fp8.joined_q_dtype(batch(ForwardMode.VERIFY)) == FP8
    assert fp8.joined_q_dtype(batch(meta=flashmla._SmallBatch())) is None  # Triton decode
    assert fp8.joined_q_dtype(batch(ForwardMode.EXTEND, meta=None)) is None
    assert backend(FP8, joined="0").joined_q_dtype(batch()) is None  # the A/B switch
    assert backend(FP8, fused="0").joined_q_dtype(batch()) is None  # unfused: torch q prep
    # read once, at construction
    monkeypatch.setenv("MLASERVE_JOINED_Q", "0")
    assert fp8.joined_q_dtype(batch()) == FP8


@pytest.mark.gpu
@pytest.mark.skipif(not flashmla.flashmla_available(), reason="needs an SM90 GPU, sgl-flash-mla")
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_forward_joined_equals_forward(kv_dtype: torch.dtype, q_len: int, monkeypatch) -> None:
    """W_UK's GEMV writing the joined query, then `forward_joined`, gives the bits of the GEMV
    then `forward` (q preparation inside) over the same cache and batch, at V2-Lite's heads
    (FlashMLA's batches: none goes to the small-batch Triton kernel here)."""
    monkeypatch.setenv("MLASERVE_MLA_DECODE_ROWS", "0")
    from mlaserve.ops.head_gemv import HEAD_GEMV_MAX_M, head_gemv

    rank, rope, heads = DIMS
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(q_len)
    seq_lens = [37, 130, 64][: HEAD_GEMV_MAX_M // q_len]  # rows the GEMV takes
    bs, page = len(seq_lens), 64
    pages = [-(-s // page) for s in seq_lens]
    pool = MLAKVPool(1, sum(pages) + 2, page, rank, rope, kv_dtype, dev, k_scale=0.5)
    tables = torch.zeros(bs, max(pages), dtype=torch.int32)
    first = 1
    for b, n in enumerate(pages):  # page 0 stays the dummy page
        tables[b, :n] = torch.arange(first, first + n)
        first += n
    slots = torch.cat([tables[b, torch.arange(s) // page] * page + torch.arange(s) % page
                       for b, s in enumerate(seq_lens)]).to(dev)  # fmt: skip
    kv = torch.randn(len(slots), rank + rope, generator=gen, device=dev).to(BF16)
    pool.write(0, slots, kv[:, :rank], kv[:, rank:])  # the new tokens' KV included
    t = bs * q_len
    new = torch.cat([slots[sum(seq_lens[: b + 1]) - q_len : sum(seq_lens[: b + 1])]
                     for b in range(bs)])  # fmt: skip
    backend = get_backend_class("flashmla")(model_config(*DIMS), page, kv_dtype, dev, 8, 1024,
                                            max_q_len=q_len)  # fmt: skip
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if q_len == 1 else ForwardMode.VERIFY,
        bs=bs, num_tokens=t, q_len=q_len, max_seq_len=max(seq_lens),
        input_ids=torch.zeros(t, dtype=torch.long, device=dev),
        positions=torch.zeros(t, dtype=torch.long, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        cu_q_lens=torch.arange(0, t + 1, q_len, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev), slot_mapping=new,
        logits_indices=torch.zeros(0, dtype=torch.long, device=dev),
        kv_pool=pool, attn_backend=backend,
    )  # fmt: skip
    backend.prepare(batch)
    assert backend.joined_q_dtype(batch) == kv_dtype
    x = torch.randn(t, heads, 128, generator=gen, device=dev).to(BF16)  # q_nope, d_n = 128
    w_uk = (torch.randn(heads, 128, rank, generator=gen, device=dev) / 11).to(BF16)
    q_pe = torch.randn(t, heads, rope, generator=gen, device=dev).to(BF16)
    want = backend.forward(0, head_gemv(x, w_uk), q_pe, None, None, batch)
    q = torch.empty(t, heads, rank + rope, dtype=kv_dtype, device=dev)
    got = backend.forward_joined(0, head_gemv(x, w_uk, out=q, tail=q_pe), batch)
    assert got.shape == (t, heads, rank) and got.dtype == BF16
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
