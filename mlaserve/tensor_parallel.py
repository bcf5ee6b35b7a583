"""The tensor-parallel (TP) group and the collectives the model layers call through it.

    tp = init_tensor_parallel(rank, size, backend="gloo", init_method="tcp://127.0.0.1:29500")
    y = tp.all_reduce(partial)          # sum over ranks (RowParallelLinear, MoE, embedding)
    logits = tp.all_gather(local, -1)   # concatenated along a dim (vocab-parallel LM head)
    y = tp.tree_all_reduce(subtree)     # the deterministic mode's sum: the same bits at any TP
    tp.broadcast(ids, src=0)            # rank `src`'s tensor on every rank
    destroy_tensor_parallel(tp)

`TensorParallel(rank, size, group)` is this process's place in the group: frozen, cheap, passed
to every layer at construction. `group` is a `torch.distributed.ProcessGroup` (None: the
default group). `NO_TP` is the single-rank default: its collectives return their input and make
no torch.distributed call, so one-GPU serving never initialises torch.distributed.

torch.distributed underneath: gloo on CPU (the CI tests), NCCL on CUDA; the same calls. Nothing
here sets an NCCL option (NVLink multicast stays off: the machines set `NCCL_NVLS_ENABLE=0`).
On CUDA, `init_tensor_parallel` also sets up the custom all-reduce (custom_all_reduce.py: torch
symmetric memory's one-shot / two-shot kernels for decode sizes, chosen by measured byte
thresholds); `all_reduce` gives it the CUDA tensors it takes and NCCL the rest. Where symmetric
memory is unavailable every size goes to NCCL (the reason is logged). Both paths can be captured
in a CUDA graph (tests/test_custom_all_reduce_gpu.py replays them against NCCL). A group that
spans nodes (`--nnodes` > 1) has no custom all-reduce: symmetric memory is within a node, so
NCCL takes every size there.

`RankPartials` is a row-parallel or MoE output whose all-reduce is left to the residual-add +
RMSNorm after it (`model/layers/norm.py`), which hands it to `reduce_add_rms_norm`: one kernel
for both where the custom all-reduce's fused path takes the size (custom_all_reduce.py), else
None and the norm all-reduces (`RankPartials.all_reduced`) and normalises as before.

`tree_all_reduce` is the deterministic mode's all-reduce: an all-gather of the ranks' fp32
subtree sums and the summation tree's top levels on every rank (`ops/invariant_rowwise.py`,
`TREE_LEAVES`), never a collective's own order, so its bits do not depend on the TP size.

Imports only custom_all_reduce.py, switches.py, the torch form of the summation tree
(ops/invariant_rowwise.py) and the MoE's partials (ops/moe_partials.py, a leaf) from mlaserve,
so every layer from config/ up may hold a `TensorParallel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from mlaserve import switches
from mlaserve.custom_all_reduce import CustomAllReduce
from mlaserve.ops.invariant_rowwise import TREE_LEAVES, tree_sum
from mlaserve.ops.moe_partials import MoePartials

__all__ = [
    "NO_TP",
    "RankPartials",
    "TensorParallel",
    "all_gather",
    "all_reduce",
    "broadcast",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "reduce_add_rms_norm",
    "subtree_leaves",
    "tree_all_reduce",
]


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: `rank` of `size`, over `group` (a
    torch.distributed ProcessGroup; None: the default group), and the group's custom all-reduce
    (None: NCCL / gloo for every size). Compared by rank, size and `expert_parallel` only.
    `expert_parallel` (`--enable-expert-parallel`): the MoE layers keep
    whole routed experts per rank over this group instead of splitting each (`model/layers/moe.py`);
    the collectives are the same. `fp32_reduce`: see `wide_partials`."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    custom: CustomAllReduce | None = field(default=None, compare=False, repr=False)
    expert_parallel: bool = False
    fp32_reduce: bool = field(default=True, compare=False)

    @property
    def wide_partials(self) -> bool:
        """Whether the partial sums the ranks all-reduce (row-parallel outputs, the MoE's routed
        + shared sum) leave their kernels in fp32, are summed in fp32 and rounded once, as one
        rank rounds its whole sum (`MLASERVE_TP_FP32_REDUCE`, on by default): TP1's bits up to
        fp32 summation order. Off, each rank rounds its partial to the model dtype first."""
        return self.size > 1 and self.fp32_reduce

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor parallel: need 0 <= rank < size, got {self.rank}/{self.size}")

    def split(self, n: int, what: str) -> int:
        """Per-rank share of `n`, which must divide evenly (`what` names it in the error)."""
        if n % self.size:
            raise ValueError(f"{what}: {n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(x, self)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return all_gather(x, self, dim)

    def tree_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return tree_all_reduce(x, self)

    @property
    def tree_leaves(self) -> int:
        """Leaves of the deterministic mode's summation tree this rank holds (its subtree)."""
        return subtree_leaves(self.size)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return broadcast(x, self, src)


NO_TP = TensorParallel()  # a single rank: the default everywhere


def _check_initialized(tp: TensorParallel) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"tensor parallel rank {tp.rank}/{tp.size}: torch.distributed is not initialised "
            "(init_tensor_parallel first)"
        )


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of `x` over the TP ranks, on every rank (same shape and dtype); callers read it only
    through the result. A CUDA tensor the custom all-reduce takes (decode sizes) comes back as a
    new tensor; otherwise NCCL / gloo reduce in place when `x` is contiguous (the callers'
    partial sums are fresh GEMM outputs): no extra buffer. Identity on one rank."""
    if tp.size == 1:
        return x
    _check_initialized(tp)
    if tp.custom is not None and tp.custom.handles(x):
        return tp.custom.all_reduce(x)
    x = x.contiguous()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp.group)
    return x


class RankPartials(NamedTuple):
    """This rank's share of a sum over the tensor-parallel ranks, not yet all-reduced: the
    layer's output is the sum over the ranks of `parts` summed over its slots in order (fp32),
    rounded once to `dtype`. Made on CUDA by the layers whose output a residual-add + RMSNorm
    takes next (row-parallel `o_proj` / `down_proj`, the MoE), under `tp.wide_partials`."""

    parts: torch.Tensor  # [T, slots, N] fp32, contiguous
    dtype: torch.dtype
    tp: TensorParallel

    def all_reduced(self) -> torch.Tensor:
        """[T, N] fp32: the slots summed in order, then all-reduced (not rounded)."""
        num_tokens, slots, n = self.parts.shape
        own = self.parts if slots == 1 else MoePartials(self.parts, self.dtype).total(torch.float32)
        return all_reduce(own.reshape(num_tokens, n), self.tp)


def reduce_add_rms_norm(
    x: RankPartials, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The all-reduce of `x` fused with the residual-add + RMSNorm after it (custom_all_reduce.
    py's `all_reduce_add_rms_norm`): (normed, new residual), or None where that path does not
    take the size (then the caller all-reduces and normalises). The same answer on every rank."""
    custom = x.tp.custom
    if custom is None or not custom.handles_norm(x.parts):
        return None
    return custom.all_reduce_add_rms_norm(x.parts, residual, weight, eps)


def all_gather(x: torch.Tensor, tp: TensorParallel, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` (same shape on all ranks) concatenated along `dim` in rank order, on
    every rank: [..., n, ...] -> [..., size * n, ...]. Identity on one rank."""
    if tp.size == 1:
        return x
    _check_initialized(tp)
    x = x.contiguous()
    d = dim % x.dim()
    # Rank r's x at rows [r n, (r + 1) n) of one buffer (the form gloo takes too), then moved
    # into place: a view where the gathered dim leads or every dim before it has size 1 (dim 0;
    # the LM head's one row a step), one copy otherwise (what a cat of the parts costs).
    flat = x.new_empty((tp.size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(flat, x, group=tp.group)
    return flat.view(tp.size, *x.shape).movedim(0, d).flatten(d, d + 1)


def subtree_leaves(size: int) -> int:
    """TREE_LEAVES / size: the leaves each of `size` ranks holds; ValueError where `size` does
    not divide TREE_LEAVES."""
    if size < 1 or TREE_LEAVES % size:
        raise ValueError(
            f"tensor parallel size {size}: the deterministic mode's summation tree has "
            f"{TREE_LEAVES} leaves, which the size must divide (1, 2, 4 or 8)"
        )
    return TREE_LEAVES // size


def tree_all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The deterministic mode's sum over the ranks: `x` [...] fp32 is this rank's subtree sum
    (its `tp.tree_leaves` consecutive leaves, `ops/invariant_rowwise.py`); the ranks' subtrees
    are all-gathered in rank order and summed in the tree's top levels (`tree_sum`) on every
    rank: [...] fp32, the same bits as one rank summing all the leaves. Identity on one rank."""
    if tp.size == 1:
        return x
    if x.dtype != torch.float32:
        raise ValueError(f"tree_all_reduce: subtree sums are fp32, got {x.dtype}")
    subtree_leaves(tp.size)
    return tree_sum(all_gather(x.unsqueeze(0), tp, dim=0))


def broadcast(x: torch.Tensor, tp: TensorParallel, src: int = 0) -> torch.Tensor:
    """TP rank `src`'s `x`, written into `x` on every other rank (same shape and dtype there);
    returns `x`. Identity on one rank."""
    if tp.size == 1:
        return x
    _check_initialized(tp)
    if not 0 <= src < tp.size:
        raise ValueError(f"broadcast: src {src} is not a rank of {tp.size}")
    # torch.distributed names the source by its global rank
    global_src = src if tp.group is None else dist.get_global_rank(tp.group, src)
    if x.is_contiguous():
        dist.broadcast(x, global_src, group=tp.group)
        return x
    buf = x.contiguous()
    dist.broadcast(buf, global_src, group=tp.group)
    return x.copy_(buf)


def init_tensor_parallel(
    rank: int,
    size: int,
    *,
    backend: str,
    init_method: str | None = None,
    timeout_s: float = 60.0,
    store: Any = None,
    single_node: bool = True,
) -> TensorParallel:
    """Join the default process group as `rank` of `size` (every process calls this) and return
    its `TensorParallel` over it. `backend`: "gloo" (CPU) or "nccl" (CUDA); the rendezvous: an
    `init_method` ("tcp://host:port" or "file://path") or a torch.distributed `store`.
    `timeout_s` bounds every collective, so a rank that dies makes the others raise instead of
    hang. With "nccl" the caller has set this rank's device (`torch.cuda.set_device`) first: the
    custom all-reduce's symmetric buffer is made there (a collective over the group; None and
    NCCL alone where it cannot be). `single_node` False (the group spans nodes): no custom
    all-reduce, since symmetric memory maps peers' buffers within one node only; NCCL takes
    every size, across the nodes' network."""
    from datetime import timedelta

    if size == 1:
        return NO_TP
    rendezvous = {"init_method": init_method} if store is None else {"store": store}
    dist.init_process_group(
        backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), **rendezvous
    )
    group = dist.group.WORLD
    custom = None
    if backend == "nccl" and single_node:
        custom = CustomAllReduce.create(group, torch.device("cuda", torch.cuda.current_device()))
    return TensorParallel(rank, size, group, custom, fp32_reduce=switches.tp_fp32_reduce())


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    """Drop the custom all-reduce's buffer and leave the process group `init_tensor_parallel`
    joined (nothing for one rank)."""
    if tp.custom is not None:
        tp.custom.close()
    if tp.size > 1:
        leave_process_group()


def leave_process_group() -> None:
    """Leave the default process group without waiting on peers. NCCL's communicators are
    aborted first: a plain destroy of an NCCL group whose collectives were captured in CUDA
    graphs hung rank 0's shutdown on 2 H200s (its peers had already exited); an abort does not
    wait for them. Gloo groups are destroyed as they are."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        from torch.distributed import distributed_c10d as c10d

        abort = getattr(c10d, "_abort_process_group", None)  # torch >= 2.6
        if abort is not None:
            abort()
            return
    dist.destroy_process_group()
