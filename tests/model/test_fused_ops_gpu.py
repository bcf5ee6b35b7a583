"""The model on CUDA with the fused kernels (`mlaserve/ops/`, the default there) vs the same
checkpoint with them switched off (`MLASERVE_FUSED_OPS=0`: the torch reference path), bf16
weights, both KV dtypes, prefill then teacher-forced decode.

Bounds (not yet measured on the H100; the fused kernels round like the torch code except for
summation order, so the two paths should sit far inside bf16 noise): median token_rel <= 0.02
and, on the dense variant (no routing flips), max <= 0.04, i.e. half the bf16-vs-transformers
bounds of test_parity.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mlaserve.model import load_model
from tests.checkpoints import VARIANTS

from .paged import PagedCache
from .parity_setup import Setup, run_prefill_then_decode, token_rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MEDIAN_BOUND, DENSE_MAX_BOUND = 0.02, 0.04


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_model_matches_unfused(
    variant: str,
    kv_dtype: torch.dtype,
    setups: Callable[[str], Setup],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    s = setups(variant)
    logits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MLASERVE_FUSED_OPS", flag)
        model = load_model(s.config, s.path, dtype=torch.bfloat16, device="cuda")
        norm = model.model.layers[0].input_layernorm
        assert norm.fused == (flag == "1")
        cache = PagedCache(s.config, kv_dtype=kv_dtype, device="cuda")
        assert (cache.pool._fused_write is not None) == (flag == "1")
        logits[flag] = torch.cat(run_prefill_then_decode(s, model, cache, q_len=1)[0])
    errors = token_rel(logits["1"], logits["0"].float().cpu())
    assert errors.isfinite().all()
    assert errors.median() <= MEDIAN_BOUND, f"median token_rel {errors.median():.3e}"
    if variant == "v3_dense":
        assert errors.max() <= DENSE_MAX_BOUND, f"max token_rel {errors.max():.3e}"
