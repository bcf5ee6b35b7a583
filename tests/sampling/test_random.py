from __future__ import annotations

import torch

from mlaserve.sampling.random import stream_keys, to_int64, uniform_noise

_M = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    # Reference SplitMix64 finaliser on unsigned Python ints.
    z &= _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _reference_uniform(seed: int, step: int, token: int) -> float:
    key = _mix64(_mix64(seed & _M) + (step + 1) * _GAMMA)
    bits = _mix64(key + (token + 1) * _GAMMA)
    return ((bits >> 41) + 0.5) / 2**23


def test_matches_pure_python_reference(device: torch.device) -> None:
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, 2**70 + 5]
    steps = [0, 1, 7, 1000, 2**40, 3, 0]
    tokens = torch.tensor([0, 1, 2, 99, 129279], device=device)
    u = uniform_noise(
        torch.tensor([to_int64(s) for s in seeds], device=device),
        torch.tensor(steps, device=device),
        tokens,
    )
    expected = [
        [_reference_uniform(s, t, j) for j in tokens.tolist()]
        for s, t in zip(seeds, steps, strict=True)
    ]
    # Bit-exact: the integer hash is exact and (k + 0.5) * 2**-23 is exact in float32.
    assert u.cpu().tolist() == expected


def test_keys_depend_on_seed_and_step(device: torch.device) -> None:
    seeds = torch.tensor([5, 5, 6], device=device)
    steps = torch.tensor([0, 1, 0], device=device)
    keys = stream_keys(seeds, steps).tolist()
    assert len(set(keys)) == 3


def test_uniform_range_and_moments(device: torch.device) -> None:
    n, vocab = 64, 4096
    u = uniform_noise(
        torch.arange(n, device=device),
        torch.zeros(n, dtype=torch.int64, device=device),
        torch.arange(vocab, device=device),
    )
    assert u.shape == (n, vocab) and u.dtype == torch.float32
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    # 262144 draws: sd of the mean is 0.29 / 512 = 5.6e-4; var of U(0,1) is 1/12.
    assert abs(u.mean().item() - 0.5) < 4e-3
    assert abs(u.var().item() - 1 / 12) < 2e-3
    # Neighbouring tokens / seeds are uncorrelated.
    flat = u.flatten().double() - 0.5
    assert abs((flat[1:] * flat[:-1]).mean().item()) < 2e-3
