"""What the two Blackwell backends (`tokenspeed`, `trtllm`) share.

Both are built for a `GpuTarget`: read from the CUDA device when serving, or described by the
CPU contract tests (which build the kernels' arguments without a Blackwell GPU). Both check the
target and the model against their kernels' constraints in `check_target` (works without a
GPU), refuse a uniform batch larger than the buffers they sized at construction, and run EXTEND
in the MHA form of `mha_extend.py`.

Heads are per tensor-parallel rank (`num_heads`, `base.AttentionBackend`): the kernels see
H = num_attention_heads // tp_size (DeepSeek-V3: 128 / 64 / 32 / 16 at TP 1 / 2 / 4 / 8), and
`check_target` checks each kernel's head and q_len limits against that count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from mlaserve.kernels_adapter.base import (
    AttentionBackend,
    BackendUnsupportedError,
    per_rank_heads,
)
from mlaserve.kernels_adapter.gpu_target import GpuTarget

if TYPE_CHECKING:
    from mlaserve.config import ModelConfig
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["BlackwellBackend", "latent_dims_problem"]


def latent_dims_problem(model_config: ModelConfig) -> str | None:
    """The MLA latent dims every Blackwell MLA kernel is built for (DeepSeek's 512/64)."""
    mc = model_config
    if (mc.kv_lora_rank, mc.qk_rope_head_dim) != (512, 64):
        return (
            "kv_lora_rank/qk_rope_head_dim must be 512/64, got "
            f"{mc.kv_lora_rank}/{mc.qk_rope_head_dim}"
        )
    return None


class BlackwellBackend(AttentionBackend):
    supports_cuda_graph: ClassVar[bool] = True
    mha_extend: ClassVar[bool] = True

    @classmethod
    def check_supported(
        cls,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device,
        *,
        num_heads: int | None = None,
        max_q_len: int = 1,
    ) -> None:
        per_rank_heads(model_config, num_heads)  # a bad count is a ValueError on any device
        if device.type != "cuda":
            raise BackendUnsupportedError(
                f"attention_backend {cls.name!r}: needs a CUDA device, got {device}"
            )
        cls.check_target(
            model_config,
            page_size,
            kv_cache_dtype,
            GpuTarget.of(device),
            num_heads=num_heads,
            max_q_len=max_q_len,
        )

    @classmethod
    def check_target(
        cls,
        model_config: ModelConfig,
        page_size: int,
        kv_cache_dtype: torch.dtype,
        target: GpuTarget,
        *,
        num_heads: int | None = None,
        max_q_len: int = 1,
    ) -> None:
        """`check_supported` for a described GPU (works without one), for `num_heads` heads a
        rank (None: all, TP1) and uniform batches of up to `max_q_len` tokens per sequence;
        raises BackendUnsupportedError naming the first constraint the configuration breaks
        (ValueError for a head count that does not divide the model's)."""
        raise NotImplementedError

    def __init__(
        self,
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
    ) -> None:
        """`target`: the GPU to build for; None reads it from `device` (which must be CUDA).
        Tests pass a Blackwell target with a CPU device to build the kernels' arguments.
        `self.on_gpu` says which: only then are the kernels loaded or compiled. Subclasses do
        their own construction in `_init_kernels`, not by overriding this. `num_heads`: the
        heads this rank attends (`base.AttentionBackend`), checked against the kernels' limits
        here and used for every buffer `_init_kernels` sizes."""
        super().__init__(
            model_config,
            page_size,
            kv_cache_dtype,
            device,
            max_num_seqs,
            max_model_len,
            max_q_len=max_q_len,
            num_heads=num_heads,
        )
        self.on_gpu = target is None
        self.target = GpuTarget.of(device) if self.on_gpu else target
        self.check_target(
            model_config,
            page_size,
            kv_cache_dtype,
            self.target,
            num_heads=self.num_heads,
            max_q_len=self.max_q_len,
        )
        self._init_kernels()

    def _init_kernels(self) -> None:
        """Import the package's kernels and allocate the buffers sized at construction (never
        grown while serving: that would break captured graphs); on the GPU also load or compile
        the kernels now, so a failure shows at start-up. Runs once the target is checked."""
        raise NotImplementedError

    def check_uniform_bounds(self, batch: ForwardBatch) -> None:
        """A uniform batch must fit what the buffers were sized for at construction (they are
        never grown while serving: that would break captured graphs)."""
        if batch.bs > self.max_num_seqs or batch.q_len > self.max_q_len:
            raise ValueError(
                f"{batch.mode.value} batch of {batch.bs} x q_len {batch.q_len} exceeds what the "
                f"backend was sized for ({self.max_num_seqs} x {self.max_q_len})"
            )
