"""Speculative acceptance: greedy exactness, lossless sampling (chi-square, with wrong rules that
must fail the same test), self-speculation accepts everything."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
import torch

from mlaserve.sampling import SamplingBatch, SamplingSlots, rejection
from mlaserve.sampling.rejection import accept_draft, target_probs
from mlaserve.sampling_params import SamplingParams
from tests.sampling.sampling_oracle import chi_square_critical, naive_penalties, reference_probs

V = 8  # the tiny vocabulary of the distribution tests
CONTEXT = 0  # the token every sequence starts from


def verify_batch(
    params: list[SamplingParams],
    k: int,
    device: torch.device,
    seeds: list[int],
    steps: list[int],
    vocab: int = V,
    output: list[list[int]] | None = None,
    prompt: list[list[int]] | None = None,
) -> SamplingBatch:
    """bs * (k + 1) rows, request-major, row j at steps[b] + j (what SamplingSlots gives)."""
    rep = k + 1
    n = len(params)
    out = output or [[] for _ in range(n)]
    pr = prompt or [[] for _ in range(n)]
    return SamplingBatch.build(
        [p for p in params for _ in range(rep)],
        seeds=[s for s in seeds for _ in range(rep)],
        steps=[s + j for s in steps for j in range(rep)],
        prompt_ids=[x for x in pr for _ in range(rep)],
        output_ids=[x for x in out for _ in range(rep)],
        vocab_size=vocab,
        device=device,
    )


class TinyModel:
    """A bigram 'language model' over V tokens: the target's next-token logits depend on the
    previous token (T[prev]), the draft's on the same through a different table Q."""

    def __init__(self, device: torch.device) -> None:
        g = torch.Generator().manual_seed(1234)
        self.target = torch.randn(V, V, generator=g) * 1.2
        self.draft = self.target + torch.randn(V, V, generator=g) * 1.5
        self.device = device

    def draft_chain(
        self, prev: torch.Tensor, k: int, point_mass: bool, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N] previous tokens -> draft ids [N, k] and, unless point_mass, q [N, k, V]. The
        draft draws with a torch.Generator, independent of the target's counter noise."""
        ids, probs = [], []
        for _ in range(k):
            q = self.draft[prev].softmax(-1)
            d = q.argmax(-1) if point_mass else torch.multinomial(q, 1, generator=gen).squeeze(1)
            ids.append(d)
            probs.append(q)
            prev = d
        draft_probs = None if point_mass else torch.stack(probs, 1).to(self.device)
        return torch.stack(ids, 1).to(self.device), draft_probs

    def verify_logits(self, prev: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        chain = torch.cat([prev.unsqueeze(1), draft.cpu()], dim=1)  # [N, k + 1]
        return self.target[chain].to(self.device)  # [N, k + 1, V]

    def two_tokens(
        self, params: SamplingParams, n: int, k: int, point_mass: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first two tokens of n sequences (seeds 0..n-1) generated with speculation: a
        second speculative step from the first token where the first step emitted one."""
        gen = torch.Generator().manual_seed(99)
        seeds = list(range(n))
        prev = torch.full((n,), CONTEXT, dtype=torch.int64)
        draft, q = self.draft_chain(prev, k, point_mass, gen)
        batch = verify_batch([params] * n, k, self.device, seeds, [0] * n)
        first = accept_draft(self.verify_logits(prev, draft), draft, batch, q)
        t1 = first.out_tokens[:, 0].cpu()
        draft, q = self.draft_chain(t1, k, point_mass, gen)
        # One step later (steps only key the noise here: no min_tokens, no penalties).
        batch = dataclasses.replace(batch, steps=batch.steps + 1)
        second = accept_draft(self.verify_logits(t1, draft), draft, batch, q)
        more = first.accept_len.cpu() >= 2
        t2 = torch.where(more, first.out_tokens[:, 1].cpu(), second.out_tokens[:, 0].cpu())
        return t1, t2

    def expected_joint(self, params: SamplingParams) -> torch.Tensor:
        """P(t1, t2) = p(t1 | CONTEXT) p(t2 | t1), [V, V] float64."""
        cond = torch.stack([reference_probs(self.target[v], params) for v in range(V)])
        return cond[CONTEXT].unsqueeze(1) * cond


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at 1e-6) over the cells; cells expected below 5 are pooled.
    Tokens the target forbids must never appear."""
    counts, expected = counts.flatten().double(), expected.flatten()
    assert counts[expected == 0].sum() == 0, "sampled a token the target forbids"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (expected > 0)].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big & (expected > 0)].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return stat, chi_square_critical(len(exp) - 1)


# Sequences per test. At this N the right rule gives a statistic of ~50-75 against a critical
# value of 132 (df ~ 60-63), and each wrong rule below gives > 5000.
N = 20000
K = 2
CASES = {
    "t1": SamplingParams(temperature=1.0),
    "filters": SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05),
}


def joint_chi_square(
    model: TinyModel, params: SamplingParams, point_mass: bool
) -> tuple[float, float]:
    t1, t2 = model.two_tokens(params, N, K, point_mass)
    counts = torch.zeros(V, V, dtype=torch.float64)
    counts.index_put_((t1, t2), torch.ones(N, dtype=torch.float64), accumulate=True)
    return chi_square(counts, model.expected_joint(params) * N)


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "top1_draft"])
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_speculative_sampling_is_lossless(
    params: SamplingParams, point_mass: bool, device: torch.device
) -> None:
    """Joint distribution of the first two emitted tokens (64 cells) over N = 20000 seeded
    sequences against the target's own p(t1) p(t2 | t1): chi-square at a 1e-6 false-alarm
    rate. The draws are deterministic, so the test always passes or always fails."""
    stat, critical = joint_chi_square(TinyModel(device), params, point_mass)
    assert stat < critical, (stat, critical)


WRONG_RULES: dict[str, tuple[str, Callable]] = {
    # Accept every draft token: emits the draft's distribution.
    "always_accept": ("_accept", lambda p, q, u: torch.ones_like(p, dtype=torch.bool)),
    # Resample from p after a rejection instead of from max(p - q, 0).
    "resample_from_p": ("_residual", lambda p, q: p),
}


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft_probs", "top1_draft"])
@pytest.mark.parametrize("rule", WRONG_RULES.keys())
def test_wrong_acceptance_rule_fails_the_same_test(
    rule: str, point_mass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same test, same N and threshold, with the acceptance or the residual replaced by a
    wrong one: it must fail, by a wide margin (so the real rule's pass is meaningful)."""
    name, wrong = WRONG_RULES[rule]
    monkeypatch.setattr(rejection, name, wrong)
    stat, critical = joint_chi_square(TinyModel(torch.device("cpu")), CASES["t1"], point_mass)
    assert stat > 10 * critical, (stat, critical)


# ---------------------------------------------------------------- greedy


def test_greedy_acceptance_is_exact(device: torch.device) -> None:
    """Accept while draft == argmax of the (penalised, min_tokens-masked) target, then emit the
    argmax: checked against a naive per-position loop, with penalties counting accepted drafts."""
    rng = random.Random(3)
    torch.manual_seed(3)
    vocab, bs, k, eos = 40, 24, 3, 1
    params = [
        SamplingParams(
            temperature=0,
            repetition_penalty=rng.choice([1.0, 1.5]),
            frequency_penalty=rng.choice([0.0, 2.0]),
            min_tokens=rng.choice([0, 2]),
        )
        for _ in range(bs)
    ]
    prompt = [[rng.randrange(vocab) for _ in range(5)] for _ in range(bs)]
    output = [[rng.randrange(vocab) for _ in range(rng.randrange(3))] for _ in range(bs)]
    steps = [len(o) for o in output]
    logits = torch.randn(bs, k + 1, vocab) * 2
    logits[:, :, eos] += 3.0  # EOS is often the argmax, so the min_tokens ban matters
    # Draft: the naive argmax chain for the first m tokens, then a wrong token.
    expected_len, expected_tokens, draft = [], [], torch.zeros(bs, k, dtype=torch.int64)
    for b, p in enumerate(params):
        m = rng.randrange(k + 1)
        emitted: list[int] = []
        for j in range(k + 1):
            row = logits[b, j].clone()
            if steps[b] + j < p.min_tokens:
                row[eos] = -float("inf")
            best = int(naive_penalties(row[None], [p], [prompt[b]], [output[b] + emitted]).argmax())
            if j in (m, k):
                emitted.append(best)
                break
            emitted.append(best)
            draft[b, j] = best
        if m < k:
            draft[b, m] = (emitted[-1] + 1 + rng.randrange(vocab - 1)) % vocab  # != argmax
            draft[b, m + 1 :] = torch.randint(vocab, (k - m - 1,))
        expected_len.append(len(emitted))
        expected_tokens.append(emitted)
    batch = SamplingBatch.build(
        [p for p in params for _ in range(k + 1)],
        seeds=[0] * (bs * (k + 1)),
        steps=[s + j for s in steps for j in range(k + 1)],
        prompt_ids=[x for x in prompt for _ in range(k + 1)],
        output_ids=[x for x in output for _ in range(k + 1)],
        vocab_size=vocab,
        device=device,
        eos_token_ids=[eos],
    )
    out = accept_draft(logits.to(device), draft.to(device), batch)
    assert out.accept_len.tolist() == expected_len
    for b in range(bs):
        n = expected_len[b]
        assert out.out_tokens[b, :n].tolist() == expected_tokens[b]
        assert (out.out_tokens[b, n:] == expected_tokens[b][-1]).all()


def test_mixed_batch_rows_are_independent(device: torch.device) -> None:
    """A row's result does not depend on its neighbours (greedy or sampled)."""
    torch.manual_seed(5)
    vocab, k = 30, 3
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9, seed=1, top_k=10),
        SamplingParams(temperature=1.2, seed=2, presence_penalty=1.0),
        SamplingParams(temperature=0),
    ]
    bs = len(params)
    logits = torch.randn(bs, k + 1, vocab, device=device)
    draft = logits.argmax(-1)[:, :k].clone()
    draft[0, 2] = (draft[0, 2] + 1) % vocab
    q = torch.rand(bs, k, vocab, device=device).softmax(-1)
    seeds, steps = [p.seed or 0 for p in params], [4, 0, 9, 1]
    together = accept_draft(logits, draft, verify_batch(params, k, device, seeds, steps, vocab), q)
    assert together.accept_len[0].item() == 3 and together.accept_len[3].item() == k + 1
    for b in range(bs):
        alone = accept_draft(
            logits[b : b + 1],
            draft[b : b + 1],
            verify_batch([params[b]], k, device, [seeds[b]], [steps[b]], vocab),
            q[b : b + 1],
        )
        assert torch.equal(alone.accept_len, together.accept_len[b : b + 1])
        assert torch.equal(alone.out_tokens, together.out_tokens[b : b + 1])


# ---------------------------------------------------------------- self-speculation


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
        SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.3),
    ],
    ids=["greedy", "t1", "filters", "penalties"],
)
def test_self_speculation_accepts_everything(params: SamplingParams, device: torch.device) -> None:
    """A draft that is the target itself (its distribution at every position, and tokens
    drawn from it, or its argmax when greedy) is accepted whole: accept_len = k + 1 exactly."""
    n, k = 2000, 4
    model = TinyModel(device)
    gen = torch.Generator().manual_seed(7)
    prev = torch.full((n,), CONTEXT, dtype=torch.int64)
    # The chain is drawn from the target's conditional table; q is then the target's own
    # distribution of each verify row, bit for bit.
    if params.is_greedy:
        table = model.target
    else:
        table = torch.stack([reference_probs(model.target[v], params) for v in range(V)]).float()
    ids, last = [], prev
    for _ in range(k):
        last = (
            table[last].argmax(-1)
            if params.is_greedy
            else torch.multinomial(table[last], 1, generator=gen).squeeze(1)
        )
        ids.append(last)
    draft = torch.stack(ids, 1).to(device)
    logits = model.verify_logits(prev, draft)
    batch = verify_batch([params] * n, k, device, list(range(n)), [0] * n)
    target = target_probs(logits, draft, batch)
    q = None if target.probs is None else target.probs[:, :k]
    out = accept_draft(logits, draft, batch, q)
    assert (out.accept_len == k + 1).all()
    assert torch.equal(out.out_tokens[:, :k], draft)


def test_slots_verify_batch_layout(device: torch.device) -> None:
    slots = SamplingSlots(4, 16, device)
    slots.admit(2, SamplingParams(seed=3), seed=3, prompt_ids=[1])
    slots.admit(0, SamplingParams(temperature=0), seed=0, prompt_ids=[1])
    batch = slots.verify_batch([2, 0], [5, 0], k=2)
    assert batch.num_rows == 6 and batch.any_greedy and not batch.all_greedy
    assert batch.steps.tolist() == [5, 6, 7, 0, 1, 2]
    assert batch.slots is not None and batch.slots[::3].tolist() == [2, 0]
    assert batch.is_greedy.tolist() == [False] * 3 + [True] * 3
    # More rows than slots: the staging row grows.
    slots.admit(1, SamplingParams(), seed=1, prompt_ids=[])
    assert slots.verify_batch([0, 1, 2], [0, 0, 0], k=3).num_rows == 12


def test_accept_errors(device: torch.device) -> None:
    batch = verify_batch([SamplingParams()], 2, device, [0], [0])
    logits = torch.zeros(1, 3, V, device=device)
    draft = torch.zeros(1, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="draft_ids"):
        accept_draft(logits, draft[:, :1], batch)
    with pytest.raises(ValueError, match="target_logits"):
        accept_draft(logits[0], draft, batch)
    with pytest.raises(ValueError, match="draft_probs"):
        accept_draft(logits, draft, batch, torch.zeros(1, 3, V, device=device))
    with pytest.raises(ValueError, match="batch"):
        accept_draft(logits, draft, verify_batch([SamplingParams()], 1, device, [0], [0]))
