"""Fused RMSNorm and residual-add + RMSNorm vs `RMSNorm`'s torch path. Tolerance: the residual
sum is exact (one rounding, as torch's); the normed output within one bf16 rounding
(rtol 1.6e-2, atol 1e-2: the kernel's sum of squares is ordered differently than torch's mean,
which can move a value across a rounding boundary)."""

from __future__ import annotations

import pytest
import torch

from mlaserve.model.layers.norm import RMSNorm
from tests.ops.cases import GPU_TOKENS, cpu_case, gpu_case, model_dtype

CASES = [gpu_case(t, n) for t in GPU_TOKENS for n in (2048, 512, 1536)] + [
    cpu_case(3, 48),
    cpu_case(1, 40),
]
TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def _norms(hidden: int, device: str, monkeypatch) -> tuple[RMSNorm, RMSNorm]:
    pair = []
    for flag in ("1", "0"):
        monkeypatch.setenv("MLASERVE_FUSED_OPS", flag)
        with torch.device(device):
            norm = RMSNorm(hidden, 1e-6, params_dtype=model_dtype(device))
        norm.weight.normal_(1.0, 0.3)
        pair.append(norm)
    pair[1].weight.copy_(pair[0].weight)
    assert pair[0].fused and not pair[1].fused
    return pair[0], pair[1]


@pytest.mark.parametrize("num_tokens,hidden,device", CASES)
def test_rms_norm_matches_reference(num_tokens, hidden, device, monkeypatch):
    fused, ref = _norms(hidden, device, monkeypatch)
    g = torch.Generator(device=device).manual_seed(hidden + num_tokens)
    x = (torch.randn(num_tokens, hidden, generator=g, device=device) * 3).to(model_dtype(device))
    torch.testing.assert_close(fused(x), ref(x), **TOL)


@pytest.mark.parametrize("num_tokens,hidden,device", CASES)
def test_add_rms_norm_matches_reference(num_tokens, hidden, device, monkeypatch):
    fused, ref = _norms(hidden, device, monkeypatch)
    g = torch.Generator(device=device).manual_seed(hidden * num_tokens)
    x = (torch.randn(num_tokens, hidden, generator=g, device=device) * 3).to(model_dtype(device))
    residual = (torch.randn(num_tokens, hidden, generator=g, device=device) * 10).to(
        model_dtype(device)
    )
    out, new_residual = fused.forward_with_residual(x, residual)
    want_out, want_residual = ref.forward_with_residual(x, residual)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, **TOL)
    assert not torch.equal(residual, new_residual)  # inputs left alone, a new sum returned


@pytest.mark.parametrize("slots", [7, 1])
@pytest.mark.parametrize("num_tokens,hidden,device", CASES)
def test_partials_norm_equals_combine_then_add_norm(num_tokens, hidden, device, slots, monkeypatch):
    """An MoE layer's uncombined output through the fused norm: the same bits as the MoE
    combine kernel followed by the fused add + RMSNorm (what it replaces), and within the
    tolerance of the torch reference on the combined tensor. One slot too: an all-reduced
    tensor-parallel sum, which must be rounded before the residual add as well."""
    from mlaserve.ops.moe_partials import MoePartials

    fused, ref = _norms(hidden, device, monkeypatch)
    g = torch.Generator(device=device).manual_seed(hidden + 3 * num_tokens)
    dtype = model_dtype(device)
    parts = torch.randn(num_tokens, slots, hidden, generator=g, device=device) * 0.5
    parts = MoePartials(parts, dtype)
    residual = (torch.randn(num_tokens, hidden, generator=g, device=device) * 3).to(dtype)
    out, res = fused.forward_with_residual(parts, residual)
    combined = parts.total()  # the combine kernel
    want_out, want_res = fused.forward_with_residual(combined, residual)
    assert torch.equal(res, want_res) and torch.equal(out, want_out)
    ref_out, ref_res = ref.forward_with_residual(combined, residual)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **TOL)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("num_tokens,hidden,device", CASES)
def test_sorted_rows_norm_equals_combine_then_add_norm(
    num_tokens, hidden, device, shared, monkeypatch
):
    """The sorted MoE path's uncombined rows through the fused norm: the same bits as the sorted
    combine kernel followed by the fused add + RMSNorm (what it replaces), and within the
    tolerance of the torch reference on the combined tensor."""
    from mlaserve.ops.expert_sort import sort_by_expert
    from mlaserve.ops.moe_partials import SortedExpertRows

    fused, ref = _norms(hidden, device, monkeypatch)
    g = torch.Generator(device=device).manual_seed(hidden + 5 * num_tokens)
    dtype, top_k, experts = model_dtype(device), 6, 16
    ids = torch.rand(num_tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices
    order, _, pos, _ = sort_by_expert(ids.contiguous(), experts)
    rows = (torch.randn(num_tokens * top_k, hidden, generator=g, device=device) * 2).to(dtype)
    weights = torch.rand(num_tokens, top_k, generator=g, device=device)
    side = (torch.randn(num_tokens, hidden, generator=g, device=device)).to(dtype)
    out_rows = SortedExpertRows(rows, order, pos, weights, side if shared else None)
    residual = (torch.randn(num_tokens, hidden, generator=g, device=device) * 3).to(dtype)
    out, res = fused.forward_with_residual(out_rows, residual)
    combined = out_rows.total()  # the sorted combine kernel
    want_out, want_res = fused.forward_with_residual(combined, residual)
    assert torch.equal(res, want_res) and torch.equal(out, want_out)
    ref_out, ref_res = ref.forward_with_residual(combined, residual)
    torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, **TOL)


def test_sorted_rows_norm_names_a_mismatched_input(monkeypatch):
    pytest.importorskip("triton")
    from mlaserve.ops.rms_norm import add_sorted_rms_norm

    rows, residual = torch.zeros(12, 8), torch.zeros(2, 8)
    pos, weights = torch.zeros(12, dtype=torch.int32), torch.zeros(2, 6)
    with pytest.raises(ValueError, match="pos"):
        add_sorted_rms_norm(rows, pos.long(), weights, None, residual, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="shared"):
        add_sorted_rms_norm(rows, pos, weights, torch.zeros(3, 8), residual, torch.ones(8), 1e-6)
