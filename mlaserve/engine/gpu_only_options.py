"""Options that only a CUDA device reads, named in one log line each when set off CUDA.

On the CPU `--gpu-memory-utilization 0.5` or `--cuda-graph-batch-sizes 1,2,4` used to be taken
and silently ignored; the engine, once it knows its device, says so (issue 45):

    for line in ignored_gpu_options(config, device):
        logger.warning("%s", line)

Options that cannot work off CUDA at all (`--cuda-graph`, `--piecewise-cuda-graph`) are refused
by the config already; these are the ones that are merely without effect.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mlaserve.config import EngineConfig
from mlaserve.engine.kv_budget import CPU_KV_CACHE_BYTES

if TYPE_CHECKING:
    import torch

__all__ = ["GPU_ONLY_ENV", "GPU_ONLY_FIELDS", "ignored_gpu_options"]

# Off CUDA the KV pool is --num-pages, else at most CPU_KV_CACHE_BYTES (engine/kv_budget.py).
_KV_HERE = f"here --num-pages sizes it (default: at most {CPU_KV_CACHE_BYTES >> 30} GiB)"
# EngineConfig field -> what it does on a GPU, and what stands in for it here.
GPU_ONLY_FIELDS: Mapping[str, str] = {
    "gpu_memory_utilization": f"on a GPU it sizes the KV cache; {_KV_HERE}",
    "kv_cache_memory_fraction": f"on a GPU it sizes the KV cache; {_KV_HERE}",
    "cuda_graph_batch_sizes": "it picks the batch sizes captured in CUDA graphs; no graphs here",
    "piecewise_cuda_graph_max_tokens": "it bounds the prefill CUDA graphs; no graphs here",
}
# The custom all-reduce's environment switches (switches.py): CUDA tensors only.
GPU_ONLY_ENV: Mapping[str, str] = {
    "MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES": "it tunes the custom all-reduce of CUDA tensors",
    "MLASERVE_ALL_REDUCE_TWO_SHOT_MAX_BYTES": "it tunes the custom all-reduce of CUDA tensors",
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.init}


def ignored_gpu_options(
    config: EngineConfig, device: torch.device, environ: Mapping[str, str] | None = None
) -> list[str]:
    """One message per GPU-only option set away from its default while `device` is not CUDA
    (none on CUDA)."""
    if device.type == "cuda":
        return []
    environ = os.environ if environ is None else environ
    lines = []
    for name, what in GPU_ONLY_FIELDS.items():
        value = getattr(config, name)
        if value != _DEFAULTS[name]:
            flag = "--" + name.replace("_", "-")
            lines.append(f"{flag} {value!r} has no effect on device {device.type} ({what})")
    for name, what in GPU_ONLY_ENV.items():
        if name in environ:
            lines.append(f"{name}={environ[name]} has no effect on device {device.type} ({what})")
    return lines
