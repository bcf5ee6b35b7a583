"""The per-forward state passed from the model runner through the model to the attention backend.

A `ForwardBatch` is built once per forward (or once per captured CUDA graph) and holds *views* of
the runner's preallocated device buffers. Nothing here is a module global: the model and the
attention backend receive the batch as an argument.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mlaserve.kernels_adapter.base import AttentionBackend
    from mlaserve.kv_cache.kv_pool import MLAKVPool

__all__ = ["ForwardBatch", "ForwardMode"]


class ForwardMode(enum.Enum):
    """How the query tokens of a forward are laid out.

    EXTEND: ragged; sequence b owns rows `cu_q_lens[b]:cu_q_lens[b+1]` of the token arrays
        (prefill chunks, possibly mixed with decodes). Eager only.
    DECODE: uniform; every sequence has exactly `q_len` new tokens, rows `b*q_len:(b+1)*q_len`
        (plain decode q_len=1; target verify q_len=N). This is the CUDA-graph shape.
    """

    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    """Inputs of one model forward. Shapes use bs = sequences, T = tokens (T = bs*q_len in DECODE).

    Host ints (`bs`, `num_tokens`, `q_len`, `max_seq_len`) are known to the scheduler without
    reading device memory; under CUDA graphs they are the captured (padded) sizes and
    `max_seq_len` is `max_model_len`, so nothing is read back from the GPU per step.
    """

    mode: ForwardMode
    bs: int
    num_tokens: int
    q_len: int  # DECODE: tokens per sequence; EXTEND: the largest q length in the batch
    max_seq_len: int  # upper bound of seq_lens (KV length incl. this step's tokens)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    seq_lens: torch.Tensor  # [bs] int32, KV length once this step's tokens are written
    cu_q_lens: torch.Tensor  # [bs + 1] int32, prefix sums of per-sequence query lengths
    block_tables: torch.Tensor  # [bs, max_pages_per_seq] int32, page ids; padding -> page 0
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset: where new KV goes
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the hidden states to sample from
    kv_pool: MLAKVPool
    attn_backend: AttentionBackend
    attn_metadata: Any = field(default=None)  # whatever attn_backend.prepare() built

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE
