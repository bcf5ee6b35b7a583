"""Paged MLA KV cache: one pool per layer, written at slot ids, read by page tables.

Byte layout (the contract with every attention kernel)
------------------------------------------------------
Per layer, one tensor `kv[num_pages, page_size, D]` with `D = kv_lora_rank + qk_rope_head_dim`
(512 + 64 = 576 for DeepSeek). Token `t` of a sequence lives in page `block_table[t // page_size]`
at row `t % page_size`; its global slot id is `page * page_size + row`. Each row is

    [ c_kv (kv_lora_rank values) | k_pe (qk_rope_head_dim values, RoPE already applied) ]

stored contiguously in one dtype:
  * fp8_e4m3 (`torch.float8_e4m3fn`, 1 byte/value, 576 B/token/layer): value = stored * k_scale,
    one per-tensor scale per layer (1.0 unless the checkpoint gives `self_attn.k_scale`). Writes
    divide by the scale and saturate to +-448 (e4m3's largest finite value), so nothing becomes
    NaN.
    This is FlashMLA's / trtllm-gen's / tokenspeed_mla's plain 576-byte FP8 MLA layout (no inline
    scales).
  * bf16 / fp16 / fp32: the values themselves (scale 1).
Page 0 is never handed out: padded rows of a batch point their page table and slots at it, so
their writes land somewhere harmless.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from mlaserve.ops import fused_ops_enabled

__all__ = ["FP8_E4M3_MAX", "MLAKVPool"]

FP8_E4M3_MAX = 448.0
_FUSED_WRITE_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)


class MLAKVPool:
    """All layers' latent KV pages. `kv_buffers[layer]` has shape [num_pages, page_size, D]."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        k_scale: float | Sequence[float] = 1.0,
    ) -> None:
        if num_pages < 2:
            raise ValueError(
                f"num_pages: need at least 2 pages (page 0 is reserved), got {num_pages}"
            )
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.dim = kv_lora_rank + qk_rope_head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.is_fp8 = dtype == torch.float8_e4m3fn
        scales = [float(k_scale)] * num_layers if isinstance(k_scale, float | int) else k_scale
        if len(scales) != num_layers or any(not s > 0 for s in scales):
            raise ValueError(f"k_scale: need {num_layers} positive per-layer scales, got {scales}")
        # Scales only mean something for fp8; other dtypes store the values themselves.
        self.k_scales = [float(s) for s in scales] if self.is_fp8 else [1.0] * num_layers
        # Kernels that take scales as device tensors (FlashMLA's descale_k) read these.
        self.k_scale_tensors = [
            torch.full((1,), s, dtype=torch.float32, device=self.device) for s in self.k_scales
        ]
        self.kv_buffers = [
            torch.zeros(num_pages, page_size, self.dim, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # On CUDA one Triton kernel does quantize + store (`mlaserve/ops/kv_write.py`); the torch
        # path below is its reference and the CPU path. Chosen once, here.
        self._fused_write = None
        if fused_ops_enabled(self.device) and dtype in _FUSED_WRITE_DTYPES:
            from mlaserve.ops.kv_write import write_kv

            self._fused_write = write_kv

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The fused write's compile for `act_dtype` rows, as a task on a page of its own (the
        engine runs it beside its start-up: `model/kernel_warm_up.py`); none without it."""
        return [] if self._fused_write is None else [partial(self._warm_up_write, act_dtype)]

    def _warm_up_write(self, act_dtype: torch.dtype) -> None:
        page = torch.zeros(1, self.page_size, self.dim, dtype=self.dtype, device=self.device)
        # kv_c and k_pe as the layers pass them: views of one latent row
        latent = torch.zeros(1, self.dim, dtype=act_dtype, device=self.device)
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        slots = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._fused_write(page, slots, kv_c, k_pe, 1.0)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes across all layers."""
        return self.num_layers * self.dim * self.kv_buffers[0].element_size()

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, kv_cache_dim: int, dtype: torch.dtype
    ) -> int:
        return num_layers * page_size * kv_cache_dim * torch.empty((), dtype=dtype).element_size()

    def quantize(self, kv: torch.Tensor, layer_id: int = 0) -> torch.Tensor:
        """[T, D] model-dtype values -> [T, D] cache-dtype values."""
        if self.is_fp8:
            kv = (kv.float() / self.k_scales[layer_id]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return kv.to(self.dtype)

    def write(
        self, layer_id: int, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> None:
        """Store new tokens. slot_mapping [T] int64; kv_c [T, kv_lora_rank]; k_pe [T, rope_dim]."""
        if self._fused_write is not None:
            self._fused_write(
                self.kv_buffers[layer_id], slot_mapping, kv_c, k_pe, self.k_scales[layer_id]
            )
            return
        rows = self.quantize(torch.cat([kv_c, k_pe], dim=-1), layer_id)
        flat = self.kv_buffers[layer_id].view(-1, self.dim)
        if self.is_fp8:
            # index_copy_ has no float8 kernel on every device; bytes are bytes.
            flat.view(torch.uint8).index_copy_(0, slot_mapping, rows.view(torch.uint8))
        else:
            flat.index_copy_(0, slot_mapping, rows)

    def gather(self, layer_id: int, block_tables: torch.Tensor) -> torch.Tensor:
        """Dequantized fp32 KV of whole pages: block_tables [bs, P] -> [bs, P*page_size, D]."""
        pages = self.kv_buffers[layer_id][block_tables.long()]  # [bs, P, page, D]
        kv = pages.float().flatten(1, 2)
        return kv * self.k_scales[layer_id] if self.is_fp8 else kv
