"""`DeviceDryRun`: torch's operators on one device type run without their kernels, for the kernel
compile pool's collection (`kernel_compile_pool.collect`).

Collection runs each warm-up task with its Triton launches skipped, so the tensors those
kernels would have written hold whatever the allocator left there. A torch operator reading
them would compute on garbage, and some check their inputs on the device: V3-lite's MoE
warm-up fed a skipped routing kernel's offsets to `torch._grouped_mm`, whose device-side assert
("expected offset to be less than tensor size") took the CUDA context down and the start with
it. Under this mode nothing reads them: an operator with a tensor of `device_type` among its
inputs is run on the meta device for its outputs' shapes, strides and dtypes, and gets fresh
uninitialised tensors of those on the device (an in-place or `out=` operator returns the
tensors it would have written). What runs for real, because it launches nothing or reads
nothing a skipped kernel wrote:
- factories (no tensor input: `empty`, `zeros`, `arange`, ...), whose values are their own;
- views, which only make metadata (so a view's offset, which decides Triton's pointer
  alignment, is the real one);
- operators on other devices' tensors only (the host's).

What cannot be answered without the values stops the task (`DryRunStopped`): a read to the
host (`.item()`, `.tolist()`, a copy off the device), or an operator with no meta kernel. The
task's variants recorded until then are kept; the rest compile when the task runs for real.

Shapes: the meta kernels compute the outputs the real ones would, so each Triton launch after a
dry-run operator sees the shapes, dtypes and (fresh allocations being 16-byte aligned, as real
ones are) the pointer alignment of the real run: the same kernel variants.

Layer 3 (README, "Layers"): nothing from mlaserve.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["DeviceDryRun", "DryRunStopped"]


class DryRunStopped(RuntimeError):
    """The task needs a value the dry run does not compute (module doc)."""


class DeviceDryRun(TorchDispatchMode):
    """Within `with DeviceDryRun("cuda"):` on this thread (dispatch modes are per thread),
    operators on `device_type` tensors launch nothing (module doc)."""

    def __init__(self, device_type: str = "cuda") -> None:
        super().__init__()
        self.device_type = device_type

    def _on_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device_type

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        device = next((t.device for t in leaves if self._on_device(t)), None)
        if device is None or _metadata_only(func):
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            raise DryRunStopped(f"{func}: a value read to the host")
        target = kwargs.get("device")
        if target is not None and torch.device(target).type != self.device_type:
            raise DryRunStopped(f"{func}: a copy off the device")
        meta_args, meta_kwargs = tree_unflatten([_empty_on(t, "meta") for t in leaves], spec)
        try:
            out = func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError) as e:
            raise DryRunStopped(f"{func}: no meta kernel ({e})") from e
        if not func._schema.is_mutable:
            return tree_map(lambda o: _empty_on(o, device), out)
        written = _written_arguments(func, args, kwargs)
        if any(isinstance(w, torch.Tensor) and not self._on_device(w) for w in written):
            raise DryRunStopped(f"{func}: a copy off the device")
        returns = len(func._schema.returns)
        return None if returns == 0 else written[0] if returns == 1 else tuple(written)


def _metadata_only(func: Any) -> bool:
    """An operator that launches no kernel: a view (its output aliases an input, unwritten), an
    in-place view (`transpose_`), or a resize of storage."""
    schema = func._schema
    if torch.Tag.inplace_view in func.tags or func is torch.ops.aten.resize_.default:
        return True
    return not schema.is_mutable and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )


def _empty_on(value: Any, device: torch.device | str) -> Any:
    """A tensor's shape, strides and dtype, uninitialised on `device`; anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.device == torch.device(device):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an in-place or `out=` operator writes, in its schema's order."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        written.append(kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i])
    return written
