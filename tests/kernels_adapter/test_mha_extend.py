"""The MHA form of EXTEND (`kernels_adapter/mha_extend.py`) against the latent form of the
reference backend: same pool, same inputs, the same attention computed two ways.

Latent form: q_latent_h = W_UK_h^T q_nope_h, o_h = W_UV_h^T (softmax(q . [c|k_pe]) c).
MHA form: K_h = [W_UK_h c | k_pe], V_h = W_UV_h c, o_h = softmax(q_h . K_h) V_h.
They are equal in exact arithmetic; in fp32 on CPU the bound is 1e-5 relative (max |err| /
max |ref| per sequence). Unused pages and slots are NaN, so a read outside the context fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlaserve.kernels_adapter.mha_extend import (
    causal_varlen_attention,
    extend_layout,
    reference_extend_mha,
    up_project,
)
from tests.kernels_adapter.attention_oracle import dense_mla_attention
from tests.kernels_adapter.extend_case import (
    HEADS,
    NOPE,
    RANK,
    ROPE,
    V_DIM,
    Case,
    clone_pool,
    extend_setup,
)

CASES = [
    Case([0, 0, 0], [5, 1, 17], 4),  # ragged first chunks
    Case([7, 0, 30], [3, 9, 1], 8),  # chunked prefill over cached prefixes, mixed with a decode
    Case([16, 33], [16, 2], 16),  # prefix ending exactly on a page boundary
    Case([12, 5, 20], [4, 1, 6], 8, torch.float8_e4m3fn),  # fp8 pool (scale 0.5)
]


def run_mha_vs_latent(case: Case, device: torch.device) -> float:
    mc, backend, batch, new_rows, cu = extend_setup(case, device)
    num_tokens = cu[-1]
    q = torch.randn(num_tokens, HEADS, NOPE + ROPE, device=device)
    w_uk = torch.randn(HEADS, NOPE, RANK, device=device) / RANK**0.5
    w_uv = torch.randn(HEADS, RANK, V_DIM, device=device) / RANK**0.5
    kv_c, k_pe = new_rows[:, :RANK], new_rows[:, RANK:]

    latent_batch = dataclasses.replace(batch, kv_pool=clone_pool(batch.kv_pool))
    backend.prepare(latent_batch)
    q_latent = torch.einsum("thn,hnr->thr", q[..., :NOPE], w_uk)
    o_latent = backend.forward(0, q_latent, q[..., NOPE:], kv_c, k_pe, latent_batch)
    expected = torch.einsum("thr,hrv->thv", o_latent, w_uv)

    got = reference_extend_mha(0, q, kv_c, k_pe, w_uk, w_uv, batch, mc.softmax_scale)
    assert got.shape == (num_tokens, HEADS, V_DIM) and got.dtype == q.dtype
    assert torch.isfinite(got).all()
    # Both paths wrote the same new rows.
    assert torch.equal(
        batch.kv_pool.kv_buffers[0].view(torch.uint8),
        latent_batch.kv_pool.kv_buffers[0].view(torch.uint8),
    )
    worst = 0.0
    for b in range(len(case.q_lens)):
        ref, out = expected[cu[b] : cu[b + 1]], got[cu[b] : cu[b + 1]]
        err = float((out - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, f"seq {b}: relative error {err:.2e}"
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.prefix_lens}+{c.q_lens}-{c.kv_dtype}")
def test_mha_form_equals_latent_form(case: Case) -> None:
    run_mha_vs_latent(case, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.prefix_lens}+{c.q_lens}-{c.kv_dtype}")
def test_mha_form_equals_latent_form_cuda(case: Case) -> None:
    run_mha_vs_latent(case, torch.device("cuda"))


def test_layout_gathers_only_context_slots() -> None:
    case = CASES[1]
    _, _, batch, _, cu = extend_setup(case, torch.device("cpu"))
    layout = extend_layout(batch)
    assert layout.q_lens == (3, 9, 1) and layout.kv_lens == (10, 9, 31)
    assert layout.cu_kv.tolist() == [0, 10, 19, 50] and layout.cu_kv.dtype == torch.int32
    assert layout.cu_q.tolist() == cu and layout.kv_lens_dev.tolist() == [10, 9, 31]
    page = case.page_size
    tables = batch.block_tables.tolist()
    expected = [
        tables[b][t // page] * page + t % page
        for b, n in enumerate(layout.kv_lens)
        for t in range(n)
    ]
    assert layout.context_slots.tolist() == expected
    # The new tokens are the last q_len context rows of each sequence.
    new = batch.slot_mapping.tolist()
    for b in range(layout.bs):
        ctx = expected[layout.cu_kv[b] : layout.cu_kv[b + 1]]
        assert ctx[-layout.q_lens[b] :] == new[cu[b] : cu[b + 1]]


def test_causal_varlen_attention_matches_dense_oracle() -> None:
    """Single-head sanity check of the mask against the repo's float64 oracle: with one head
    whose K is the latent itself and V its first `rank` values, MHA form = latent form."""
    torch.manual_seed(1)
    case = CASES[1]
    _, _, batch, _, cu = extend_setup(case, torch.device("cpu"))
    layout = extend_layout(batch)
    kv = torch.randn(layout.num_kv_tokens, RANK + ROPE)
    q = torch.randn(cu[-1], 1, RANK + ROPE)
    out = causal_varlen_attention(q, kv[:, None, :], kv[:, None, :RANK], layout, 0.125)
    k0 = 0
    for b in range(layout.bs):
        ref = dense_mla_attention(
            q[cu[b] : cu[b + 1]], kv[k0 : k0 + layout.kv_lens[b]], RANK, 0.125
        )
        torch.testing.assert_close(out[cu[b] : cu[b + 1]].double(), ref, rtol=1e-5, atol=1e-6)
        k0 += layout.kv_lens[b]


def test_layout_needs_host_lengths() -> None:
    _, _, batch, _, _ = extend_setup(CASES[0], torch.device("cpu"))
    with pytest.raises(ValueError, match="seq_lens_host"):
        extend_layout(dataclasses.replace(batch, seq_lens_host=None))
    with pytest.raises(ValueError, match="sums to"):
        extend_layout(dataclasses.replace(batch, q_lens_host=[5, 1, 16], seq_lens_host=[5, 1, 17]))


def test_up_project_of_kv_b_views_is_one_gemm_with_the_same_values() -> None:
    """w_uk / w_uv split from one kv_b_proj weight (as the model does) take the single-GEMM
    path; separate tensors take the per-projection einsums. Same K and V either way."""
    torch.manual_seed(2)
    kv_b = torch.randn(HEADS * (NOPE + V_DIM), RANK)
    w = kv_b.view(HEADS, NOPE + V_DIM, RANK)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:].transpose(1, 2)
    latent = torch.randn(37, RANK + ROPE)
    k, v = up_project(latent, w_uk, w_uv)
    k_sep, v_sep = up_project(latent, w_uk.clone(), w_uv.clone())
    torch.testing.assert_close(k, k_sep, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, v_sep, rtol=1e-5, atol=1e-5)
    assert k.shape == (37, HEADS, NOPE + ROPE) and v.shape == (37, HEADS, V_DIM)
    assert torch.equal(k[..., NOPE:], latent[:, None, RANK:].expand(-1, HEADS, -1))


def test_layout_all_fresh() -> None:
    fresh = extend_layout(extend_setup(CASES[0], torch.device("cpu"))[2])
    chunked = extend_layout(extend_setup(CASES[1], torch.device("cpu"))[2])
    assert fresh.all_fresh and not chunked.all_fresh


def test_cudnn_fresh_takes_only_fresh_batches_without_one_token_prompts() -> None:
    """Which EXTEND batches `cudnn_fresh.py` takes (the rest go to FA2): no cached prefix (its
    causal mask is top-left), at most MAX_SEQS sequences, no 1-token prompt (cuDNN refuses a
    key length of 1), a half-precision query. On CPU it is unavailable, so nothing is taken."""
    from mlaserve.kernels_adapter.cudnn_fresh import CudnnFreshAttention

    cpu = torch.device("cpu")
    fresh = CudnnFreshAttention(cpu)
    layout = extend_layout(extend_setup(Case([0, 0], [5, 17], 4), cpu)[2])
    assert not fresh.available and not fresh.takes(layout, torch.bfloat16)
    fresh.available = True  # as the probe finds it on an H100
    assert fresh.takes(layout, torch.bfloat16) and not fresh.takes(layout, torch.float32)
    assert not fresh.takes(extend_layout(extend_setup(CASES[0], cpu)[2]), torch.bfloat16)  # a 1
    assert not fresh.takes(extend_layout(extend_setup(CASES[1], cpu)[2]), torch.bfloat16)  # prefix
