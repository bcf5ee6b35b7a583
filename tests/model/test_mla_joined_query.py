"""`MLAAttention`'s joined-query path on CPU (fused ops under Triton's interpreter, fp16: see
tests/ops/cases.py `model_dtype`): with a backend that takes joined queries, decode-sized uniform
batches hand it the query W_UK's GEMV wrote whole (`head_gemv(..., tail=q_pe)`), and the layer's
output has the bits of the unjoined path (GEMV, then the backend's own concatenation). Larger
and EXTEND batches keep the unjoined path. FlashMLA's own choice and the fp8 query are covered
on the GPU (tests/kernels_adapter/test_joined_query.py, tests/graph_runner/test_graphs_gpu.py).
With a backend that takes q_latent and q_pe apart, the same batches run the one-launch decode
prologue (`ops/mla_decode_prologue.py`)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.kernels_adapter.reference import ReferenceBackend
from mlaserve.model.layers.rotary import RotaryEmbedding
from mlaserve.ops import triton_available
from tests.kernels_adapter.paged_case import model_config

from .paged import PagedCache

F16 = torch.float16


class JoinedReference(ReferenceBackend):
    """The reference backend taking joined queries in the model dtype, for uniform batches."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.joined_calls = 0

    def joined_q_dtype(self, batch):
        return F16 if batch.mode.is_uniform else None

    def forward_joined(self, layer_id, q, batch):
        assert q.is_contiguous() and q.dtype == F16
        self.joined_calls += 1
        r = self.kv_lora_rank
        return self.forward(layer_id, q[..., :r], q[..., r:], None, None, batch)


def _fused_layer(config, seed: int):
    """An fp16 MLAAttention with random weights (the latent norm's around 1), loaded and warmed
    up; built with `MLASERVE_FUSED_OPS=1` set."""
    from mlaserve.model.layers.mla import MLAAttention

    layer = MLAAttention(config, 0, params_dtype=F16)
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    layer.kv_a_layernorm.weight.data.add_(1.0)
    layer.process_weights_after_loading()
    for task in layer.warm_up_tasks(F16):
        task()
    return layer


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests cover it compiled")
@pytest.mark.skipif(not triton_available(), reason="needs triton (TRITON_INTERPRET=1)")
def test_joined_query_layer_matches_the_unjoined_path(monkeypatch) -> None:
    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    config = model_config()  # 4 heads, r 32, d_r 16, d_n 16, hidden 32; q_proj, no q_lora
    layer = _fused_layer(config, seed=0)
    assert layer._head_gemv is not None
    rope = RotaryEmbedding(config)
    caches = {}
    for name, cls in (("joined", JoinedReference), ("plain", ReferenceBackend)):
        cache = PagedCache(config, kv_dtype=F16, max_model_len=64)
        cache.backend = cls(config, cache.page_size, F16, cache.device, 64, 64, max_q_len=3)
        caches[name] = cache

    def step(chunks, mode):
        outs = {}
        for name, cache in caches.items():
            batch = cache.batch(chunks, mode)
            x = torch.randn(batch.num_tokens, 32, generator=torch.Generator().manual_seed(7))
            cos, sin = rope(batch.positions)
            outs[name] = layer(x.to(F16), cos, sin, batch)
        assert torch.equal(outs["joined"], outs["plain"]), mode
        assert outs["joined"].isfinite().all()

    step([(0, [1] * 5), (1, [2] * 7)], ForwardMode.EXTEND)  # prefixes, unjoined
    assert caches["joined"].backend.joined_calls == 0
    step([(0, [3]), (1, [4])], ForwardMode.DECODE)
    assert caches["joined"].backend.joined_calls == 1
    step([(0, [5] * 3), (1, [6] * 3)], ForwardMode.VERIFY)  # 6 rows: still the GEMV's
    assert caches["joined"].backend.joined_calls == 2
    step([(i, [7] * 3) for i in range(2, 5)], ForwardMode.VERIFY)  # 9 rows: the bmm path
    assert caches["joined"].backend.joined_calls == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests cover it compiled")
@pytest.mark.skipif(not triton_available(), reason="needs triton (TRITON_INTERPRET=1)")
def test_decode_prologue_is_one_launch_with_the_two_kernels_bits(monkeypatch) -> None:
    """Where attention takes q_latent and q_pe apart (the reference backend here, FlashMLA at
    <= 2 rows), decode-sized batches run norm, RoPEs, KV write and W_UK as one launch
    (`mla_decode_prologue`), with the output bits of the two kernels run one after the other."""
    from mlaserve.ops.head_gemv import head_gemv
    from mlaserve.ops.mla_norm_rope import mla_norm_rope

    monkeypatch.setenv("MLASERVE_FUSED_OPS", "1")
    config = model_config()
    layer = _fused_layer(config, seed=1)
    fused, calls = layer._prologue, []

    def two_kernels(kv_c, k_pe, q_nope, q_pe, weight, eps, cos, sin, inter, w_uk, *cache, joined):
        assert joined is None  # the reference backend takes q_latent and q_pe apart
        _, _, roped = mla_norm_rope(kv_c, k_pe, q_pe, weight, eps, cos, sin, inter, *cache)
        return head_gemv(q_nope, w_uk), roped

    def counted(*args, joined):
        calls.append(args[0].shape[0])
        return fused(*args, joined=joined)

    rope = RotaryEmbedding(config)
    outs = {}
    for name, prologue in (("fused", counted), ("apart", two_kernels)):
        layer._prologue = prologue
        cache = PagedCache(config, kv_dtype=F16, max_model_len=64)
        cache.backend = ReferenceBackend(
            config, cache.page_size, F16, cache.device, 64, 64, max_q_len=3
        )
        for chunks, mode in (
            ([(0, [1] * 5), (1, [2] * 7)], ForwardMode.EXTEND),
            ([(0, [3]), (1, [4])], ForwardMode.DECODE),
            ([(0, [5] * 3), (1, [6] * 3)], ForwardMode.VERIFY),
        ):
            batch = cache.batch(chunks, mode)
            x = torch.randn(batch.num_tokens, 32, generator=torch.Generator().manual_seed(9))
            cos, sin = rope(batch.positions)
            outs[name, mode] = layer(x.to(F16), cos, sin, batch)
    assert calls == [2, 6]  # the decode and verify batches; EXTEND keeps its own path
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.VERIFY):
        assert torch.equal(outs["fused", mode], outs["apart", mode]), mode
        assert outs["fused", mode].isfinite().all()
