from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlaserve.sampling import Sampler, SamplingBatch
from mlaserve.sampling_params import SamplingParams
from tests.sampling.sampling_oracle import chi_square_critical, reference_probs

sampler = Sampler()


def make_batch(
    params: list[SamplingParams],
    vocab: int,
    device: torch.device,
    seeds: list[int] | None = None,
    steps: list[int] | None = None,
    eos: tuple[int, ...] = (),
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds=seeds if seeds is not None else [p.seed or 0 for p in params],
        steps=steps if steps is not None else [0] * n,
        prompt_ids=prompt if prompt is not None else [[] for _ in params],
        output_ids=output if output is not None else [[] for _ in params],
        vocab_size=vocab,
        device=device,
        eos_token_ids=eos,
    )


# ---------------------------------------------------------------- greedy


def test_all_greedy_is_argmax(device: torch.device) -> None:
    logits = torch.randn(16, 1000, device=device, generator=None) * 3
    batch = make_batch([SamplingParams(temperature=0)] * 16, 1000, device)
    assert batch.all_greedy
    out = sampler(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.token_ids.device.type == device.type
    assert out.top_ids is None and out.top_logprobs is None
    assert out.logprobs is None and out.ranks is None  # nobody asked
    with_ranks = sampler(
        logits, make_batch([SamplingParams(temperature=0, logprobs=0)] * 16, 1000, device)
    )
    assert torch.equal(with_ranks.token_ids, out.token_ids)
    assert torch.equal(with_ranks.ranks, torch.ones(16, dtype=torch.int64, device=device))


class _AtenOps(TorchDispatchMode):
    """Records every aten op that runs (each one is at least one kernel on a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.big: list[str] = []  # ops with an argument of 1000+ elements (an [n, V] pass)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.ops.append(name)
        if any(isinstance(a, torch.Tensor) and a.numel() >= 1000 for a in args):
            self.big.append(name)
        return func(*args, **(kwargs or {}))


def test_all_greedy_costs_one_argmax(device: torch.device) -> None:
    logits = torch.randn(4, 1000, device=device)
    batch = make_batch(
        [SamplingParams(temperature=0, min_tokens=2)] * 4, 1000, device, steps=[2] * 4, eos=(5,)
    )
    with _AtenOps() as mode:
        out = sampler(logits, batch)
    # One pass over [n, V] (the argmax); the NaN/inf check reads only the n chosen logits
    # (a gather of n elements, then elementwise ops over n). On CUDA both are the two Triton
    # kernels of argmax_kernel.py: no aten op at all over [n, V].
    fused = device.type == "cuda"
    assert mode.big == ([] if fused else ["argmax", "gather"]), mode.ops
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.finite.all()
    nan = logits.clone()
    nan[2, 17] = float("nan")
    assert sampler(nan, batch).finite.tolist() == [True, True, False, True]
    # Asking for logprobs, or a row still below min_tokens, adds work only then.
    logprobs = make_batch([SamplingParams(temperature=0, logprobs=0)] * 4, 1000, device)
    banned = make_batch(
        [SamplingParams(temperature=0, min_tokens=3)] * 4, 1000, device, steps=[2] * 4, eos=(5,)
    )
    for busier in (logprobs, banned):
        with _AtenOps() as mode:
            sampler(logits, busier)
        # logprobs keep the fused argmax on CUDA; the ban adjusts the logits: torch's argmax
        assert ("argmax" in mode.ops) == (busier is banned or not fused) and len(mode.ops) > 1


def test_mixed_greedy_and_sampled(device: torch.device) -> None:
    torch.manual_seed(0)
    vocab = 400
    logits = torch.randn(8, vocab, device=device) * 2
    params = [
        SamplingParams(temperature=0.0, top_k=3)
        if i % 2 == 0
        else SamplingParams(seed=i, top_p=0.9)
        for i in range(8)
    ]
    out = sampler(logits, make_batch(params, vocab, device))
    for i, p in enumerate(params):
        if p.is_greedy:
            assert out.token_ids[i].item() == logits[i].argmax().item()
        else:
            alone = sampler(logits[i : i + 1], make_batch([p], vocab, device))
            assert out.token_ids[i].item() == alone.token_ids.item()


# ---------------------------------------------------------------- filters


def test_filters_never_pick_outside_allowed_set(device: torch.device) -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    vocab, rows = 200, 64
    for trial in range(10):
        logits = torch.randn(rows, vocab, device=device) * rng.choice([1.0, 3.0, 6.0])
        params = [
            SamplingParams(
                temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
                top_k=rng.choice([0, 1, 2, 5, 50]),
                top_p=rng.choice([1.0, 0.9, 0.5, 0.1]),
                min_p=rng.choice([0.0, 0.05, 0.3]),
                seed=rng.randrange(2**32),
            )
            for _ in range(rows)
        ]
        out = sampler(logits, make_batch(params, vocab, device, steps=[trial] * rows))
        for i, p in enumerate(params):
            probs = reference_probs(logits[i].cpu(), p)
            token = out.token_ids[i].item()
            # > 0 in float64; 1e-6 absorbs float32-vs-float64 rounding at a filter's border.
            assert probs[token] > 0 or _near_border(logits[i].cpu(), p, token), (i, p, token)


def _near_border(logits: torch.Tensor, p: SamplingParams, token: int) -> bool:
    loose = p.replace(top_p=min(1.0, p.top_p + 1e-6), min_p=max(0.0, p.min_p - 1e-6))
    return reference_probs(logits, loose)[token].item() > 0


DISTRIBUTION_CASES = {
    "t1": SamplingParams(temperature=1.0),
    "t0.6": SamplingParams(temperature=0.6),
    "t1.7": SamplingParams(temperature=1.7),
    "topk3": SamplingParams(top_k=3),
    "topp0.7": SamplingParams(top_p=0.7),
    "minp0.15": SamplingParams(min_p=0.15),
    "all": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("vary", ["seed", "step"])
@pytest.mark.parametrize("params", DISTRIBUTION_CASES.values(), ids=DISTRIBUTION_CASES.keys())
def test_sample_distribution_matches_reference(
    params: SamplingParams, vary: str, device: torch.device
) -> None:
    """20000 draws of one fixed distribution over 8 tokens, by varying the seed (one row per
    seed) or the step (one seed, one row per step). Chi-square at a 1e-6 false-alarm rate; the
    draws are deterministic, so this either always passes or always fails."""
    n, vocab = 20000, 8
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    expected = reference_probs(row, params) * n
    logits = row.to(device).expand(n, vocab).contiguous()
    if vary == "seed":
        seeds, steps = list(range(n)), [3] * n
    else:
        seeds, steps = [12345] * n, list(range(n))
    out = sampler(logits, make_batch([params] * n, vocab, device, seeds=seeds, steps=steps))
    counts = torch.bincount(out.token_ids.cpu(), minlength=vocab).double()
    allowed = expected > 0
    assert counts[~allowed].sum() == 0
    chi2 = (((counts - expected) ** 2)[allowed] / expected[allowed]).sum().item()
    df = int(allowed.sum()) - 1
    if df == 0:
        return
    assert chi2 < chi_square_critical(df), (chi2, counts.tolist(), expected.tolist())


# ---------------------------------------------------------------- seeds


def test_same_seed_and_step_give_same_token_whatever_the_batch(device: torch.device) -> None:
    torch.manual_seed(1)
    vocab = 500
    rng = random.Random(1)
    companions = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=7, seed=1),
        SamplingParams(top_p=0.5, seed=2),
        SamplingParams(min_p=0.1, repetition_penalty=1.3, frequency_penalty=0.4, seed=3),
    ]
    for seed in range(20):
        target = SamplingParams(temperature=0.9, seed=seed, logprobs=0)
        row = torch.randn(vocab, device=device)
        alone = sampler(row[None], make_batch([target], vocab, device, steps=[seed % 3]))
        position = rng.randrange(len(companions) + 1)
        params = [*companions[:position], target, *companions[position:]]
        logits = torch.randn(len(params), vocab, device=device)
        logits[position] = row
        steps = [rng.randrange(50) for _ in params]
        steps[position] = seed % 3
        prompt = [[1, 2, 3]] * len(params)
        together = sampler(
            logits,
            make_batch(params, vocab, device, steps=steps, prompt=prompt, output=prompt),
        )
        assert together.token_ids[position].item() == alone.token_ids.item()
        assert torch.allclose(together.logprobs[position], alone.logprobs[0])


def test_different_seeds_and_steps_give_different_tokens(device: torch.device) -> None:
    vocab, n = 1000, 200
    flat = torch.zeros(n, vocab, device=device)
    by_seed = sampler(flat, make_batch([SamplingParams()] * n, vocab, device, seeds=list(range(n))))
    by_step = sampler(
        flat, make_batch([SamplingParams()] * n, vocab, device, seeds=[7] * n, steps=list(range(n)))
    )
    # 200 uniform draws from 1000 tokens: ~181 distinct on average.
    assert len(set(by_seed.token_ids.tolist())) > 150
    assert len(set(by_step.token_ids.tolist())) > 150


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax(device: torch.device) -> None:
    torch.manual_seed(2)
    vocab = 300
    params = [
        SamplingParams(logprobs=None, seed=1),
        SamplingParams(logprobs=0, temperature=0.5, seed=2),
        SamplingParams(logprobs=1, temperature=0),
        SamplingParams(logprobs=5, top_k=10, seed=3),
        SamplingParams(logprobs=20, repetition_penalty=2.0, presence_penalty=1.0, seed=4),
    ]
    logits = torch.randn(len(params), vocab, device=device) * 4
    output = [[1, 2], [3], [], [4], [int(logits[4].argmax())]]
    batch = make_batch(params, vocab, device, output=output, prompt=output)
    assert batch.max_num_logprobs == 20
    out = sampler(logits, batch)
    ref = torch.log_softmax(logits, dim=-1)
    chosen = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen, atol=1e-5, rtol=0)
    ranks = 1 + (ref > chosen[:, None]).sum(-1)
    assert torch.equal(out.ranks, ranks)
    assert out.top_ids is not None and out.top_logprobs is not None
    top_values, top_ids = ref.topk(20, dim=-1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_values, atol=1e-5, rtol=0)


def test_no_top_logprobs_when_nobody_asks_for_alternatives(device: torch.device) -> None:
    batch = make_batch([SamplingParams(logprobs=0), SamplingParams()], 50, device)
    assert batch.max_num_logprobs is None
    out = sampler(torch.randn(2, 50, device=device), batch)
    assert out.top_ids is None and out.top_logprobs is None
    assert out.logprobs.shape == (2,) and out.logprobs.dtype == torch.float32


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids(device: torch.device) -> None:
    vocab, eos, stop_id = 20, 3, 7
    row = torch.zeros(vocab, device=device)
    row[eos], row[stop_id] = 20.0, 19.0
    greedy = SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[stop_id])
    sampled = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[stop_id], logprobs=0)
    keep_eos = SamplingParams(
        temperature=0, min_tokens=5, stop_token_ids=[stop_id], ignore_eos=True
    )
    params = [greedy, sampled, keep_eos] * 6
    steps = [s for s in range(6) for _ in range(3)]
    logits = row.expand(len(params), vocab).contiguous()
    out = sampler(logits, make_batch(params, vocab, device, steps=steps, eos=(eos,)))
    for i, (p, step) in enumerate(zip(params, steps, strict=True)):
        token = out.token_ids[i].item()
        if step < 5 and not p.ignore_eos:
            assert token not in (eos, stop_id)
        elif step < 5:
            assert token == eos  # ignore_eos: EOS is an ordinary token, only stop ids are masked
        elif p.is_greedy:
            assert token == eos
    # Reported log-probs stay raw: the masked EOS is still the most likely token.
    assert out.top_ids is None and out.ranks is not None
    assert (out.ranks[:2] > 1).all() and out.ranks[2] == 1


# ---------------------------------------------------------------- errors


def test_build_and_call_errors(device: torch.device) -> None:
    p = SamplingParams()
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build([p], [], [0], [[]], [[]], 10, device)
    with pytest.raises(ValueError, match="eos_token_ids"):
        make_batch([p], 10, device, eos=(10,))
    with pytest.raises(ValueError, match="stop_token_ids"):
        make_batch([SamplingParams(stop_token_ids=[12], min_tokens=1)], 10, device)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(1, 11, device=device), make_batch([p], 10, device))


def test_small_top_k_takes_topk_with_the_same_tokens(device: torch.device) -> None:
    """When every sampled row has a small top-k, the sampler keeps only max_top_k columns
    (topk instead of a full sort): same tokens as the full sort, since the noise follows the
    token id and dropped tokens can never win."""
    torch.manual_seed(4)
    vocab, rows = 5000, 48
    rng = random.Random(4)
    params = [
        SamplingParams(
            temperature=rng.choice([0.5, 1.0]),
            top_k=rng.choice([1, 7, 50, 300]),
            top_p=rng.choice([1.0, 0.8]),
            min_p=rng.choice([0.0, 0.05]),
            seed=i,
        )
        if i % 5
        else SamplingParams(temperature=0)
        for i in range(rows)
    ]
    logits = torch.randn(rows, vocab, device=device) * 2
    batch = make_batch(params, vocab, device, steps=list(range(rows)))
    assert batch.max_top_k == 300
    full_sort = dataclasses.replace(batch, max_top_k=None)
    assert torch.equal(sampler(logits, batch).token_ids, sampler(logits, full_sort).token_ids)
    # One sampled row without top-k: no shortcut.
    assert make_batch([*params, SamplingParams(top_p=0.5)], vocab, device).max_top_k is None
