"""FlashMLA (SM90 dense decode) against the float64 oracle over NaN-poisoned paged caches, the
same harness as the reference backend, at the kernel's shapes (576 = 512 + 64, page 64).

Metric: max |err| / max |ref| per sequence, q in bf16 as the model produces it. For the fp8
cache the kernel also takes an e4m3 query (cast unscaled, as vLLM/SGLang do); the oracle gets
that same rounded query, so the bound measures the kernel itself. Measured on an H100,
2026-11-22 (fixed seeds): bf16 cache 2.5e-3 (q_len 1), 2.9e-3 (q_len 3) -> bound 1e-2; fp8 cache
3.4e-2 (q_len 1), 4.8e-2 (q_len 3) -> bound 8e-2 (the fp8 kernel also feeds the softmax
probabilities to its second GEMM in e4m3). Against the unrounded query the fp8 path's error was
5.6e-2 / 7.4e-2; the engine-level agreement test bounds its effect on tokens.
"""

from __future__ import annotations

import pytest
import torch

from mlaserve.kernels_adapter import BackendUnsupportedError, get_backend_class
from mlaserve.kernels_adapter.flashmla import flashmla_available
from tests.kernels_adapter.paged_case import Case, model_config, run_case

needs_hopper = pytest.mark.skipif(
    not flashmla_available(), reason="needs an SM90 GPU and sgl-flash-mla"
)

DIMS = (512, 64, 16)  # kv_lora_rank, qk_rope_head_dim, heads
TOLERANCE = {torch.bfloat16: 1e-2, torch.float8_e4m3fn: 8e-2}


def e4m3(q: torch.Tensor) -> torch.Tensor:
    return q.float().clamp(-448, 448).to(torch.float8_e4m3fn)


CASES = [
    Case([10, 3, 130, 1], [1, 1, 1, 1], 64, torch.bfloat16),  # decode, partial pages
    Case([100, 0, 63, 257], [3, 3, 3, 3], 64, torch.bfloat16),  # verify-shaped q_len=3
    Case([10, 3, 130, 1], [1, 1, 1, 1], 64, torch.float8_e4m3fn),
    Case([100, 7, 63, 257], [3, 3, 3, 3], 64, torch.float8_e4m3fn),
]
# Ragged EXTEND batches take the MHA form: tests/kernels_adapter/test_flashmla_extend.py.


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.q_lens}-{c.kv_dtype}")
def test_flashmla_matches_dense_oracle(case: Case) -> None:
    err = run_case(
        case,
        torch.device("cuda"),
        backend_name="flashmla",
        dims=DIMS,
        q_dtype=torch.bfloat16,
        tolerance=TOLERANCE[case.kv_dtype],
        q_seen_by_kernel=e4m3 if case.kv_dtype == torch.float8_e4m3fn else None,
    )
    print(f"flashmla {case.q_lens} {case.kv_dtype}: max relative error {err:.2e}")


@pytest.mark.gpu
def test_flashmla_rejects_what_it_cannot_run() -> None:
    cls = get_backend_class("flashmla")
    mc = model_config(*DIMS)
    with pytest.raises(BackendUnsupportedError, match="CUDA"):
        cls.check_supported(mc, 64, torch.bfloat16, torch.device("cpu"))
    if torch.cuda.is_available():
        with pytest.raises(BackendUnsupportedError, match=r"page_size|SM90"):
            cls.check_supported(mc, 32, torch.bfloat16, torch.device("cuda"))
        with pytest.raises(BackendUnsupportedError, match=r"kv_cache_dtype|SM90"):
            cls.check_supported(mc, 64, torch.float32, torch.device("cuda"))
        with pytest.raises(BackendUnsupportedError, match=r"512/64|SM90"):
            cls.check_supported(model_config(32, 16, 4), 64, torch.bfloat16, torch.device("cuda"))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.q_lens}-{c.kv_dtype}")
def test_small_batches_through_the_triton_kernel_match_the_oracle(case: Case, monkeypatch) -> None:
    """With `MLASERVE_MLA_DECODE_ROWS` covering the batch, the backend attends through
    `ops/mla_decode.py`, with FlashMLA's bounds. Measured on an H100 (2026-11-23): 2.45e-3 (bf16
    cache), 3.39e-2 (fp8 cache, q_len 1), the same as FlashMLA's on these cases although this
    kernel keeps the query and the probabilities in bf16; on a cache built from known e4m3
    values the kernel's fp8 error is 3.2e-3 (tests/ops/test_mla_decode.py), so the fp8 figure
    here is this harness's, not found yet."""
    monkeypatch.setenv("MLASERVE_MLA_DECODE_ROWS", str(sum(case.q_lens)))
    err = run_case(
        case,
        torch.device("cuda"),
        backend_name="flashmla",
        dims=DIMS,
        q_dtype=torch.bfloat16,
        tolerance=TOLERANCE[case.kv_dtype],
    )
    print(f"flashmla small-batch path {case.q_lens} {case.kv_dtype}: max relative error {err:.2e}")
