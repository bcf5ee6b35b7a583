"""The GPU a kernel adapter builds for: compute capability and SM count.

Backends for GPUs we do not have (Blackwell) take a `GpuTarget` instead of reading the device,
so their constraint checks, workspace sizing and kernel arguments can be built and checked on a
CPU against the real kernel packages (`tests/kernels_adapter/test_blackwell_contract.py`). On a
real GPU the target is read from the device once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GpuTarget"]


@dataclass(frozen=True)
class GpuTarget:
    capability: tuple[int, int]  # (major, minor), e.g. (10, 0) for B200
    num_sms: int  # streaming multiprocessors (148 on a B200)

    def __post_init__(self) -> None:
        if len(self.capability) != 2 or any(int(c) != c or c < 0 for c in self.capability):
            raise ValueError(f"capability: need (major, minor), got {self.capability!r}")
        if self.num_sms < 1:
            raise ValueError(f"num_sms: need at least 1, got {self.num_sms}")

    @property
    def sm_name(self) -> str:
        return f"SM{self.capability[0]}{self.capability[1]}"

    @classmethod
    def of(cls, device: torch.device) -> GpuTarget:
        """The target of a CUDA device (its properties, no kernel launch)."""
        if device.type != "cuda":
            raise ValueError(f"device: a GPU target needs a CUDA device, got {device}")
        props = torch.cuda.get_device_properties(device)
        return cls(capability=(props.major, props.minor), num_sms=props.multi_processor_count)
