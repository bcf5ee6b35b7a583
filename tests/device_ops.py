"""Counts the torch ops that would launch work on a device (each a kernel launch on CUDA, ~5-10
us of host time): what a hot path's op budget is checked against. Views and metadata ops are
not counted; `.tolist()` and `.item()` (the tests' own reads) neither."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

_NOT_COUNTED = ("slice", "select", "view", "unbind", "alias", "detach", "as_strided", "lift_fresh")
_READS = ("_local_scalar_dense",)


class DeviceOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not name.startswith(_NOT_COUNTED + _READS):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
