"""FP8 block-quantized weights inside the linear layers and the stacked experts.

A layer built with a `QuantizationConfig` keeps, instead of a float weight:

    weight            [..., N, K] float8_e4m3fn           (the checkpoint's bytes, unchanged)
    weight_scale_inv  [..., ceil(N/128), ceil(K/128)] fp32 (the checkpoint's block scales), or
                      [..., N, ceil(K/128)] fp32 when per-row (see below)

with W = weight * scale, the DeepSeek-V3 convention (`weight_scale_inv` is multiplied despite
its name). Per-row scales: a layer that stores several checkpoint tensors one after another
(gate | up) whose seam is not on a 128-row boundary would have blocks straddling two tensors, so
it expands each tensor's block scales to one per row (`expand_scale_rows`; 1/128 of the fp8
bytes per scale column instead of 1/128^2). Every DeepSeek-V3/R1/Kimi-K2 and V2-Lite MoE shape is
128-aligned; the per-row form exists for odd shapes (tests, V2-Lite's dense 10944).

Under tensor parallelism a rank keeps a slice of the weight along its split dim, and the same
slice of the block scales: rows [r*n/tp, (r+1)*n/tp) of the weight are scale rows
[r*n/tp/128, ...). The checkpoint tensor the loader hands over (`model/checkpoint_tensor.py`)
carries its scale and narrows both at once, reading only the rank's blocks. That needs every
shard boundary on a 128 boundary (`check_block_aligned`, at construction; `narrow` checks it
again): V3/R1/Kimi-K2 at TP2/4/8 are (q_b 24576 or 12288 rows, o_proj 16384 or 8192 columns,
dense 18432, experts 2048), V2-Lite's dense 10944 is not. Expert parallelism splits no expert.

`copy_block_rows` is the one place that writes both tensors; the layers' weight loaders call it.
A float tensor loaded into an FP8 layer (a re-export that left one projection unquantised) is
block-quantised there, so the layer's memory stays FP8.
"""

from __future__ import annotations

import torch
from torch import nn

from mlaserve.config import QuantizationConfig
from mlaserve.ops.fp8_quant import FP8_DTYPE, expand_scale_rows, quantize_weight_block
from mlaserve.tensor_parallel import TensorParallel

__all__ = [
    "block_scale_shape",
    "check_block_aligned",
    "copy_block_rows",
    "make_fp8_weight",
    "needs_per_row_scales",
]


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def block_scale_shape(n: int, k: int, quant: QuantizationConfig) -> tuple[int, int]:
    """The checkpoint's scale shape for an [n, k] weight: (ceil(n/128), ceil(k/128))."""
    return _blocks(n, quant.block_n), _blocks(k, quant.block_k)


def needs_per_row_scales(output_sizes: list[int], quant: QuantizationConfig) -> bool:
    """True when a seam between stacked tensors falls inside a 128-row block."""
    return any(size % quant.block_n for size in output_sizes[:-1])


def check_block_aligned(n: int, tp: TensorParallel, block: int, what: str) -> None:
    """Raise ValueError (naming `what`: the layer and its dimension) where splitting a dimension
    of `n` over the TP ranks would put a shard boundary inside a `block`-wide scale block."""
    if tp.size > 1 and (n % tp.size or (n // tp.size) % block):
        raise ValueError(
            f"{what}: FP8 {block}x{block} block weights under tensor parallelism need a rank's "
            f"share to be a multiple of {block}, but {n} over {tp.size} ranks is "
            f"{n / tp.size:g} a rank (a shard boundary would split a block)"
        )


def make_fp8_weight(
    lead: tuple[int, ...], n: int, k: int, quant: QuantizationConfig, *, per_row: bool
) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty (weight [*lead, n, k] e4m3, scale [*lead, rows, ceil(k/128)] fp32) parameters on
    the current default device."""
    rows = n if per_row else _blocks(n, quant.block_n)
    weight = nn.Parameter(torch.empty(*lead, n, k, dtype=FP8_DTYPE), requires_grad=False)
    scale = nn.Parameter(
        torch.empty(*lead, rows, _blocks(k, quant.block_k), dtype=torch.float32),
        requires_grad=False,
    )
    return weight, scale


def copy_block_rows(
    weight: torch.Tensor,
    scale: torch.Tensor,
    loaded: torch.Tensor,
    loaded_scale: torch.Tensor | None,
    row_start: int,
    quant: QuantizationConfig,
    *,
    per_row: bool,
) -> None:
    """Write checkpoint tensor `loaded` [n, k] (e4m3 with `loaded_scale` [ceil(n/128), Kb], or
    float with None) into rows [row_start, row_start + n) of weight [N, K] / scale [rows, Kb].

    Raises ValueError (the loader adds the tensor's name) on a scale of the wrong shape."""
    n, k = loaded.shape
    if loaded.dtype != FP8_DTYPE:
        loaded, loaded_scale = quantize_weight_block(
            loaded.to(weight.device), quant.weight_block_size
        )
    if loaded_scale is None:
        raise ValueError("FP8 weight loaded without its block scale")
    expected = block_scale_shape(n, k, quant)
    if tuple(loaded_scale.shape) != expected:
        raise ValueError(
            f"block scale shape {list(loaded_scale.shape)} does not match the weight's "
            f"{list(expected)} blocks (ceil({n}/128) x ceil({k}/128))"
        )
    weight[row_start : row_start + n].copy_(loaded)
    if per_row:
        scale[row_start : row_start + n].copy_(expand_scale_rows(loaded_scale, n, quant.block_n))
        return
    if row_start % quant.block_n:  # internal: per_row is chosen whenever a seam is unaligned
        raise AssertionError(f"row {row_start} is not on a {quant.block_n}-row block boundary")
    first = row_start // quant.block_n
    scale[first : first + expected[0]].copy_(loaded_scale)
