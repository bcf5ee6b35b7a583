"""The all-reduce for decode-sized CUDA tensors: torch symmetric memory's one-shot and two-shot
kernels (NVLink peer loads and stores between the GPUs, no multicast), NCCL past them.

    custom = CustomAllReduce.create(group, device)   # every rank, same order; None: NCCL only
    if custom is not None and custom.handles(x):
        y = custom.all_reduce(x)                       # a new tensor: the sum over the ranks

`tensor_parallel.init_tensor_parallel` makes one per NCCL group and `tensor_parallel.all_reduce`
calls it; nothing else does.

Paths, by the tensor's byte size (`AllReducePlan.choose`, the same on every rank: it reads only
the size, and every rank reduces the same shapes in the same order):
- one-shot: `symm_mem.one_shot_all_reduce_copy_out`: one kernel copies `x` into this rank's
  symmetric buffer, waits for the peers (a barrier over the signal pads), then each rank reads
  every peer's buffer and sums all of it. Latency-bound sizes.
- two-shot: `x` copied into the buffer, then `symm_mem.two_shot_all_reduce_out`: each rank sums
  its 1/N slice over the peers (reduce-scatter), then gathers the N sums (all-gather). Reads N
  times less per rank than one-shot: better once the size, not the latency, dominates.
- NCCL: everything larger than the buffer, or not bf16 / fp32, or not a multiple of 16 bytes.
Never the multimem_* ops: they need NVLink multicast (cuMulticastCreate), which stays off.

The buffer: one symmetric allocation of `plan.max_bytes` per rank (`symm_mem.empty`, made
symmetric by `symm_mem.rendezvous` over the group at `create`), owned by this object from
`create` to `close` (`destroy_tensor_parallel` calls it; else it is freed with the object).
Every call copies its input into the start of it, so the kernels' buffer address is fixed and
a CUDA graph can capture them: a graph holds the buffer's address, so the buffer must outlive
every graph captured with it (it does: it lives as long as the group). The output is a fresh
tensor (`empty_like`, from the graph's pool under capture).

Invariant: one all-reduce at a time per rank. Calls are ordered by the stream they are issued
on, and each kernel ends with a barrier after which no peer still reads this rank's buffer, so
the next call may overwrite it; two calls on two streams at once would race on the buffer (the
model issues its all-reduces on the current stream only: MoE's side stream joins first).

The all-reduce fused with the next residual-add + RMSNorm (`all_reduce_add_rms_norm`, the
kernel in ops/all_reduce_rms_norm.py): where the plan gives a row-parallel or MoE partial sum
[T, N] fp32 to one-shot and T <= NORM_ROWS, one launch pushes each row to the peers, waits for
theirs and normalises, in place of the one-shot, a cast and the norm's kernel. Its exchange
regions sit after the one-shot's bytes in the same symmetric allocation (one rendezvous), with
flags of its own (never torch's signal pads, which the one-shot kernels use); zeroed at `create`
before a barrier, so no peer's first push meets an unzeroed flag. `MLASERVE_ALL_REDUCE_NORM=0`
leaves it out.

Thresholds: `MEASURED_PLANS`, per GPU count, from the collective timings in issue 42 (nvidia-
h200-x4) and, for 2 GPUs, bench/all_reduce.py's own run on nvidia-h200-x2; re-measure with `python3 bench/all_reduce.py --gpus N`, which prints the plan its
run implies. `MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES` / `_TWO_SHOT_MAX_BYTES` override them
(0: never that path; both 0: NCCL only, no buffer).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mlaserve import switches

if TYPE_CHECKING:
    from mlaserve.ops.all_reduce_rms_norm import Exchange

__all__ = [
    "MEASURED_PLANS",
    "NCCL",
    "ONE_SHOT",
    "TWO_SHOT",
    "AllReducePlan",
    "CustomAllReduce",
    "agree_on_reason",
    "plan_for",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)

ONE_SHOT, TWO_SHOT, NCCL = "one_shot", "two_shot", "nccl"
DTYPES = (torch.bfloat16, torch.float32)  # what the symmetric-memory kernels dispatch on
ALIGN = 16  # bytes: the kernels' widest vector; sizes and addresses on it keep one alignment
# The environment every rank must have: symmetric memory must not create multicast objects.
MULTICAST_OFF_VAR = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
# Two-shot's out variant is compiled for these world sizes only (one-shot for any).
TWO_SHOT_WORLD_SIZES = (2, 4, 8)
NORM_ROWS = 32  # rows the fused all-reduce + norm takes (its exchange: 8 MiB a rank on 2 GPUs)
OPS = {ONE_SHOT: "one_shot_all_reduce_copy_out", TWO_SHOT: "two_shot_all_reduce_out"}


@dataclass(frozen=True)
class AllReducePlan:
    """The path by byte size: one-shot up to `one_shot_max_bytes`, then two-shot up to
    `two_shot_max_bytes`, then NCCL (a bound of 0: never that path)."""

    one_shot_max_bytes: int
    two_shot_max_bytes: int

    def __post_init__(self) -> None:
        for name in ("one_shot_max_bytes", "two_shot_max_bytes"):
            value = getattr(self, name)
            if value < 0 or value % ALIGN:
                raise ValueError(f"all-reduce plan: {name} must be >= 0 and a multiple of "
                                 f"{ALIGN}, got {value}")  # fmt: skip

    @property
    def max_bytes(self) -> int:
        """The symmetric buffer's size: the largest tensor a custom path takes."""
        return max(self.one_shot_max_bytes, self.two_shot_max_bytes)

    def choose(self, nbytes: int) -> str:
        if 0 < nbytes <= self.one_shot_max_bytes:
            return ONE_SHOT
        if 0 < nbytes <= self.two_shot_max_bytes:
            return TWO_SHOT
        return NCCL


# Measured, time per call inside a CUDA graph of 50 calls, [bs, 7168] bf16 (bs 1 = 14 KiB,
# 8 = 112 KiB, 32 = 448 KiB, 64 = 896 KiB, 256 = 3.5 MiB), nvidia-h200-x4 (NVLink NV18, NCCL
# 2.28.9, torch 2.11), issue 42's table, in us for bs 1 / 8 / 32 / 64 / 256:
#   2 GPUs: NCCL 11.5 11.6 13.2 17.7 36.4; one-shot 6.6 7.4 9.4 12.2 27.3;
#           two-shot 6.5 7.1 7.5 10.0 17.9  -> two-shot best (or tied) at every size measured
#   4 GPUs: NCCL 16.6 15.9 19.6 23.4 44.1; one-shot 7.4 8.9 13.1 16.9 43.6;
#           two-shot 7.0 9.6 9.4 12.1 26.3  -> one-shot best at bs 8, two-shot at the others
# A bound is the largest size measured where that path was the fastest; one bound per path, so
# 4 GPUs' bs 1 (two-shot 0.4 us ahead) goes one-shot with bs 8. Nothing is extrapolated past
# 3.5 MiB: larger tensors take NCCL.
# 2 GPUs re-measured through this module's own paths (one-shot copies in inside its kernel,
# two-shot copies in first), `bench/all_reduce.py --gpus 2` on nvidia-h200-x2, 2026-11-28:
#   NCCL 12.4 11.8 15.1 18.8 37.5; one-shot 7.6 8.7 12.0 15.2 32.1; two-shot 11.0 13.1 13.7
#   17.0 25.2 (bs 1 / 8 / 32 / 64 / 256; bs 128: 34.6 / 20.7 / 19.4) -> one-shot to 896 KiB.
_KIB = 1024
MEASURED_PLANS: dict[int, AllReducePlan] = {
    2: AllReducePlan(one_shot_max_bytes=896 * _KIB, two_shot_max_bytes=3584 * _KIB),
    4: AllReducePlan(one_shot_max_bytes=112 * _KIB, two_shot_max_bytes=3584 * _KIB),
}


def plan_for(world_size: int) -> AllReducePlan:
    """The measured plan for `world_size` GPUs (NCCL only where none was measured), with the
    switches' overrides; two-shot off where its kernel has no instance for `world_size`."""
    measured = MEASURED_PLANS.get(world_size, AllReducePlan(0, 0))
    one = switches.all_reduce_one_shot_max_bytes(measured.one_shot_max_bytes)
    two = switches.all_reduce_two_shot_max_bytes(measured.two_shot_max_bytes)
    if world_size not in TWO_SHOT_WORLD_SIZES:
        two = 0
    return AllReducePlan(_round_down(one), _round_down(two))


def _round_down(nbytes: int) -> int:
    return max(0, nbytes) // ALIGN * ALIGN


# Group names that rendezvoused symmetric memory in this process. torch keeps that state per
# process, keyed by the name; a later group under the same name (a second tensor-parallel engine
# in one process: the default group is "0" again) hung in its rendezvous on 2 H200s, so such a
# group uses NCCL alone. A server holds one engine per process and never meets this.
_RENDEZVOUSED: set[str] = set()


def unavailable_reason(
    device: torch.device, world_size: int, plan: AllReducePlan, environ: Any = os.environ
) -> str | None:
    """Why this rank cannot use the custom all-reduce (None: it can try). Local checks only,
    no collective; `CustomAllReduce.create` agrees on the answer over the group."""
    if world_size < 2:
        return "one rank: nothing to reduce"
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if plan.max_bytes == 0 and world_size in MEASURED_PLANS:
        return (
            "switched off (MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES and _TWO_SHOT_MAX_BYTES both 0)"
        )
    if plan.max_bytes == 0:
        return (f"no measured thresholds for {world_size} GPUs (MEASURED_PLANS has "
                f"{sorted(MEASURED_PLANS)}) and no override switch set")  # fmt: skip
    if environ.get(MULTICAST_OFF_VAR) != "1":
        return f"{MULTICAST_OFF_VAR}=1 is not set (symmetric memory could create multicast)"
    try:
        import torch.distributed._symmetric_memory
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory unavailable ({exc})"
    used = [OPS[p] for p, bound in ((ONE_SHOT, plan.one_shot_max_bytes),
                                    (TWO_SHOT, plan.two_shot_max_bytes)) if bound]  # fmt: skip
    missing = [op for op in used if not _has_op(op)]
    if missing:
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{', '.join(missing)}"
    return None


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.symm_mem, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class CustomAllReduce:
    """This rank's symmetric buffer and plan over one process group (see the module docstring).
    Made by `create`; `handles(x)` says whether `all_reduce(x)` takes it, identically on every
    rank for the same shape and dtype."""

    def __init__(self, group: Any, device: torch.device, plan: AllReducePlan,
                 buffer: torch.Tensor, exchange: Exchange | None = None) -> None:  # fmt: skip
        self.group, self.device, self.plan = group, device, plan
        self.group_name: str = group.group_name
        # uint8 [plan.max_bytes (+ the exchange regions)], symmetric
        self.buffer: torch.Tensor | None = buffer
        self.exchange = exchange  # the fused all-reduce + norm's; None: not used

    @classmethod
    def create(
        cls, group: Any, device: torch.device, plan: AllReducePlan | None = None
    ) -> CustomAllReduce | None:
        """Every rank of `group` calls this, in the same order (it runs collectives on `device`).
        `plan`: `plan_for(N)` unless given (the benchmark forces one). None, with the reason
        logged, when any rank cannot use it: then every rank uses NCCL alone."""
        import torch.distributed as dist

        world_size = dist.get_world_size(group)
        plan = plan_for(world_size) if plan is None else plan
        reason = unavailable_reason(device, world_size, plan)
        if reason is None and group.group_name in _RENDEZVOUSED:
            reason = (f"symmetric memory already rendezvoused under group name "
                      f"{group.group_name!r} in this process (an earlier tensor-parallel engine)")  # fmt: skip
        if reason := agree_on_reason(reason, "a peer cannot use symmetric memory", group, device):
            return _fallback(reason, world_size)
        buffer, reason, exchange = None, None, None
        fused = switches.all_reduce_norm() and plan.one_shot_max_bytes > 0
        if fused:  # Triton's: imported only where it runs
            from mlaserve.ops.all_reduce_rms_norm import Exchange, exchange_bytes
        nbytes = plan.max_bytes + (exchange_bytes(NORM_ROWS, world_size) if fused else 0)
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            # the name: every torch 2.x takes it
            handle = symm_mem.rendezvous(buffer, group.group_name)
            _RENDEZVOUSED.add(group.group_name)
            if fused:
                buffer[plan.max_bytes :].zero_()  # the flags start at zero (module doc)
                bases = [int(ptr) + plan.max_bytes for ptr in handle.buffer_ptrs]
                exchange = Exchange(
                    handle.rank, world_size, NORM_ROWS,
                    torch.tensor(bases, dtype=torch.int64, device=device),
                    torch.zeros(NORM_ROWS, dtype=torch.int32, device=device),
                )  # fmt: skip
        except Exception as exc:  # allocation or rendezvous failed on this rank
            reason = f"symmetric buffer of {nbytes} bytes: {type(exc).__name__}: {exc}"
        # (a collective on the device, after the zeroing on this stream: the barrier it needs)
        if reason := agree_on_reason(reason, "a peer's symmetric buffer failed", group, device):
            return _fallback(reason, world_size)
        backend = getattr(symm_mem, "get_backend", lambda _: "default")(device)
        logger.info(
            "custom all-reduce on %d GPUs: one-shot up to %d bytes, two-shot up to %d, NCCL past "
            "(symmetric buffer %d bytes, symmetric-memory backend %s); fused with the next "
            "norm up to %d rows: %s", world_size, plan.one_shot_max_bytes,
            plan.two_shot_max_bytes, nbytes, backend, NORM_ROWS, exchange is not None,
        )  # fmt: skip
        return cls(group, device, plan, buffer, exchange)

    def handles(self, x: torch.Tensor) -> bool:
        """Whether `all_reduce(x)` takes a custom path: a CUDA tensor on this device, bf16 or
        fp32, whose size is a multiple of 16 bytes and that the plan gives to a custom path.
        Shape and dtype only, so every rank answers alike."""
        nbytes = x.numel() * x.element_size()
        return (
            self.buffer is not None
            and x.device == self.device
            and x.dtype in DTYPES
            and nbytes % ALIGN == 0
            and self.plan.choose(nbytes) != NCCL
        )

    def all_reduce(self, x: torch.Tensor, path: str | None = None) -> torch.Tensor:
        """The sum of `x` over the ranks, a new tensor of x's shape and dtype; `x` is left as it
        was. `path`: ONE_SHOT or TWO_SHOT to force one (the benchmark), else the plan's. Only
        for `handles(x)` tensors (a forced path needs only the size to fit the buffer)."""
        if self.buffer is None:
            raise RuntimeError("custom all-reduce: used after close()")
        nbytes = x.numel() * x.element_size()
        path = path or self.plan.choose(nbytes)
        if path not in (ONE_SHOT, TWO_SHOT) or nbytes > self.plan.max_bytes or nbytes % ALIGN:
            raise ValueError(f"custom all-reduce: {path} cannot take {nbytes} bytes "
                             f"(buffer {self.plan.max_bytes}, multiple of {ALIGN})")  # fmt: skip
        x = x.contiguous()
        if x.data_ptr() % ALIGN:  # the one-shot kernel loads x with the buffer's 16-byte vectors
            x = x.clone()
        flat = x.view(-1)
        buf = self.buffer.view(x.dtype)[: flat.numel()]  # offset 0: the address is fixed
        out = torch.empty_like(x)
        if path == ONE_SHOT:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                buf, flat, "sum", self.group_name, out.view(-1)
            )
        else:
            buf.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        return out

    def handles_norm(self, parts: torch.Tensor) -> bool:
        """Whether `all_reduce_add_rms_norm(parts, ...)` takes `parts` [T, S, N]: fp32,
        contiguous, on this device, T <= NORM_ROWS, N within a slot, and [T, N] fp32 a size
        the plan gives to one-shot. Shape and dtype only, so every rank answers alike."""
        num_tokens, _, n = parts.shape
        return (
            self.exchange is not None
            and self.buffer is not None
            and parts.device == self.device
            and parts.dtype == torch.float32
            and parts.is_contiguous()
            and num_tokens <= self.exchange.rows
            and n <= self.exchange.row_width
            and self.plan.choose(num_tokens * n * 4) == ONE_SHOT
        )

    def all_reduce_add_rms_norm(
        self, parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual) * weight, x + residual) for x = the sum over the ranks of
        `parts` [T, S, N] fp32 summed over S, rounded to residual's dtype, in one launch: the
        bits of the one-shot all-reduce, then `ops.rms_norm.add_partials_rms_norm` (2 ranks;
        more: the ranks summed in rank order). Only for `handles_norm(parts)` tensors."""
        if self.buffer is None or self.exchange is None:
            raise RuntimeError("custom all-reduce: the fused norm used after close() or unset")
        from mlaserve.ops.all_reduce_rms_norm import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(parts, residual, weight, eps, self.exchange)

    def close(self) -> None:
        """Drop the buffer (before the group is destroyed); later calls raise."""
        self.buffer = None


def agree_on_reason(
    reason: str | None, peer_reason: str, group: Any, device: torch.device
) -> str | None:
    """The group's verdict, on every rank: this rank's `reason`, else `peer_reason` if any rank
    had one, else None. A MIN all-reduce of an ok flag on `device` (a collective), so every rank
    takes the same path."""
    import torch.distributed as dist

    ok = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return reason or (peer_reason if int(ok.item()) == 0 else None)


def _fallback(reason: str, world_size: int) -> None:
    """Log why every size takes NCCL; None (what `create` returns then)."""
    logger.warning("custom all-reduce off on %d ranks, NCCL for every size: %s", world_size,
                   reason)  # fmt: skip
    return None
