"""Test helper: tiny checkpoints in the published FP8 block format, and their dequantised twins.

    fp8, plain = fp8_pair(root, "v3_mtp", aligned=True)

`fp8` is a transformers-saved tiny checkpoint quantised by `tools/fp8_checkpoint.py`; `plain` is
that FP8 checkpoint multiplied out to fp32 (the same weights, no quantization_config): the
model the FP8 one must reproduce. `aligned` picks dims that are multiples of 128 (hidden 256,
q_lora/kv_lora 128, experts 128) so every scale is a true 128 x 128 block and gate|up seams sit
on block boundaries; otherwise the tiny defaults (hidden 64, experts 32: partial blocks and
per-row scales).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mlaserve.config import ModelConfig
from mlaserve.model import DeepseekForCausalLM
from tests.checkpoints import make_checkpoint
from tests.model.paged import PagedCache
from tools.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint_fp8_block

ALIGNED = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
}
PROMPT_LENS = [1, 17, 5, 30]


def fp8_pair(root: Path, variant: str, *, aligned: bool, scale_name: str = "weight_scale_inv"):
    tag = f"{variant}-{'aligned' if aligned else 'odd'}-{scale_name}"
    src = make_checkpoint(root / tag, variant, **(ALIGNED if aligned else {}))
    fp8 = quantize_checkpoint_fp8_block(src, root / tag / "fp8", scale_name=scale_name)
    return fp8, dequantize_checkpoint(fp8, root / tag / "plain")


def prompts(vocab: int = 384, seed: int = 7) -> list[tuple[int, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (i, torch.randint(3, vocab, (n,), generator=g).tolist()) for i, n in enumerate(PROMPT_LENS)
    ]


def prompt_logits(
    model: DeepseekForCausalLM,
    config: ModelConfig,
    device: str | torch.device = "cpu",
    kv_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One ragged EXTEND over `prompts()`: logits [sum(PROMPT_LENS), vocab] fp32 on the CPU."""
    cache = PagedCache(config, kv_dtype=kv_dtype, device=device)
    batch = cache.batch(prompts())
    return model.compute_logits(model(batch)[batch.logits_indices]).float().cpu()


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def token_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)
