"""Token embedding and LM head, split over the vocabulary for tensor parallelism (TP).

The vocabulary is padded up to a multiple of the TP size, as vLLM does (V3's 129280 divides by
8; a vocabulary that does not is padded, never an error): rank r holds rows
[r*Vp/tp, (r+1)*Vp/tp) of the padded [Vp, hidden] table, the rows past V zero.

    embedding   each rank looks up the ids in its slice (others give zero rows; one kernel on
                CUDA, `ops/vocab_slice_embedding.py`), then one all-reduce sums the ranks'
                [T, hidden]: every rank has the full embedding
    LM head     each rank computes its [N, Vp/tp] slice of the logits, then one all-gather along
                the vocabulary: every rank has the full [N, V] logits (padding sliced off)

On one rank both are a plain lookup / matmul and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.model.checkpoint_tensor import CheckpointTensor
from mlaserve.model.layers.linear import NO_TP, TensorParallel, check_shape, wide_linear
from mlaserve.tensor_parallel import all_gather, all_reduce

__all__ = ["ParallelLMHead", "VocabParallelEmbedding", "slice_lookup"]


class VocabParallelEmbedding(nn.Module):
    """weight [ceil(V/tp), hidden] in params_dtype: this rank's rows of the padded vocabulary."""

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
        self.local_vocab = -(-vocab_size // tp.size)  # padded share
        self.vocab_start = tp.rank * self.local_vocab
        # rows of this slice that are real tokens (the last ranks' tail is padding)
        self.valid_rows = max(0, min(self.local_vocab, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(
            torch.empty(self.local_vocab, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        # Under TP on CUDA the masked lookup is one kernel (`slice_lookup` below is its
        # reference and the CPU path).
        self._slice_lookup = None
        if tp.size > 1:
            from mlaserve.ops import fused_ops_enabled

            if fused_ops_enabled(self.weight.device):
                from mlaserve.ops.vocab_slice_embedding import vocab_slice_embedding

                self._slice_lookup = vocab_slice_embedding

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """`loaded` is the whole [V, hidden] table, unread; read this rank's rows, zero the
        padding."""
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        n = self.valid_rows
        if n:
            param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n).load())
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden], the same on every rank."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        lookup = self._slice_lookup or slice_lookup
        return all_reduce(lookup(input_ids, self.weight, self.vocab_start), self.tp)

    def warm_up_tasks(self, act_dtype: torch.dtype) -> list[Callable[[], None]]:
        """The slice lookup's compile (`model/kernel_warm_up.py`); nothing else compiles."""
        if self._slice_lookup is None:
            return []
        ids = torch.zeros(1, dtype=torch.int64, device=self.weight.device)
        return [lambda: self._slice_lookup(ids, self.weight, self.vocab_start)]


def slice_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """[T] int64 -> [T, hidden]: rows of `weight` (the table's rows start, start + 1, ...) for
    the ids in it, zero rows for the others, so that the TP all-reduce sums exactly one non-zero
    row per token (no data-dependent shapes: graph-safe). The reference of
    `ops/vocab_slice_embedding.py`."""
    local = ids - start
    mine = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.masked_fill(~mine, 0), weight)  # others read row 0, then zeroed
    return out.masked_fill_(~mine.unsqueeze(-1), 0)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the whole vocabulary, on every rank (each computes its slice).

    `deterministic` (`EngineConfig.deterministic_inference`): the logits by the batch-invariant
    matmul, accumulated and returned in fp32 (`ops/invariant_matmul.py`); under TP each rank's
    slice so, then gathered (a logit's sum never crosses ranks: the same bits at any TP size)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        params_dtype: torch.dtype = torch.float32,
        tp: TensorParallel = NO_TP,
        deterministic: bool = False,
    ) -> None:
        super().__init__(vocab_size, hidden_size, params_dtype=params_dtype, tp=tp)
        self._slice_lookup = None  # a matmul (and an all-gather), never a lookup
        self._invariant = None
        if deterministic:
            from mlaserve.ops import fused_ops_enabled
            from mlaserve.ops.invariant_rowwise import rowwise_matmul

            self._invariant = rowwise_matmul
            if fused_ops_enabled(self.weight.device):
                from mlaserve.ops.invariant_matmul import invariant_matmul

                self._invariant = invariant_matmul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """[N, hidden] -> [N, vocab] float32, the same on every rank."""
        # [N, V / tp] fp32, this rank's slice: the accumulator unrounded, so near-equal logits
        # stay apart (16-bit logits tie often) and a slice's bits do not depend on the rank count
        if self._invariant is not None:
            logits = self._invariant(hidden, self.weight, out_dtype=torch.float32)
        else:
            logits = wide_linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        logits = all_gather(logits, self.tp, dim=-1)  # [N, padded V]
        padded = logits.shape[-1] != self.vocab_size
        return logits[:, : self.vocab_size].contiguous() if padded else logits
