"""FlashMLA (SM90 dense decode) against the float64 oracle over NaN-poisoned paged caches, the
same harness as the reference backend, at the kernel's shapes (576 = 512 + 64, page 64).

Tolerances (max |err| / max |ref| per sequence, q in bf16 as the model produces it):
bf16 cache 2e-2; fp8 cache 6e-2 (q is also cast to e4m3 for the fp8 kernel). The errors measured
on an H100 are printed by the test and recorded in the issue notes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mlaserve.kernels_adapter import BackendUnsupportedError, get_backend_class
from tests.kernels_adapter.test_reference_backend import Case, model_config, run_case


def _hopper_with_flash_mla() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() == (9, 0)
        and importlib.util.find_spec("flash_mla") is not None
    )


needs_hopper = pytest.mark.skipif(
    not _hopper_with_flash_mla(), reason="needs an SM90 GPU and sgl-flash-mla"
)

DIMS = (512, 64, 16)  # kv_lora_rank, qk_rope_head_dim, heads
TOLERANCE = {torch.bfloat16: 2e-2, torch.float8_e4m3fn: 6e-2}
CASES = [
    Case([10, 3, 130, 1], [1, 1, 1, 1], 64, torch.bfloat16),  # decode, partial pages
    Case([100, 0, 63, 257], [3, 3, 3, 3], 64, torch.bfloat16),  # verify-shaped q_len=3
    Case([10, 3, 130, 1], [1, 1, 1, 1], 64, torch.float8_e4m3fn),
    Case([100, 7, 63, 257], [3, 3, 3, 3], 64, torch.float8_e4m3fn),
    Case([5, 60, 0], [2, 9, 33], 64, torch.bfloat16),  # ragged EXTEND: the reference path
]


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
