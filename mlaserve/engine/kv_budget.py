"""How many KV pages this rank's pool gets, and the ranks' agreement on it.

    free_at_start = free_device_memory(device)        # before the weights load
    ...load the weights; under TP, one collective so that NCCL's buffers exist...
    n = decide_num_pages(config, model_config, device=..., ..., free_at_start=free_at_start)
    n = agree_min(n, control_group)                   # TP: every rank's pool holds the same pages

The budget is per GPU, as vLLM's `--gpu-memory-utilization`: this process may hold
`utilization * total` bytes; what it holds already (weights, and memory outside torch's allocator
such as NCCL's buffers, seen as free memory used since it started) comes off first; the KV pool
takes `kv_cache_memory_fraction` of the rest, leaving the remainder for activations and CUDA
graphs (captured after the pool). Never more than is free, nor more pages than every sequence
slot at full length could use.
"""

from __future__ import annotations

import torch

from mlaserve.config import ConfigError, EngineConfig, ModelConfig
from mlaserve.kv_cache import MLAKVPool

__all__ = ["CPU_KV_CACHE_BYTES", "agree_min", "decide_num_pages", "free_device_memory"]

# Without an explicit size, a CPU KV pool takes at most this much host memory.
CPU_KV_CACHE_BYTES = 2 << 30


def free_device_memory(device: torch.device) -> int:
    """Free bytes on `device` now (0 off CUDA)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def decide_num_pages(
    config: EngineConfig,
    model_config: ModelConfig,
    *,
    device: torch.device,
    num_kv_layers: int,
    page_size: int,
    kv_cache_dtype: torch.dtype,
    max_pages_per_seq: int,
    free_at_start: int,
) -> int:
    """This rank's pool size in pages (module doc); `config.num_pages` when given."""
    if config.num_pages is not None:
        return config.num_pages
    useful = config.max_num_seqs * max_pages_per_seq + 1
    per_page = MLAKVPool.bytes_per_page(
        num_kv_layers, page_size, model_config.kv_cache_dim, kv_cache_dtype
    )
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free * config.kv_cache_memory_fraction)
        if config.gpu_memory_utilization is not None:
            budget = _budget_within_share(config, device, free, total, free_at_start)
    else:
        budget = CPU_KV_CACHE_BYTES
    return max(2, min(useful, budget // per_page))


def _budget_within_share(
    config: EngineConfig, device: torch.device, free: int, total: int, free_at_start: int
) -> int:
    share = int(config.gpu_memory_utilization * total)
    held = max(torch.cuda.memory_reserved(device), free_at_start - free)
    if held >= share:
        raise ConfigError(
            f"gpu_memory_utilization: {config.gpu_memory_utilization} of {total / 2**30:.1f} GiB "
            f"is {share / 2**30:.1f} GiB, but the weights already take {held / 2**30:.1f} GiB"
        )
    return int(min(free, share - held) * config.kv_cache_memory_fraction)


def agree_min(n: int, group: object) -> int:
    """The smallest of every TP rank's `n` (an all-reduce over the control `group`)."""
    import torch.distributed as dist

    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
