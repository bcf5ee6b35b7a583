"""The counter-based noise of `random.py` as one Triton kernel: same hash, same bits.

The torch path spends ~15 elementwise int64 kernels over [n, V] per draw (add, multiply, five
shift/mask/xor rounds, the float conversion, two logs), each reading and writing 8 bytes per
logit: at V = 129280 that is launch-bound at bs 1 and ~40 MB of traffic at bs 64. The kernel
computes the hash in registers and writes the float32 result once.

Bits: the integer hash wraps modulo 2**64 on uint64 registers, exactly like the int64 torch ops,
so the uniform (k + 0.5) * 2**-23 is bit-identical. The Gumbel transform uses libdevice's
`logf`, the function torch's CUDA `log` compiles to, so on CUDA the Gumbel noise is meant to be
identical too (`tests/sampling/test_noise_kernel.py` checks both; on CPU, under
TRITON_INTERPRET=1, the logs are numpy's and only agree to an ulp).

Used only for CUDA tensors when Triton imports (it ships with torch on the GPU host); every
other case takes the torch path in `random.py`, the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mlaserve.ops.triton_support import interpreting

try:  # Optional: absent on CPU-only installs.
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = [
    "fused_gumbel_argmax",
    "fused_noise",
    "fused_noise_available",
    "gumbel_argmax_warm_up_tasks",
]

_BLOCK = 1024
# Columns per program of the argmax kernel: 129280 / 2048 = 64 programs per row, so one row
# (bs 1) still spreads over the GPU; [n, 64] partial maxima are reduced by torch.
_ARGMAX_BLOCK = 2048


def fused_noise_available(device: torch.device) -> bool:
    """Whether the sampler dispatches to `fused_noise` for tensors on `device`: CUDA with Triton.
    (Its interpreter test calls `fused_noise` directly; the sampler never picks the interpreter,
    which other kernel tests switch on process-wide.)"""
    return triton is not None and device.type == "cuda"


def fused_noise(keys: torch.Tensor, token_ids: torch.Tensor, gumbel: bool) -> torch.Tensor:
    """keys: [n] int64 from `random.stream_keys`. token_ids: [n, V] or [V] int64 (the token each
    column stands for). Returns [n, V] float32: the uniform u, or -log(-log(u)) if gumbel."""
    if triton is None:
        raise RuntimeError("fused_noise: Triton is not installed")
    n = keys.shape[0]
    if token_ids.dim() == 1:
        vocab, row_stride = token_ids.shape[0], 0
    else:
        vocab, row_stride = token_ids.shape[1], token_ids.stride(0)
        if token_ids.stride(1) != 1:
            token_ids = token_ids.contiguous()
            row_stride = token_ids.stride(0)
    out = torch.empty(n, vocab, dtype=torch.float32, device=keys.device)
    if n == 0 or vocab == 0:
        return out
    grid = (n, triton.cdiv(vocab, _BLOCK))
    # The interpreter has no libdevice; its tl.log is numpy's.
    libdevice_log = not interpreting()
    _noise_kernel[grid](
        keys.contiguous(),
        token_ids,
        out,
        vocab,
        row_stride,
        BLOCK=_BLOCK,
        GUMBEL=gumbel,
        LIBDEVICE_LOG=libdevice_log,
    )
    return out


def fused_gumbel_argmax(
    x: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor | None
) -> torch.Tensor:
    """argmax over columns of x + gumbel(seed, step, token), without materialising the noise.

    x: [n, C] float32 (contiguous rows). seeds, steps: [n] int64 (the key `random.stream_keys`
    derives is computed in the kernel). token_ids: [n, C] int64, the token each column stands
    for, or None when column c is token c. Returns [n] int64 column indices. Same noise bits and
    the same float32 sums as `x + gumbel_noise(...)`, so the same column as its argmax (ties go
    to the lowest column, as torch's argmax); rows holding NaN return an arbitrary column (the
    sampler reports those rows as errors)."""
    if triton is None:
        raise RuntimeError("fused_gumbel_argmax: Triton is not installed")
    n, cols = x.shape
    x = x.contiguous()
    if token_ids is not None:
        token_ids = token_ids.contiguous()
    blocks = triton.cdiv(cols, _ARGMAX_BLOCK)
    best = torch.empty(n, blocks, dtype=torch.float32, device=x.device)
    where = torch.empty(n, blocks, dtype=torch.int64, device=x.device)
    if n == 0 or cols == 0:
        return torch.zeros(n, dtype=torch.int64, device=x.device)
    _gumbel_argmax_kernel[(n, blocks)](
        x,
        seeds.contiguous(),
        steps.contiguous(),
        x if token_ids is None else token_ids,  # unread without HAS_IDS
        best,
        where,
        cols,
        blocks,
        BLOCK=_ARGMAX_BLOCK,
        HAS_IDS=token_ids is not None,
        LIBDEVICE_LOG=not interpreting(),
        num_warps=8,
    )
    return where.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


def gumbel_argmax_warm_up_tasks(vocab_size: int, device: torch.device) -> list[Callable[[], None]]:
    """Start-up's tasks for the draw's variants a sampled request meets first (the throwaway
    request is greedy, so nothing else compiles them): whole rows of `vocab_size` columns, by
    column (temperature alone) and by token id (top-p sorts the whole row), and the materialised
    uniform and Gumbel noise. A top-k cut's rows of the batch's largest k columns take the same
    compiles (no size is specialised)."""

    def draw(with_ids: bool) -> None:
        x = torch.zeros(1, vocab_size, device=device)
        keys = torch.zeros(1, dtype=torch.int64, device=device)
        ids = torch.zeros(1, vocab_size, dtype=torch.int64, device=device) if with_ids else None
        fused_gumbel_argmax(x, keys, keys, ids)

    def noise(gumbel: bool) -> None:  # the materialised noise (`random.uniform_noise` and kin)
        keys = torch.zeros(1, dtype=torch.int64, device=device)
        fused_noise(keys, torch.arange(vocab_size, device=device), gumbel)

    return [functools.partial(draw, False), functools.partial(draw, True),
            functools.partial(noise, False), functools.partial(noise, True)]  # fmt: skip


if triton is not None:

    @triton.jit
    def _mix64(z):
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

    # Nothing is specialised (Triton's divisible-by-16 and equal-to-1 variants of sizes, its
    # 16-byte alignment of pointers): a top-k cut's row width is any k, a row may start anywhere,
    # and each variant would be a compile while serving (seven, then two, in TP2 soaks).
    # Start-up's warm-up then covers every call.
    @triton.jit(
        do_not_specialize=["x_ptr", "seeds_ptr", "steps_ptr", "ids_ptr", "best_ptr", "where_ptr",
                           "cols", "blocks"]
    )  # fmt: skip
    def _gumbel_argmax_kernel(x_ptr, seeds_ptr, steps_ptr, ids_ptr, best_ptr, where_ptr, cols,
                              blocks, BLOCK: tl.constexpr, HAS_IDS: tl.constexpr,
                              LIBDEVICE_LOG: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        block = tl.program_id(1)
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        # random.stream_keys: key = mix64(mix64(seed) + (step + 1) * GAMMA), on uint64.
        seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
        step = tl.load(steps_ptr + row).to(tl.uint64, bitcast=True)
        key = _mix64(_mix64(seed) + (step + 1) * 0x9E3779B97F4A7C15)
        base = row.to(tl.int64) * cols
        if HAS_IDS:
            ids = tl.load(ids_ptr + base + offs, mask=mask, other=0)
        else:
            ids = offs.to(tl.int64)
        z = _mix64(key + (ids.to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15)
        u = ((z >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23, exact
        if LIBDEVICE_LOG:
            g = -libdevice.log(-libdevice.log(u))
        else:
            g = -tl.log(-tl.log(u))
        v = tl.load(x_ptr + base + offs, mask=mask, other=float("-inf")) + g
        v = tl.where(mask, v, float("-inf"))
        m, i = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_ptr + row * blocks + block, m)
        tl.store(where_ptr + row * blocks + block, block * BLOCK + i.to(tl.int64))

    @triton.jit(do_not_specialize=["keys_ptr", "ids_ptr", "out_ptr", "vocab", "ids_row_stride"])
    def _noise_kernel(keys_ptr, ids_ptr, out_ptr, vocab, ids_row_stride, BLOCK: tl.constexpr,
                      GUMBEL: tl.constexpr, LIBDEVICE_LOG: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab
        key = tl.load(keys_ptr + row).to(tl.uint64, bitcast=True)
        ids = tl.load(ids_ptr + row * ids_row_stride + cols, mask=mask, other=0)
        # SplitMix64: bits = mix64(key + (id + 1) * GAMMA), wrapping on uint64.
        z = key + (ids.to(tl.uint64, bitcast=True) + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u = ((z >> 41).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23, exact
        if GUMBEL:
            if LIBDEVICE_LOG:
                u = -libdevice.log(-libdevice.log(u))
            else:
                u = -tl.log(-tl.log(u))
        tl.store(out_ptr + row.to(tl.int64) * vocab + cols, u, mask=mask)
