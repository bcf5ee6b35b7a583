"""Linear layers that know how they would be split for tensor parallelism (TP).

Every layer takes a `TensorParallel(rank, size, group)` (`NO_TP`: one rank) and gives its
parameters a `weight_loader(param, loaded, ...)`. `loaded` is a `CheckpointTensor`
(`model/checkpoint_tensor.py`): the whole checkpoint tensor's shape, nothing read yet; the loader
narrows it to this rank's shard and `load()`s that alone (a rank never reads another's slice):

    ReplicatedLinear            every rank holds the whole [out, in] weight
    MergedReplicatedLinear      several replicated outputs stored side by side (q_a|kv_a)
    ColumnParallelLinear        output dim split: rank r holds rows   [r*out/tp, (r+1)*out/tp)
    MergedColumnParallelLinear  several column-parallel outputs stored side by side (gate|up)
    RowParallelLinear           input dim split: rank r holds columns [r*in/tp, (r+1)*in/tp);
                                the partial outputs are summed across ranks (all-reduce)

The collectives (`mlaserve/tensor_parallel.py`) run through the layer's `TensorParallel`: the
row-parallel output's all-reduce here, the rest in the layers that own them (MoE, embedding).
A weight whose full shape is wrong raises `ValueError` naming expected and got shapes; the
loader (`model/loader.py`) turns that into a `WeightLoadError` naming the checkpoint key.

Built with `quant` (a `QuantizationConfig`), a layer keeps its weight in FP8 with 128 x 128
block scales (`weight_scale_inv`, layout in `fp8_linear.py`) and runs `block_fp8_linear`; its
checkpoint tensor then carries its block scale, and narrowing it to the rank's slice narrows the
scale alike. A split that would cut a 128-block is a ValueError at construction naming the layer
class and the dimension (and `CheckpointTensor.narrow` checks it again at load).

Decode-sized inputs (at most `gemv_max_m` tokens; shapes are fixed per captured graph, so this
is decided on the host) take `ops.gemv` on CUDA: one launch that streams the weight once, where
an FP8 weight otherwise costs four launches at M = 1. The limits per weight kind are measured
(`bench/gemv.py`); `MLASERVE_GEMV_MAX_M` / `MLASERVE_GEMV_MAX_M_FP8` override them (README,
"Switches").

Built with `deterministic=True` (`EngineConfig.deterministic_inference`), a layer instead runs
`ops.invariant_matmul` at every size (no GEMV, cuBLAS or block-FP8 GEMM chosen by M): each
token's output bits then depend on its own row alone; off CUDA its torch form, one row at a time.
A row-parallel layer there sums its K in the fixed tree of `ops/invariant_rowwise.py`
(`TREE_LEAVES` chunks of the whole K; this rank's `tp.tree_leaves` of them in the kernel, the
ranks' subtrees by `tree_all_reduce`), even on one rank: its bits do not depend on the TP size.
Column-parallel and replicated layers need nothing more (a column's sum never crosses ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve import switches
from mlaserve.config import QuantizationConfig
from mlaserve.model.checkpoint_tensor import CheckpointTensor
from mlaserve.model.layers.fp8_linear import (
    check_block_aligned,
    copy_block_rows,
    make_fp8_weight,
    needs_per_row_scales,
)
from mlaserve.ops import fused_ops_enabled
from mlaserve.ops.fp8_gemm import block_fp8_linear
from mlaserve.ops.invariant_rowwise import TREE_LEAVES, leaf_width
from mlaserve.tensor_parallel import (
    NO_TP,
    RankPartials,
    TensorParallel,
    all_reduce,
    tree_all_reduce,
)

__all__ = [
    "NO_TP",
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "MergedReplicatedLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "TensorParallel",
    "all_reduce",
    "check_shape",
    "default_weight_loader",
    "wide_linear",
]


# Tokens up to which a linear runs `ops.gemv` on CUDA (`gemv_max_m`), from bench/gemv.py
# (bench/RESULTS.md): against cuBLAS (bf16) the GEMV wins at 1-2 tokens and loses from 4 on,
# except on narrow outputs (N <= 1024: the router, kv_a) where it wins to 4, and to 8 with
# K <= 4096; against block_fp8_linear's W8A16 kernel it wins at one token, and at 2 up to
# N = 4096 (V3's q|kv_a, whose 66 W8A16 programs leave half the SMs idle). With no split over K,
# a very long K (V3's o_proj, K = 16384) leaves too few programs streaming: there the GEMMs win
# even at one token.
GEMV_MAX_M = 2
GEMV_MAX_M_FP8 = 1
GEMV_MAX_M_FP8_UP_TO_4096 = 2  # FP8, N <= 4096
GEMV_MAX_M_NARROW = 4  # N <= GEMV_NARROW_N, either kind
GEMV_MAX_M_NARROW_SHORT_K = 8  # ... and K <= GEMV_SHORT_K
GEMV_NARROW_N = 1024
GEMV_SHORT_K = 4096
GEMV_MAX_K = 8192


def narrow_gemv_max_m(k: int) -> int:
    """Tokens up to which a narrow output (N <= GEMV_NARROW_N) takes the GEMV, by K."""
    return GEMV_MAX_M_NARROW_SHORT_K if k <= GEMV_SHORT_K else GEMV_MAX_M_NARROW


def gemv_max_m(weight: torch.Tensor) -> int:
    """Tokens up to which a linear with `weight` [N, K] takes `ops.gemv` (0: never): CUDA with
    the fused ops on; the measured limits above, or `MLASERVE_GEMV_MAX_M(_FP8)`."""
    if not fused_ops_enabled(weight.device):
        return 0
    fp8 = weight.dtype == torch.float8_e4m3fn
    override = switches.gemv_max_m(fp8)
    if override is not None:
        return override
    n, k = weight.shape[-2:]
    if k > GEMV_MAX_K:
        return 0
    if n <= GEMV_NARROW_N:
        return narrow_gemv_max_m(k)
    if fp8:
        return GEMV_MAX_M_FP8_UP_TO_4096 if n <= 4096 else GEMV_MAX_M_FP8
    return GEMV_MAX_M


def wide_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias) -> [..., N] fp32, the accumulator never rounded to
    x's dtype: cuBLAS's fp32-output GEMM for 16-bit operands on CUDA (`torch.mm`'s out_dtype),
    the operands widened (exact) elsewhere."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        x2 = x.reshape(-1, x.shape[-1])
        # N named, not -1: a step with no logit rows (a middle prefill chunk) has 0 rows
        y = torch.mm(x2, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], weight.shape[0])
    else:
        y = F.linear(x.float(), weight.float())
    return y if bias is None else y + bias.float()


def check_shape(loaded: CheckpointTensor, expected: tuple[int, ...] | torch.Size) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape mismatch: expected {list(expected)}, got {list(loaded.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: CheckpointTensor) -> None:
    """Replicated parameter: read the whole tensor (cast to the parameter's dtype/device)."""
    check_shape(loaded, param.shape)
    param.data.copy_(loaded.load())


def _shard(loaded: CheckpointTensor, dim: int, tp: TensorParallel) -> CheckpointTensor:
    """This rank's equal share of `loaded` along `dim` (nothing read)."""
    size = loaded.shape[dim] // tp.size
    return loaded.narrow(dim, tp.rank * size, size)


class _Linear(nn.Module):
    """y = x @ W.T (+ b), W [out_local, in_local] in `params_dtype` on the current device.

    `split_dim` is the weight dimension divided over TP ranks (None: replicated). With `quant`,
    W is [out, in] float8_e4m3fn plus `weight_scale_inv` (see `fp8_linear.py`)."""

    split_dim: ClassVar[int | None] = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        out_local = tp.split(out_features, "out_features") if self.split_dim == 0 else out_features
        in_local = tp.split(in_features, "in_features") if self.split_dim == 1 else in_features
        self.quant = quant
        self.weight_scale_inv: nn.Parameter | None = None
        if quant is None:
            self.weight = nn.Parameter(
                torch.empty(out_local, in_local, dtype=params_dtype), requires_grad=False
            )
            self.weight.weight_loader = self.weight_loader
        else:
            name = f"{type(self).__name__}(in={in_features}, out={out_features})"
            if self.split_dim == 0:
                for size in self.stacked_sizes():
                    check_block_aligned(size, tp, quant.block_n, f"{name} out_features")
            elif self.split_dim == 1:
                check_block_aligned(in_features, tp, quant.block_k, f"{name} in_features")
            self.per_row_scales = needs_per_row_scales(self.local_sizes(), quant)
            self.weight, self.weight_scale_inv = make_fp8_weight(
                (), out_local, in_local, quant, per_row=self.per_row_scales
            )
            self.weight.weight_loader = self.fp8_weight_loader
        self.gemv_max_m = gemv_max_m(self.weight)
        self._invariant = None  # the deterministic mode's matmul, at every size
        if deterministic and self.split_dim == 1:  # K in the tree's chunks of the whole K
            name = f"{type(self).__name__}(in={in_features}): K"
            leaf_width(in_features, TREE_LEAVES, name, fp8=quant is not None)
        if deterministic:
            from mlaserve.ops.invariant_rowwise import rowwise_matmul

            self._invariant = rowwise_matmul
            if fused_ops_enabled(self.weight.device):
                from mlaserve.ops.invariant_matmul import invariant_matmul

                self._invariant = invariant_matmul
            self.gemv_max_m = 0
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_local, dtype=params_dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader

    def stacked_sizes(self) -> list[int]:
        """Output rows of each checkpoint tensor stored in the weight, in order."""
        return [self.out_features]

    def local_sizes(self) -> list[int]:
        """`stacked_sizes` as this rank stores them (split over the ranks when column-parallel)."""
        split = self.split_dim == 0
        return [n // self.tp.size if split else n for n in self.stacked_sizes()]

    def matmul(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [..., in] -> [..., out] in `out_dtype` (default x's): F.linear, or the block-FP8 GEMM
        for an FP8 weight; the GEMV for decode-sized x; the invariant matmul in the deterministic
        mode. fp32 `out_dtype` keeps the fp32 accumulator unrounded (`wide_linear`)."""
        if self._invariant is not None:
            return self._invariant(x, self.weight, self.weight_scale_inv, bias, out_dtype)
        if x.numel() <= self.gemv_max_m * x.shape[-1] and x.numel():
            from mlaserve.ops.gemv import gemv

            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            y = gemv(x2, self.weight, self.weight_scale_inv, out_dtype=out_dtype)
            y = y.view(*x.shape[:-1], -1)
            return y if bias is None else y + bias
        if self.weight_scale_inv is None:
            if out_dtype in (None, x.dtype):
                return F.linear(x, self.weight, bias)
            return wide_linear(x, self.weight, bias)
        return block_fp8_linear(x, self.weight, self.weight_scale_inv, bias, out_dtype=out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The GEMV's compiles for every token bucket up to `gemv_max_m` (activations in
        `act_dtype`), and an FP8 weight's block-FP8 GEMMs' at every size past it
        (`fp8_gemm_warm_up_tasks`), a task each (`model/kernel_warm_up.py`), for before
        serving. None in the deterministic mode (its own matmul)."""
        if self._invariant is not None:
            return []
        # a row-parallel layer's partial sums leave the GEMMs in fp32 (`wide_partials`)
        wide = self.split_dim == 1 and self.tp.wide_partials
        out_dtype = torch.float32 if wide else None
        tasks: list[Callable[[], None]] = []
        if self.gemv_max_m:
            from mlaserve.ops.gemv import gemv_warm_up_tasks

            tasks += gemv_warm_up_tasks(
                self.weight, self.weight_scale_inv, self.gemv_max_m, act_dtype, out_dtype
            )
        if self.weight_scale_inv is not None:
            from mlaserve.ops.fp8_gemm import fp8_gemm_warm_up_tasks

            tasks += fp8_gemm_warm_up_tasks(
                self.weight, self.weight_scale_inv, act_dtype, out_dtype
            )
        return tasks

    def fp8_weight_loader(
        self,
        param: nn.Parameter,
        loaded: CheckpointTensor,
        shard_id: int | None = None,
    ) -> None:
        """FP8 weight: `loaded` [n, in] e4m3 with its block scale (or a float tensor, which is
        quantised here); `shard_id` picks the stacked tensor (gate/up) it is. Under TP the
        rank's slice of the weight and of its scale are read (block-aligned: checked at
        construction)."""
        assert self.quant is not None and self.weight_scale_inv is not None  # internal
        sizes = self.stacked_sizes()
        index = 0 if shard_id is None else shard_id
        check_shape(loaded, (sizes[index], self.in_features))
        if self.split_dim is not None and self.tp.size > 1:
            loaded = _shard(loaded, self.split_dim, self.tp)
        copy_block_rows(
            param.data,
            self.weight_scale_inv.data,
            loaded.load(),
            loaded.load_scale(),
            sum(self.local_sizes()[:index]),
            self.quant,
            per_row=self.per_row_scales,
        )

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """`loaded` is the whole checkpoint tensor, unread; read this rank's slice of it."""
        is_bias = param.dim() == 1
        check_shape(
            loaded, (self.out_features,) if is_bias else (self.out_features, self.in_features)
        )
        dim = self.split_dim if not is_bias else (0 if self.split_dim == 0 else None)
        param.data.copy_((loaded if dim is None else _shard(loaded, dim, self.tp)).load())

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.rank}/{self.tp.size}"


class ReplicatedLinear(_Linear):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(_Linear):
    """Output features split over ranks; each rank's output is its slice (no gather)."""

    split_dim = 0


class _StackedOutputs(_Linear):
    """Outputs of several checkpoint tensors that read the same input, stored one after another
    so one GEMM computes them all. The loader is called once per checkpoint tensor with its
    `shard_id` (index into `output_sizes`); in a column-parallel layer each tensor's rows are
    split over the ranks, in a replicated one they are kept whole."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        if self.split_dim == 0:
            for size in output_sizes:
                tp.split(size, f"{type(self).__name__} output size")
        self.output_sizes = list(output_sizes)
        super().__init__(
            in_features, sum(output_sizes), params_dtype=params_dtype, tp=tp, quant=quant,
            deterministic=deterministic,
        )  # fmt: skip

    def stacked_sizes(self) -> list[int]:
        return list(self.output_sizes)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: int
    ) -> None:
        check_shape(loaded, (self.output_sizes[shard_id], self.in_features))
        split = self.split_dim == 0
        local = [size // self.tp.size if split else size for size in self.output_sizes]
        rows = param.data.narrow(0, sum(local[:shard_id]), local[shard_id])
        rows.copy_((_shard(loaded, 0, self.tp) if split else loaded).load())


class MergedReplicatedLinear(_StackedOutputs, ReplicatedLinear):
    """Replicated stacked outputs: MLA's `q_a_proj | kv_a_proj_with_mqa` (SGLang's
    `fused_qkv_a_proj_with_mqa`)."""


class MergedColumnParallelLinear(_StackedOutputs, ColumnParallelLinear):
    """Column-parallel stacked outputs, e.g. `gate_up_proj` = [gate_proj; up_proj]."""


class RowParallelLinear(_Linear):
    """Input features split over ranks; partial outputs are summed across ranks.

    `reduce_output=False` leaves the sum to the caller (the MoE block reduces routed and shared
    experts together, once)."""

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        reduce_output: bool = True,
        quant: QuantizationConfig | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__(
            in_features, out_features, bias=bias, params_dtype=params_dtype, tp=tp, quant=quant,
            deterministic=deterministic,
        )  # fmt: skip
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in / tp] -> [T, out]: x's dtype; with `reduce_output=False` and
        `tp.wide_partials` (or the deterministic mode), fp32 (a partial sum for the caller to
        reduce)."""
        if self._invariant is not None:
            return self._forward_invariant(x)
        if not self.tp.wide_partials:
            y = self.matmul(x)
            if self.reduce_output:
                y = all_reduce(y, self.tp)
        else:
            # The partial sums leave their GEMM in fp32 and are summed in fp32: the one rounding
            # is of the whole sum, as on one rank (TP1's bits up to fp32 summation order).
            y = self.matmul(x, out_dtype=torch.float32)
            if not self.reduce_output:
                return y  # the bias is the caller's too (none of DeepSeek's has one)
            y = all_reduce(y, self.tp).to(x.dtype)
        # NOTE: the bias is added once, after the sum over ranks.
        return y if self.bias is None else y + self.bias

    def forward_partials(self, x: torch.Tensor) -> torch.Tensor | RankPartials:
        """`forward(x)`, but where a reduced output would be summed over the ranks in fp32
        (`tp.wide_partials`, on CUDA, no bias, not the deterministic mode) this rank's fp32
        partial sum as `RankPartials` [T, 1, out]: the all-reduce left to the residual-add +
        RMSNorm that takes it next (`RMSNorm.forward_with_residual`)."""
        deferred = (
            self.reduce_output
            and self.tp.wide_partials
            and self._invariant is None
            and self.bias is None
            and x.is_cuda
        )
        if not deferred:
            return self(x)
        y = self.matmul(x, out_dtype=torch.float32)
        return RankPartials(y.view(y.shape[0], 1, y.shape[1]), x.dtype, self.tp)

    def _forward_invariant(self, x: torch.Tensor) -> torch.Tensor:
        """The deterministic mode: this rank's subtree of the K sum (fp32), the ranks' by
        `tree_all_reduce`, rounded once; fp32 unreduced with `reduce_output=False`."""
        assert self._invariant is not None  # internal: deterministic only
        whole = self.reduce_output and self.tp.size == 1  # the kernel rounds the root itself
        y = self._invariant(
            x, self.weight, self.weight_scale_inv, None, None if whole else torch.float32,
            leaves=self.tp.tree_leaves,
        )  # fmt: skip
        if not self.reduce_output:
            return y
        if not whole:
            y = tree_all_reduce(y, self.tp).to(x.dtype)
        return y if self.bias is None else y + self.bias
