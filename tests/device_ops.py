"""Counts the torch ops that would launch work on a device (each a kernel launch on CUDA, ~5-10
us of host time): what a hot path's op budget is checked against. Views and metadata ops are
not counted; `.tolist()` and `.item()` (the tests' own reads) neither."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_NOT_COUNTED = (
    "slice", "select", "view", "unbind", "alias", "detach", "as_strided", "lift_fresh",
    "unsqueeze", "squeeze", "resolve_conj", "resolve_neg",
)  # fmt: skip
_READS = ("_local_scalar_dense",)


class DeviceOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # A `to` that returns its input (already of that dtype and device) launches nothing.
        if not name.startswith(_NOT_COUNTED + _READS) and not (name == "to" and out is args[0]):
            self.ops[name] += 1
        return out


def uncounted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, run with no dispatch mode active: its ops are not counted (a model forward)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return run
