"""The model's MHA-form EXTEND branch (`MLAAttention` with a `mha_extend` backend), end to end on
CPU: chunked prefill through `kernels_adapter/mha_extend.py` must match transformers as tightly
as the latent form does (fp32, max_rel <= 1e-4), so the layer hands the helper the right
W_UK / W_UV views and the Blackwell backends' prefill path has a CPU oracle in the real model.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.model import load_model
from tests.kernels_adapter.reference_mha import ReferenceMHA

from .paged import PagedCache
from .parity_setup import FP32_MAX_REL, Setup, max_rel


@pytest.mark.parametrize("variant", ["v3_moe", "v2_greedy"])  # V3 and V2 (interleaved RoPE)
def test_chunked_prefill_in_mha_form_matches_transformers(
    variant: str,
    setups: Callable[[str], Setup],
) -> None:
    s = setups(variant)
    model = load_model(s.config, s.path)
    cache = PagedCache(s.config)
    cache.backend = ReferenceMHA(s.config, cache.page_size, torch.float32, cache.device, 64, 256)
    splits = {1: [13, 1, 26], 3: [5, 17, 9], 6: [1, 30, 8]}  # seq -> chunk lengths per step
    done = dict.fromkeys(splits, 0)
    for step in range(3):
        chunks = [(i, s.seqs[i][done[i] : done[i] + lens[step]]) for i, lens in splits.items()]
        batch = cache.batch(chunks, ForwardMode.EXTEND)
        batch.seq_lens_host = batch.seq_lens.tolist()  # what the engine's EXTEND batches carry
        batch.q_lens_host = [len(ids) for _, ids in chunks]
        logits = model.compute_logits(model(batch)[batch.logits_indices])
        for (i, ids), out in zip(chunks, logits.split([len(c) for _, c in chunks]), strict=True):
            ref = s.ref[i][done[i] : done[i] + len(ids)]
            err = max_rel(out, ref)
            assert err <= FP32_MAX_REL, f"seq {i} chunk {step}: max_rel {err:.2e}"
            done[i] += len(ids)
