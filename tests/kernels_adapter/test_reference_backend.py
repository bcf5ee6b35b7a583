"""The reference backend against a dense float64 oracle, over NaN-poisoned paged caches.

Tolerances: fp32 cache 1e-5 relative (max |err| / max |ref|); bf16 and fp8 caches are compared
against the oracle run on the *same rounded* KV, so the remaining error is the backend's own fp32
arithmetic and must also stay under 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels_adapter.paged_case import Case, run_case

CASES = [
    Case([0, 0, 0], [5, 1, 17], 4, torch.float32),  # ragged prefill
    Case([7, 0, 30], [3, 9, 1], 8, torch.float32),  # extend over cached prefixes, mixed decode
    Case([10, 3, 63, 1], [1, 1, 1, 1], 16, torch.float32),  # decode
    Case([10, 3, 40], [3, 3, 3], 4, torch.float32),  # uniform q_len=3 (verify shape)
    Case([12, 5], [4, 2], 8, torch.bfloat16),
    Case([12, 5, 20], [1, 1, 1], 8, torch.float8_e4m3fn),
    Case([9, 33], [3, 3], 16, torch.float8_e4m3fn),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.q_lens}-{c.page_size}-{c.kv_dtype}")
def test_reference_matches_dense_oracle(case: Case) -> None:
    run_case(case, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.q_lens}-{c.page_size}-{c.kv_dtype}")
def test_reference_matches_dense_oracle_cuda(case: Case) -> None:
    run_case(case, torch.device("cuda"))
