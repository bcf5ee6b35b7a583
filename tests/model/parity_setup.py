"""Shared setup of the model-vs-transformers parity tests: per variant, ragged prompts with
teacher-forced continuations and transformers' fp32 logits over each whole sequence (`Setup`,
built by the `setups` fixture in conftest.py), the error metrics, and a prefill-then-decode run
over the paged cache.

Metrics (per prompt / sequence, over all its logit rows):
    max_rel   = max |ours - ref| / max |ref|
    token_rel = ||ours_t - ref_t||_2 / ||ref_t||_2 per token t
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.model import DeepseekForCausalLM

from .paged import PagedCache

PROMPT_LENS = [1, 40, 7, 23, 3, 16, 31, 9]  # 8 prompts, ragged
NUM_CONTINUATION = 8  # teacher-forced tokens after each prompt, for the decode tests
FP32_MAX_REL = 1e-4  # fp32 logits' max_rel bound


@dataclass
class Setup:
    config: ModelConfig
    path: Path
    seqs: list[list[int]]  # prompt + continuation tokens
    ref: list[torch.Tensor]  # transformers' fp32 logits over each whole sequence, [L, vocab]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b).abs().max() / b.abs().max()).item()


def token_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float().cpu() - b).norm(dim=-1) / b.norm(dim=-1)


def forward(
    model: DeepseekForCausalLM,
    cache: PagedCache,
    chunks: list[tuple[int, list[int]]],
    mode: ForwardMode = ForwardMode.EXTEND,
) -> list[torch.Tensor]:
    """One forward over `chunks`; returns each chunk's logits [len(chunk), vocab]."""
    batch = cache.batch(chunks, mode)
    logits = model.compute_logits(model(batch)[batch.logits_indices])
    return list(logits.split([len(ids) for _, ids in chunks]))


def run_prefill_then_decode(
    s: Setup, model: DeepseekForCausalLM, cache: PagedCache, q_len: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill all prompts in one ragged EXTEND, then DECODE the continuation q_len tokens at a
    time (teacher forced). Returns (ours, ref) logits row-aligned per piece."""
    ours, refs = [], []
    prompts = [(i, seq[:n]) for i, (seq, n) in enumerate(zip(s.seqs, PROMPT_LENS, strict=True))]
    ours += forward(model, cache, prompts)
    refs += [s.ref[i][: len(p)] for i, p in prompts]
    for start in range(0, NUM_CONTINUATION, q_len):
        chunks = [(i, s.seqs[i][n + start : n + start + q_len]) for i, n in enumerate(PROMPT_LENS)]
        ours += forward(model, cache, chunks, ForwardMode.DECODE)
        refs += [s.ref[i][n + start : n + start + q_len] for i, n in enumerate(PROMPT_LENS)]
    return ours, refs
