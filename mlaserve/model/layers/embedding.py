"""Token embedding and LM head, split over the vocabulary for tensor parallelism (TP).

Rank r holds vocabulary rows [r*V/tp, (r+1)*V/tp). On one rank both are plain lookups / matmuls;
the TP collectives (masked lookup + all-reduce, logits all-gather) are not wired yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.model.layers.linear import NO_TP, TensorParallel, check_shape

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
    ) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        local = tp.split(vocab_size, "vocab_size")
        self.weight = nn.Parameter(
            torch.empty(local, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        local = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp.rank * local, local))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]"""
        if self.tp.size > 1:
            raise NotImplementedError("tensor parallelism: vocab-parallel embedding is not wired")
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over this rank's vocabulary slice (the full vocabulary on one rank)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[N, hidden] -> [N, vocab] float32"""
        if self.tp.size > 1:
            raise NotImplementedError("tensor parallelism: logits all-gather is not wired")
        return F.linear(hidden, self.weight).float()
