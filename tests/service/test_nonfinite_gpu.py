"""On CUDA: the per-row finite flag costs no host sync, and a NaN row becomes a per-request
error through the real engine (issue 13). Run on the GPU host with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine
from mlaserve.sampling import Sampler, SamplingBatch
from mlaserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_finite_flag_is_computed_without_a_host_sync() -> None:
    vocab, device = 1000, torch.device("cuda")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5, logprobs=2)]  # fmt: skip
    batch = SamplingBatch.build(
        params=params, seeds=[1, 2, 3], steps=[0, 0, 0], prompt_ids=[[1]] * 3,
        output_ids=[[]] * 3, vocab_size=vocab, device=device,
    )  # fmt: skip
    logits = torch.randn(3, vocab, device=device)
    logits[1, 17] = float("nan")
    logits[2, 3] = float("inf")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ids, finite = torch.stack((out.token_ids, out.finite.to(torch.int64))).tolist()
    assert finite == [1, 0, 0] and 0 <= ids[0] < vocab


def test_nan_logits_fail_only_their_request_on_cuda(checkpoint) -> None:
    config = EngineConfig(model=str(checkpoint("v3_moe")), device="cuda", dtype="float32",
                          kv_cache_dtype="auto", max_model_len=128)  # fmt: skip
    engine = LLMEngine(config)
    weight = engine.runner.model.model.embed_tokens.weight
    with torch.no_grad():
        weight[7] = float("nan")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("clean", [1, 2, 3, 4], greedy)
    engine.add_request("poisoned", [1, 7, 3, 4], greedy)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["poisoned"].outputs[0].finish_reason == "error"
    assert finals["poisoned"].outputs[0].token_ids == []
    assert finals["clean"].outputs[0].finish_reason == "length"
    assert len(finals["clean"].outputs[0].token_ids) == 4
