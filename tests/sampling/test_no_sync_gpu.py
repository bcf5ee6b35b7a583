"""A steady-state sampling step never waits for the GPU: building the batch from SamplingSlots,
sampling, counting the sampled tokens and speculative acceptance all run under
`torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import pytest
import torch

from mlaserve.sampling import Sampler, SamplingSlots
from mlaserve.sampling.rejection import accept_draft
from mlaserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=1),
    SamplingParams(temperature=1.0, top_p=0.7, seed=2, logprobs=3),
    SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, seed=3),
    SamplingParams(temperature=0, min_tokens=50, max_tokens=100, stop_token_ids=[5]),  # bans
]


def test_sampling_step_has_no_host_sync() -> None:
    dev = torch.device("cuda")
    vocab, k = 129280, 3
    slots = SamplingSlots(8, vocab, dev, eos_token_ids=[1])
    for slot, p in enumerate(PARAMS):
        slots.admit(slot, p, seed=slot, prompt_ids=[3, 4, 5], output_ids=[6])
    rows = list(range(len(PARAMS)))
    rows_t = torch.tensor(rows, device=dev)
    logits = torch.randn(len(rows), vocab, device=dev)
    vlogits = torch.randn(len(rows), k + 1, vocab, device=dev)
    draft = vlogits[:, :k].argmax(-1)
    sampler = Sampler()

    def step(n: int) -> None:
        batch = slots.batch(rows, [n] * len(rows))
        out = sampler(logits, batch)
        slots.record(rows_t, out.token_ids)
        verify = slots.verify_batch(rows, [n + 1] * len(rows), k)
        acc = accept_draft(vlogits, draft, verify)
        assert verify.slots is not None
        slots.record(verify.slots[:: k + 1], acc.out_tokens, acc.accept_len)

    step(1)  # warm-up: kernel loading, Triton compilation, pinned host blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for n in range(2, 6):
            step(n)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
