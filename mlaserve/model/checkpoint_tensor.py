"""A checkpoint tensor not read yet: what every weight loader receives.

The loader (`loader.py`) hands each parameter's `weight_loader` a `CheckpointTensor` over
`safe_open(...).get_slice(key)`; the layer narrows it to the part this rank keeps and calls
`load()`, which reads that region alone. So a tensor-parallel rank reads its shards of the
safetensors and never the whole tensor (issue 42, item 5):

    t.shape                      the region's shape (the whole tensor's until narrowed)
    t.narrow(dim, start, length) a sub-region; nothing is read
    t.select(index)              one index of dim 0, dropped (fused experts [E, ...] -> one)
    t.load()                     read the region -> CPU tensor (an FP8 weight dequantised to
                                 fp32 when `dequantize`)
    t.load_scale()               an FP8 weight kept FP8: its region's block scale, fp32

FP8 block weights (2-D e4m3 [N, K], block scale [ceil(N/128), ceil(K/128)] float): the weight
carries its scale, and narrowing the weight narrows the scale with it. Kept FP8 (`dequantize`
off: the layer stores e4m3 and the block scales) a region must start on a 128 boundary and end
on one or at the tensor's end; otherwise `narrow` raises ValueError: a shard boundary would
split a block. Dequantised (a float layer: CPU runs, kv_b_proj, eh_proj) any region works: the
read widens to whole blocks, dequantises and trims, so at most one block per edge is read past
the region. The scale's values (finite, > 0) are checked where they are read.

`ReadStats` counts the bytes each `load()` / `load_scale()` read (the loader logs GB/s per rank
from it; reader threads share one, so it counts under a lock). `CheckpointTensor.from_tensor`
wraps an in-memory tensor (tests, re-exports).

With a `stager` (`weight_stager.py`; the staged loader on CUDA) `load()` / `load_scale()`
return device tensors whose copies are enqueued, not finished: the layer's `param.copy_` from
them is ordered after on the same stream. Without one they return CPU tensors (a view of the
mapped file in the staged loader: the layer copies it, never writes it). A scale's values are
checked on the CPU either way; an FP8 weight that is dequantised is dequantised where it lands.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mlaserve.model.weight_stager import WeightStager
from mlaserve.ops.fp8_quant import dequantize_weight_block
from mlaserve.tensor_parallel import TensorParallel

__all__ = ["CheckpointTensor", "ReadStats", "log_rank_reads"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ReadStats:
    """Bytes and tensors read from the checkpoint, summed over every `load`; `seconds`: the
    whole load's wall time (set by the loader)."""

    bytes: int = 0
    reads: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)

    def add(self, t: torch.Tensor) -> None:
        with self._lock:
            self.bytes += t.numel() * t.element_size()
            self.reads += 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CheckpointTensor:
    """A region of one checkpoint tensor (`source`: a safetensors slice, or a tensor), read on
    `load()`. `scale`: an FP8 weight's block-scale source (2-D weights only); `dequantize`:
    `load()` returns the weight dequantised to fp32 (otherwise e4m3 plus `load_scale()`)."""

    def __init__(
        self,
        source: Any,
        shape: Sequence[int],
        *,
        name: str = "tensor",
        scale: Any = None,
        scale_name: str = "",
        block: tuple[int, int] = (128, 128),
        dequantize: bool = False,
        stats: ReadStats | None = None,
        stager: WeightStager | None = None,
    ) -> None:
        self._source, self._full = source, tuple(int(n) for n in shape)
        self.name = name
        self._scale, self._scale_name, self._block = scale, scale_name or f"{name} scale", block
        self.dequantize = dequantize
        self._stats = stats if stats is not None else ReadStats()
        self._stager = stager
        self._region: tuple[tuple[int, int], ...] = tuple((0, n) for n in self._full)
        self._dropped: tuple[int, ...] = ()  # source dims removed by `select`
        if scale is not None and len(self._full) != 2:
            raise ValueError(f"{name}: block scales need a 2-D weight, got {list(self._full)}")

    @classmethod
    def from_tensor(
        cls, tensor: torch.Tensor, scale: torch.Tensor | None = None, *, dequantize: bool = False
    ) -> CheckpointTensor:
        """An in-memory tensor (with its block scale, for an FP8 one) as a loader takes it."""
        return cls(tensor, tensor.shape, scale=scale, dequantize=dequantize)

    # ----- the region -----

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for d, (a, b) in enumerate(self._region) if d not in self._dropped)

    @property
    def is_fp8(self) -> bool:
        """An FP8 block weight (it carries a scale)."""
        return self._scale is not None

    def _source_dim(self, dim: int) -> int:
        kept = [d for d in range(len(self._full)) if d not in self._dropped]
        return kept[dim]

    def _copy(self) -> CheckpointTensor:
        new = object.__new__(CheckpointTensor)
        new.__dict__.update(self.__dict__)
        return new

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """Rows [start, start + length) along `dim` of this region (torch's `narrow`); nothing
        read. Kept FP8: raises ValueError where the region would split a scale block."""
        ndim = len(self.shape)
        dim = dim + ndim if dim < 0 else dim
        if not 0 <= dim < ndim or start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: narrow({dim}, {start}, {length}) is outside {list(self.shape)}"
            )
        src = self._source_dim(dim)
        lo = self._region[src][0] + start
        hi = lo + length
        if self.is_fp8 and not self.dequantize:
            block = self._block[src]
            if lo % block or (hi % block and hi != self._full[src]):
                raise ValueError(
                    f"{self.name}: FP8 {self._block[0]}x{self._block[1]} block weight "
                    f"{list(self._full)}: rows [{lo}, {hi}) of dim {src} would split a "
                    f"{block}-wide scale block (a shard boundary must fall on a block boundary)"
                )
        new = self._copy()
        new._region = (*self._region[:src], (lo, hi), *self._region[src + 1 :])
        return new

    def select(self, index: int) -> CheckpointTensor:
        """Index `index` of dim 0, the dim dropped (a fused [E, ...] tensor -> expert `index`)."""
        if self.is_fp8:
            raise ValueError(f"{self.name}: an FP8 block weight is 2-D; select() is for stacks")
        new = self.narrow(0, index, 1)
        new._dropped = (*self._dropped, self._source_dim(0))
        return new

    # ----- reading -----

    def _read(self, source: Any, region: Sequence[tuple[int, int]]) -> torch.Tensor:
        t = source[tuple(slice(a, b) for a, b in region)]
        self._stats.add(t)
        return t

    def _drop(self, t: torch.Tensor) -> torch.Tensor:
        for d in sorted(self._dropped, reverse=True):
            t = t.squeeze(d)
        return t

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._stager is None else self._stager.to_device(t)

    def load(self) -> torch.Tensor:
        """Read the region: the checkpoint's dtype, or fp32 for an FP8 weight `dequantize`d."""
        if not (self.is_fp8 and self.dequantize):
            return self._to_device(self._drop(self._read(self._source, self._region)))
        # Widen to whole blocks, dequantise, trim: any region of a float layer's weight works.
        wide = [
            (lo // blk * blk, min(_cdiv(hi, blk) * blk, n))
            for (lo, hi), blk, n in zip(self._region, self._block, self._full, strict=True)
        ]
        w = self._to_device(self._read(self._source, wide))
        s = self._to_device(self._read_scale(wide))
        full = dequantize_weight_block(w, s)
        (r0, r1), (c0, c1) = self._region
        return full[r0 - wide[0][0] : r1 - wide[0][0], c0 - wide[1][0] : c1 - wide[1][0]]

    def load_scale(self) -> torch.Tensor | None:
        """The block scale of the region (fp32), or None for a float tensor. The region is
        block-aligned (`narrow` checked it)."""
        if not self.is_fp8:
            return None
        return self._to_device(self._read_scale(self._region))

    def _read_scale(self, region: Sequence[tuple[int, int]]) -> torch.Tensor:
        blocks = [
            (lo // blk, _cdiv(hi, blk)) for (lo, hi), blk in zip(region, self._block, strict=True)
        ]
        scale = self._read(self._scale, blocks).float()
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bad.any():
            value = scale[bad][0].item()
            raise ValueError(
                f"{self._scale_name}: block scale is corrupt ({int(bad.sum())} values not "
                f"finite and > 0, e.g. {value})"
            )
        return scale

    def __repr__(self) -> str:
        kind = "fp8 block" if self.is_fp8 else "tensor"
        return f"CheckpointTensor({self.name}, {kind}, region {list(self._region)})"


def log_rank_reads(reads: ReadStats | None, tp: TensorParallel, group: object) -> None:
    """Rank 0 logs every rank's checkpoint bytes and GB/s (the workers log at WARNING only);
    every rank of `tp` calls this: an all-gather over `group`, the control
    group."""
    import torch.distributed as dist

    mine = torch.tensor([getattr(reads, "bytes", 0), int(getattr(reads, "seconds", 0.0) * 1e6)])
    parts = [torch.zeros_like(mine) for _ in range(tp.size)]
    dist.all_gather(parts, mine, group=group)
    if tp.rank == 0 and reads is not None:
        logger.info("weights per rank: %s", ", ".join(
            f"rank {r} {int(b) / 1e9:.2f} GB in {int(us) / 1e6:.2f} s "
            f"({int(b) / 1e3 / max(int(us), 1):.2f} GB/s)"
            for r, (b, us) in enumerate(p.tolist() for p in parts)
        ))  # fmt: skip
