"""Counter-based random noise for sampling: the noise a request sees is a pure function of
(seed, step, token id), so a seeded request samples the same tokens whatever else is in the batch,
wherever its row is, and on CPU or CUDA.

There is no generator state. The noise for token `j` at step `t` of a request with seed `s` is the
`j`-th output of a SplitMix64 stream (Steele et al., "Fast splittable pseudorandom number
generators", 2014) whose key is itself a hash of (s, t):

    key    = mix64(mix64(s) + (t + 1) * GAMMA)
    bits   = mix64(key + (j + 1) * GAMMA)
    u      = (top 23 bits of bits + 0.5) / 2**23          in [2**-24, 1 - 2**-24], exact in float32
    gumbel = -log(-log(u))

All integer arithmetic runs on int64 tensors and wraps modulo 2**64, so the bits are identical on
every device. Only the final `log`s are float: CPU and CUDA may differ there by an ulp, which can
change a sample only when two candidates tie to within that ulp.

Everything is elementwise on device tensors: no host sync and no per-row `torch.Generator`, so it
can be captured in a CUDA graph. On CUDA with Triton, `uniform_noise` / `gumbel_noise` run as one
fused kernel (`noise_kernel.py`, same bits); the torch code below is the reference and the path
everywhere else.
"""

from __future__ import annotations

import torch

from mlaserve.sampling.noise_kernel import (
    fused_gumbel_argmax,
    fused_noise,
    fused_noise_available,
)

__all__ = [
    "gumbel_argmax",
    "gumbel_noise",
    "mix64",
    "reference_gumbel_noise",
    "reference_uniform_noise",
    "stream_keys",
    "to_int64",
    "uniform_noise",
]

_MASK64 = (1 << 64) - 1
_UNIFORM_BITS = 23  # float32 holds (k + 0.5) * 2**-23 exactly for every 23-bit k


def to_int64(value: int) -> int:
    """Python int -> the int64 with the same low 64 bits (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GAMMA = to_int64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, SplitMix64's stream increment
_MUL1 = to_int64(0xBF58476D1CE4E5B9)
_MUL2 = to_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, shift: int) -> torch.Tensor:
    # `>>` on int64 is arithmetic (copies the sign bit); masking makes it the logical shift.
    out = x >> shift
    out &= (1 << (64 - shift)) - 1
    return out


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    # In place: the [n, V] hashes are the sampler's largest temporaries (8 bytes per logit).
    z ^= _shr(z, 30)
    z.mul_(_MUL1)
    z ^= _shr(z, 27)
    z.mul_(_MUL2)
    z ^= _shr(z, 31)
    return z


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on an int64 tensor (wrapping arithmetic). Returns a new tensor."""
    return _mix64_(z.clone())


def stream_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One key per (seed, step) pair. seeds, steps: [n] int64 -> [n] int64."""
    return _mix64_(mix64(seeds) + (steps + 1) * _GAMMA)


def uniform_noise(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """u(seed, step, token) in (0, 1), float32.

    seeds, steps: [n] int64. token_ids: [n, V] or [V] int64 (the token each column stands for;
    columns may be permuted, e.g. after a sort, the noise follows the token id).
    Returns [n, V] float32.
    """
    if fused_noise_available(token_ids.device):
        return fused_noise(stream_keys(seeds, steps), token_ids, gumbel=False)
    return reference_uniform_noise(seeds, steps, token_ids)


def reference_uniform_noise(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """`uniform_noise` in plain torch ops (the definition; ~12 int64 kernels over [n, V])."""
    keys = stream_keys(seeds, steps).unsqueeze(1)  # [n, 1]
    bits = _mix64_(torch.add(keys, (token_ids + 1).mul_(_GAMMA)))  # [n, V]
    top = _shr(bits, 64 - _UNIFORM_BITS)
    return (top.to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)); `argmax(logits + noise)` is a sample of
    softmax(logits) (the Gumbel-max trick, equivalent to the exponential race
    `argmax(probs / Exp(1))`). Shapes as in `uniform_noise`."""
    if fused_noise_available(token_ids.device):
        return fused_noise(stream_keys(seeds, steps), token_ids, gumbel=True)
    return reference_gumbel_noise(seeds, steps, token_ids)


def reference_gumbel_noise(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """`gumbel_noise` in plain torch ops."""
    u = reference_uniform_noise(seeds, steps, token_ids)
    return u.log_().neg_().log_().neg_()


def gumbel_argmax(
    x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor | None
) -> torch.Tensor:
    """The Gumbel-max draw `argmax(x + gumbel_noise(seeds, steps, ids))` over each row: a sample
    of softmax(x). x: [n, C] float32; token_ids: [n, C] int64 (the token each column stands
    for) or None (column c is token c). Returns [n] int64 column indices. On CUDA one Triton
    kernel (`noise_kernel.fused_gumbel_argmax`: no [n, C] noise tensor, no key kernels), the
    same column as the torch ops below, which are the reference and the path elsewhere."""
    if fused_noise_available(x.device):
        return fused_gumbel_argmax(x, seeds, steps, token_ids)
    ids = torch.arange(x.shape[1], device=x.device) if token_ids is None else token_ids
    return (x + gumbel_noise(seeds, steps, ids)).argmax(dim=-1)
