"""SamplingSlots must sample exactly what SamplingBatch.build samples from the same host state,
while keeping that state on the device and updating the output counts there."""

from __future__ import annotations

import random

import pytest
import torch

from mlaserve.sampling import Sampler, SamplingBatch, SamplingSlots
from mlaserve.sampling_params import SamplingParams
from tests.device_ops import DeviceOps

sampler = Sampler()


def random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 0.7, 1.0, 1.3]),
        top_k=rng.choice([0, 0, 3, 20]),
        top_p=rng.choice([1.0, 1.0, 0.8]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
        presence_penalty=rng.choice([0.0, 0.0, 0.6]),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=rng.choice([[], [5]]),
        ignore_eos=rng.choice([False, False, True]),
        logprobs=rng.choice([None, None, 0, 3]),
        max_tokens=64,
    )


def test_slots_sample_like_build_over_a_serving_run(device: torch.device) -> None:
    """Requests arrive, decode, finish and are replaced in random slots for 40 steps; every step
    the slot-based batch gives the same tokens, logprobs and ranks as a batch built from the
    host lists, and the device-side counts equal the counts of the host output lists."""
    rng = random.Random(0)
    vocab, num_slots, eos = 64, 6, (1, 2)
    slots = SamplingSlots(num_slots, vocab, device, eos_token_ids=eos)
    live: dict[int, dict] = {}  # slot -> request state
    generator = torch.Generator().manual_seed(0)
    for step in range(40):
        for slot in range(num_slots):  # admit into free slots, sometimes
            if slot not in live and rng.random() < 0.6:
                prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
                output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))]  # resumed
                req = dict(params=random_params(rng), seed=rng.randrange(-(2**63), 2**64))
                req.update(prompt=prompt, output=output)
                slots.admit(slot, req["params"], req["seed"], prompt, output)
                live[slot] = req
        rows = sorted(live, key=lambda _: rng.random())  # any row order
        if not rows:
            continue
        reqs = [live[s] for s in rows]
        logits = (torch.randn(len(rows), vocab, generator=generator) * 3).to(device)
        steps = [len(r["output"]) for r in reqs]
        built = SamplingBatch.build(
            [r["params"] for r in reqs],
            seeds=[r["seed"] for r in reqs],
            steps=steps,
            prompt_ids=[r["prompt"] for r in reqs],
            output_ids=[r["output"] for r in reqs],
            vocab_size=vocab,
            device=device,
            eos_token_ids=eos,
        )
        batch = slots.batch(rows, steps)
        want, got = sampler(logits, built), sampler(logits, batch)
        assert torch.equal(got.token_ids, want.token_ids), step
        assert batch.all_greedy == built.all_greedy and batch.use_top_k == built.use_top_k
        for a, b in zip(got[1:], want[1:], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        # The step's tokens are counted on the device, from the device tensors.
        assert batch.slots is not None and batch.slots.tolist() == rows
        slots.record(batch.slots, got.token_ids)
        for r, token in zip(reqs, got.token_ids.tolist(), strict=True):
            r["output"].append(token)
        for slot in rows:
            p = live[slot]["params"]
            penalised = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
            if penalised:
                counts = torch.bincount(torch.tensor(live[slot]["output"]), minlength=vocab)
                assert slots.output_counts is not None
                assert torch.equal(slots.output_counts[slot].cpu(), counts.float())
            if rng.random() < 0.2 or len(live[slot]["output"]) > 10:
                slots.release(slot)
                del live[slot]


def test_penalty_buffers_are_lazy(device: torch.device) -> None:
    slots = SamplingSlots(64, 129280, device)
    assert slots.penalty_bytes == 64 * 129280 * 5  # 41.4 MB
    slots.admit(0, SamplingParams(temperature=0.5, top_k=5), seed=1, prompt_ids=[1, 2, 3])
    assert slots.output_counts is None and slots.prompt_mask is None
    batch = slots.batch([0], [0])
    assert not batch.use_penalties and batch.use_top_k and not batch.need_logprobs
    slots.record(torch.tensor([0], device=device), torch.tensor([7], device=device))  # no-op
    slots.admit(1, SamplingParams(repetition_penalty=1.2), seed=2, prompt_ids=[3, 4])
    assert slots.prompt_mask is not None and slots.output_counts is not None
    assert slots.prompt_mask[1].nonzero().flatten().tolist() == [3, 4]


def test_record_counts_only_accepted_tokens(device: torch.device) -> None:
    """Speculative steps emit up to m tokens per row; only the first num_tokens count."""
    slots = SamplingSlots(4, 10, device)
    for slot in range(4):
        slots.admit(slot, SamplingParams(frequency_penalty=1.0), seed=slot, prompt_ids=[0])
    rows = torch.tensor([2, 0, 3], device=device)
    tokens = torch.tensor([[1, 1, 2], [4, 5, 6], [7, 8, 9]], device=device)
    slots.record(rows, tokens, num_tokens=torch.tensor([3, 1, 2], device=device))
    counts = slots.output_counts
    assert counts is not None
    assert counts[2, 1].item() == 2 and counts[2, 2].item() == 1 and counts[2].sum() == 3
    assert counts[0, 4].item() == 1 and counts[0].sum() == 1
    assert counts[3, 7].item() == 1 and counts[3, 8].item() == 1 and counts[3].sum() == 2
    assert counts[1].sum() == 0
    # Re-admission starts the slot from the new request's own state.
    slots.admit(2, SamplingParams(frequency_penalty=1.0), seed=0, prompt_ids=[], output_ids=[9])
    assert counts[2].sum() == 1 and counts[2, 9].item() == 1


def test_slot_errors(device: torch.device) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SamplingSlots(0, 10, device)
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingSlots(2, 10, device, eos_token_ids=[10])
    slots = SamplingSlots(2, 10, device)
    with pytest.raises(ValueError, match="slot"):
        slots.admit(2, SamplingParams(), seed=0, prompt_ids=[])
    with pytest.raises(ValueError, match="stop_token_ids"):
        slots.admit(0, SamplingParams(stop_token_ids=[10]), seed=0, prompt_ids=[])
    with pytest.raises(ValueError, match="prompt_ids"):
        slots.admit(0, SamplingParams(repetition_penalty=2.0), seed=0, prompt_ids=[11])
    with pytest.raises(ValueError, match="slots: slot 1 holds no admitted request"):
        slots.batch([1], [0])
    slots.admit(0, SamplingParams(), seed=0, prompt_ids=[])
    with pytest.raises(ValueError, match="steps"):
        slots.batch([0], [0, 1])
    slots.release(0)
    with pytest.raises(ValueError, match="slot 0"):
        slots.batch([0], [0])


def test_a_batch_that_keeps_its_rows_samples_like_build(device: torch.device) -> None:
    """The same requests in the same rows for many steps (what `batch` reuses between
    admissions), through min_tokens bans ending and penalty counts growing; then a release and
    an admission change the rows."""
    vocab, eos = 32, (1,)
    slots = SamplingSlots(4, vocab, device, eos_token_ids=eos)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, max_tokens=64),
        SamplingParams(temperature=0.9, top_k=5, frequency_penalty=0.7, logprobs=2, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, stop_token_ids=[4], min_tokens=5),
    ]
    outputs: dict[int, list[int]] = {}
    for slot, p in zip((2, 0, 3), params, strict=True):
        slots.admit(slot, p, seed=slot, prompt_ids=[slot, 7])
        outputs[slot] = []
    generator = torch.Generator().manual_seed(1)
    for step in range(12):
        if step == 8:  # slot 0 finishes; slot 1 takes a new request
            slots.release(0)
            del outputs[0], params[1]
            params.append(SamplingParams(temperature=1.0, min_p=0.2, seed=9))
            slots.admit(1, params[-1], seed=1, prompt_ids=[5])
            outputs[1] = []
        rows = list(outputs)
        steps = [len(outputs[s]) for s in rows]
        built = SamplingBatch.build(
            params, seeds=rows, steps=steps, prompt_ids=[[s, 7] if s != 1 else [5] for s in rows],
            output_ids=[outputs[s] for s in rows], vocab_size=vocab, device=device,
            eos_token_ids=eos,
        )  # fmt: skip
        batch = slots.batch(rows, steps)
        logits = (torch.randn(len(rows), vocab, generator=generator) * 3).to(device)
        logits[:, 1] = logits[:, 4] = 50.0  # EOS and the stop id win unless banned
        want, got = sampler(logits, built), sampler(logits, batch)
        for a, b in zip(got, want, strict=True):
            assert (a is None) == (b is None), step
            if a is not None:
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"step {step}")
        slots.record(batch.slots, got.token_ids)
        for s, token in zip(rows, got.token_ids.tolist(), strict=True):
            outputs[s].append(token)
    # EOS (and slot 3's stop id) banned below min_tokens, then chosen.
    assert 1 not in outputs[2][:3] and outputs[2][3] == 1
    assert not {1, 4} & set(outputs[3][:5]) and outputs[3][5] in (1, 4)


def test_a_steady_batch_uploads_its_steps_only(device: torch.device) -> None:
    """Once a row order has been batched, the next steps' batches are one host->device copy
    (the steps), and nothing else runs on the device while no row is penalised or banned."""
    slots = SamplingSlots(4, 16, device)
    slots.admit(1, SamplingParams(temperature=0.0), seed=0, prompt_ids=[1])
    slots.admit(3, SamplingParams(temperature=0.8, top_p=0.9), seed=1, prompt_ids=[2])
    slots.batch([3, 1], [0, 0])
    with DeviceOps() as counted:
        batch = slots.batch([3, 1], [1, 1])
    assert dict(counted.ops) == {"_to_copy": 1}
    assert batch.steps.tolist() == [1, 1] and batch.slots.tolist() == [3, 1]


def test_keeps_logits_greedy_is_when_the_sampler_takes_the_argmax_computed_ahead(
    device: torch.device,
) -> None:
    """`keeps_logits_greedy` (what rank 0 tells the TP workers before a forward: their feed is
    their own graph's argmax) holds exactly when the sampler returns the `GreedyRows` handed
    to it at a request's first step, and stays sufficient later (a ban that has ended only
    makes the sampler take them where the predicate already said no)."""
    from mlaserve.sampling import GreedyRows

    rng = random.Random(4)
    vocab, eos = 32, (1,)
    slots = SamplingSlots(2, vocab, device, eos_token_ids=eos)
    seen = set()
    for i in range(200):
        p = random_params(rng)
        slots.admit(0, p, seed=i, prompt_ids=[3, 7])
        logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(i)) * 3).to(device)
        ids = logits.argmax(-1)
        greedy = GreedyRows(ids, torch.ones(1, dtype=torch.bool, device=device), ids)
        for step in (0, 6):
            out = sampler(logits, slots.batch([0], [step]), None, greedy)
            took = out.token_ids is greedy.token_ids
            keeps = slots.keeps_logits_greedy(p)
            assert took == keeps if step == 0 else (took or not keeps), (p, step)
            seen.add((step, keeps, took))
    assert {(0, True, True), (0, False, False), (6, False, True)} <= seen
