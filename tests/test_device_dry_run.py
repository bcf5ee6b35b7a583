"""`DeviceDryRun` (mlaserve/device_dry_run.py): on its device type, torch's operators compute
their outputs' shapes and launch nothing; factories, views and other devices' operators run;
what needs values stops the run. The mode is per device type, so the CPU checks its rules with
device_type "cpu"; the CUDA case, where a garbage offset asserted on the device, is
tests/test_kernel_compile_pool.py's GPU test."""

from __future__ import annotations

import pytest
import torch

from mlaserve.device_dry_run import DeviceDryRun, DryRunStopped


def test_operators_on_the_device_type_return_shaped_tensors_and_compute_nothing() -> None:
    x = torch.randn(8, 4)
    bad = torch.full((3,), 1 << 40, dtype=torch.long)  # what a skipped kernel left behind
    with pytest.raises(IndexError):
        torch.index_select(x, 0, bad)  # for real: it checks the values
    before = x.clone()
    with DeviceDryRun("cpu"):
        picked = torch.index_select(x, 0, bad)
        product = torch.matmul(x, x.t())
        halves = torch.split(x, 2)  # views: real
        summed = x.sum(dim=0, dtype=torch.float64)
    assert picked.shape == (3, 4) and product.shape == (8, 8) and len(halves) == 4
    assert summed.dtype == torch.float64 and summed.shape == (4,)
    assert torch.equal(x, before)


def test_views_and_factories_are_real_and_writes_return_what_they_write() -> None:
    x = torch.randn(8, 4)
    with DeviceDryRun("cpu"):
        view = x[2:].t()
        zeros = torch.zeros(5)
        added = x.add_(1.0)
        out = torch.empty(8, 4)
        into = torch.mul(x, 2.0, out=out)
    assert view.data_ptr() == x[2:].data_ptr() and view.stride() == (1, 4)
    assert torch.equal(zeros, torch.zeros(5))  # a factory's values are its own
    assert added is x and into is out


@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: x.to("meta"),  # a copy off the device (a CUDA tensor's `.cpu()`, `.tolist()`)
        lambda x: torch.nonzero(x),  # a shape that depends on the values
    ],
    ids=["item", "copy-off", "nonzero"],
)
def test_what_needs_values_stops_the_run(read) -> None:
    x = torch.randn(8, 4)
    with DeviceDryRun("cpu"), pytest.raises(DryRunStopped):
        read(x)


def test_other_devices_run_for_real() -> None:
    """A "cuda" dry run leaves the host's operators alone (their values may steer the task)."""
    x = torch.arange(6.0)
    with DeviceDryRun("cuda"):
        assert x.sum().item() == 15.0
        assert torch.nonzero(x).shape == (5, 1)
