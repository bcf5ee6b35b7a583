"""Name -> attention backend class, imported lazily so a missing kernel package only matters
when that backend is chosen."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

import torch

from mlaserve.backend_names import ATTENTION_BACKENDS
from mlaserve.kernels_adapter.base import BackendUnsupportedError, per_rank_heads
from mlaserve.kernels_adapter.gpu_target import GpuTarget

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.kernels_adapter.base import AttentionBackend

__all__ = ["available_backends", "get_backend_class", "make_backend", "resolve_backend_name"]

logger = logging.getLogger(__name__)

_BACKENDS: dict[str, str] = {
    "reference": "mlaserve.kernels_adapter.reference:ReferenceBackend",
    "invariant": "mlaserve.kernels_adapter.invariant:InvariantBackend",
    "flashmla": "mlaserve.kernels_adapter.flashmla:FlashMLABackend",
    "trtllm": "mlaserve.kernels_adapter.trtllm:TrtllmBackend",
    "tokenspeed": "mlaserve.kernels_adapter.tokenspeed:TokenspeedBackend",
}
# Config validates `attention_backend` against the leaf's list; one list, so they cannot drift.
if sorted(_BACKENDS) != sorted(ATTENTION_BACKENDS):
    raise ImportError(
        f"mlaserve.backend_names.ATTENTION_BACKENDS {sorted(ATTENTION_BACKENDS)} != the "
        f"registry's {sorted(_BACKENDS)}"
    )
# What `auto` tries, first that can run wins; each backend's `check_supported` filters by compute
# capability and KV dtype: SM90 -> flashmla; SM100/103 -> trtllm (bf16 or fp8 KV); SM107 with
# fp8 KV -> tokenspeed; anything else -> reference (runs everywhere).
# On SM100 trtllm-gen comes before tokenspeed on purpose: this server is for the lowest TPOT,
# i.e. small batches, where tokenspeed is the slower of the two (it wins at large batches;
# bench/RESULTS.md). Throughput-oriented deployments should name `tokenspeed` explicitly.
_AUTO_ORDER = ("flashmla", "trtllm", "tokenspeed", "reference")
_AUTO_WHY = {
    "flashmla": "Hopper: FlashMLA's dense decode kernels",
    "trtllm": "Blackwell SM100/103: trtllm-gen first, the lowest TPOT at small batch",
    "tokenspeed": "Blackwell with fp8 KV: tokenspeed_mla",
    "reference": "no kernel backend can run this configuration: pure torch",
}


def available_backends() -> list[str]:
    return sorted(ATTENTION_BACKENDS)


def get_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; available: {available_backends()}"
        )
    module_name, _, attr = _BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_backend_name(
    name: str,
    model_config: ModelConfig,
    page_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    *,
    num_heads: int | None = None,
    max_q_len: int = 1,
    target: GpuTarget | None = None,
) -> str:
    """`auto` picks the first backend of `_AUTO_ORDER` that can run this configuration; a named
    backend must be able to, or `BackendUnsupportedError` says why not.

    `num_heads`: the heads one tensor-parallel rank attends, `num_attention_heads // tp_size`
    (None: all, TP1; ValueError unless it divides the model's heads); `max_q_len`: the widest
    uniform step (k + 1 with speculation). Kernels' limits are per rank and per q_len (e.g.
    tokenspeed: heads x q_len <= 128 beyond q_len 4), so the choice depends on both.

    `target`: decide for this GPU instead of `device`'s, for the backends that can check a
    described GPU (`check_target`: the Blackwell ones); the others check `device`. Lets the
    choice be tested, and explained, without the GPU."""
    heads = per_rank_heads(model_config, num_heads)
    shape = {"num_heads": heads, "max_q_len": max_q_len}

    def check(backend: str) -> None:
        cls = get_backend_class(backend)
        if target is not None and hasattr(cls, "check_target"):
            cls.check_target(model_config, page_size, kv_cache_dtype, target, **shape)
        else:
            cls.check_supported(model_config, page_size, kv_cache_dtype, device, **shape)

    if name != "auto":
        check(name)
        return name
    skipped = []
    for candidate in _AUTO_ORDER:
        try:
            check(candidate)
        except BackendUnsupportedError as e:
            skipped.append(f"{candidate}: {e}")
            continue
        # On a GPU, pure torch is a fallback an operator must see: its decode steps are much
        # slower than a kernel backend's (bench/RESULTS.md)
        on_gpu = target is not None or device.type == "cuda"
        logger.log(
            logging.WARNING if candidate == "reference" and on_gpu else logging.INFO,
            "attention_backend auto -> %s (%s, %s KV, page %d, %d heads a rank, q_len <= %d; %s)%s",
            candidate,
            target.sm_name if target is not None else _device_name(device),
            str(kv_cache_dtype).removeprefix("torch."),
            page_size,
            heads,
            max_q_len,
            _AUTO_WHY[candidate],
            "".join(f"\n  skipped {s}" for s in skipped),
        )
        return candidate
    raise BackendUnsupportedError("no attention backend can run this configuration")


def make_backend(
    name: str,
    model_config: ModelConfig,
    page_size: int,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    *,
    max_q_len: int = 1,
    num_heads: int | None = None,
    target: GpuTarget | None = None,
) -> AttentionBackend:
    """`resolve_backend_name`, then the backend built for this rank: `num_heads` heads
    (`num_attention_heads // tp_size`; None: all, TP1) and uniform steps of up to `max_q_len`
    tokens per sequence. `target` (Blackwell backends only): build for a described GPU."""
    resolved = resolve_backend_name(
        name,
        model_config,
        page_size,
        kv_cache_dtype,
        device,
        num_heads=num_heads,
        max_q_len=max_q_len,
        target=target,
    )
    cls = get_backend_class(resolved)
    extra = {"target": target} if target is not None and hasattr(cls, "check_target") else {}
    return cls(
        model_config,
        page_size,
        kv_cache_dtype,
        device,
        max_num_seqs,
        max_model_len,
        max_q_len=max_q_len,
        num_heads=num_heads,
        **extra,
    )


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} SM{major}{minor}"
