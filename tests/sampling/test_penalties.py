from __future__ import annotations

import random

import torch

from mlaserve.sampling import Sampler, SamplingBatch
from mlaserve.sampling.penalties import apply_penalties
from mlaserve.sampling_params import SamplingParams
from tests.sampling.sampling_oracle import naive_penalties


def random_case(seed: int, rows: int, vocab: int):
    rng = random.Random(seed)
    params = [
        SamplingParams(
            repetition_penalty=rng.choice([1.0, 1.0, 0.8, 1.3, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.0, 0.5, -1.0, 2.0]),
            presence_penalty=rng.choice([0.0, 0.0, 0.7, -0.3]),
        )
        for _ in range(rows)
    ]
    prompt = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(rows)]
    output = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(rows)]
    return params, prompt, output


def test_penalties_match_naive_per_row(device: torch.device) -> None:
    vocab, rows = 50, 12
    for seed in range(5):
        params, prompt, output = random_case(seed, rows, vocab)
        torch.manual_seed(seed)
        logits = torch.randn(rows, vocab, device=device) * 3
        batch = SamplingBatch.build(
            params, [0] * rows, [len(o) for o in output], prompt, output, vocab, device
        )
        got = apply_penalties(logits, batch)
        want = naive_penalties(logits.cpu(), params, prompt, output)
        torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-6)


def test_greedy_sampling_uses_penalised_logits(device: torch.device) -> None:
    vocab, rows = 50, 12
    params, prompt, output = random_case(7, rows, vocab)
    params = [p.replace(temperature=0) for p in params]
    torch.manual_seed(7)
    logits = torch.randn(rows, vocab, device=device) * 3
    batch = SamplingBatch.build(params, [0] * rows, [0] * rows, prompt, output, vocab, device)
    out = Sampler()(logits, batch)
    want = naive_penalties(logits.cpu(), params, prompt, output).argmax(-1)
    assert out.token_ids.cpu().tolist() == want.tolist()


def test_no_penalty_state_without_penalties(device: torch.device) -> None:
    batch = SamplingBatch.build(
        [SamplingParams()] * 2, [0, 1], [0, 0], [[1], [2]], [[3], []], 10, device
    )
    assert not batch.use_penalties
    assert batch.prompt_mask is None and batch.output_counts is None


def test_only_penalised_rows_are_scattered(device: torch.device) -> None:
    params = [SamplingParams(frequency_penalty=1.0), SamplingParams()]
    batch = SamplingBatch.build(params, [0, 0], [0, 0], [[1], [2]], [[3, 3], [4]], 10, device)
    assert batch.output_counts is not None and batch.prompt_mask is None
    assert batch.output_counts[0, 3].item() == 2 and batch.output_counts[1].sum().item() == 0
