"""`WeightStager` on a GPU: what lands on the device equals the CPU source byte for byte, for
regions that fit a slot, need row chunks, need element chunks, or are strided (a TP column
slice), with slots reused many times over (two slots of 4 KB for megabytes), from several
threads at once; and a load through it equals the CPU load of the same checkpoint.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mlaserve.config import ModelConfig
from mlaserve.model import load_model
from mlaserve.model.weight_stager import WeightStager
from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    return torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


def test_regions_of_every_shape_arrive_intact() -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 1000, generator=g).to(torch.bfloat16)
    sources = [
        big[:2],  # fits one slot
        big,  # row chunks
        big[:, 250:750],  # strided rows (a dim-1 shard), row chunks
        torch.randn(100_000, generator=g),  # 1-D, element chunks
        torch.randn(3, 5000, generator=g).to(torch.float8_e4m3fn),  # row > slot, contiguous
        torch.randn(3, 3000, generator=g)[:, 1000:],  # row > slot, strided: not staged
        torch.empty(0, 5),
    ]
    stager = WeightStager(torch.device("cuda"), slots=2, slot_bytes=4096)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(stager.to_device, sources * 3))
    stager.close()
    for src, dst in zip(sources * 3, got, strict=True):
        assert dst.is_cuda and dst.dtype == src.dtype and dst.shape == src.shape
        assert _same(dst, src)


def test_load_equals_the_cpu_load(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "v3_mtp")
    config = ModelConfig.from_pretrained(path)
    cpu = dict(load_model(config, path).named_parameters())
    for staged in (True, False):
        gpu = dict(load_model(config, path, device="cuda", staged=staged).named_parameters())
        for name, p in cpu.items():
            assert _same(gpu[name], p), (staged, name)
