"""The per-forward state passed from the model runner through the model to the attention backend.

A `ForwardBatch` is built once per forward (or once per captured CUDA graph) and holds *views* of
the runner's preallocated device buffers. Nothing here is a module global: the model and the
attention backend receive the batch as an argument.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

if TYPE_CHECKING:
    from mlaserve.kv_cache.kv_pool import MLAKVPool

__all__ = ["BatchAttention", "ForwardBatch", "ForwardMode"]


class ForwardMode(enum.Enum):
    """What a forward is. Set by whoever builds the batch (the scheduler for EXTEND/DECODE, the
    speculative decoder for VERIFY/DRAFT_EXTEND); never inferred from the shapes.

    EXTEND: ragged; sequence b owns rows `cu_q_lens[b]:cu_q_lens[b+1]` of the token arrays. Any
        forward that contains prompt tokens (prefill chunks, possibly mixed with decodes, and
        recomputation after preemption). Attention goes through the backend's prefill path.
    DECODE: one new token per sequence (q_len = 1).
    VERIFY: the target scores k+1 tokens per sequence (q_len = k+1), causal among them.
    DRAFT_EXTEND: the draft model re-reads the k+1 verified rows per sequence (fixed stride).

    The last three are *uniform*: every sequence has exactly `q_len` new tokens, rows
    `b*q_len:(b+1)*q_len`. They are the CUDA-graph shapes and the only ones a backend's decode
    kernel ever sees (with q_len <= its `max_uniform_q_len`).
    """

    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"
    DRAFT_EXTEND = "draft_extend"

    @property
    def is_uniform(self) -> bool:
        return self is not ForwardMode.EXTEND


class BatchAttention(Protocol):
    """The attention backend as the model reaches it through `batch.attn_backend`. Declared
    here because this module sits below kernels_adapter and must not import it;
    `kernels_adapter.base.AttentionBackend` satisfies it (shapes and contract are there)."""

    mha_extend: ClassVar[bool]
    accepts_written_kv: ClassVar[bool]

    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...

    def joined_q_dtype(self, batch: ForwardBatch) -> torch.dtype | None: ...

    def forward_joined(
        self, layer_id: int, q: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def forward_extend_mha(
        self,
        layer_id: int,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """Inputs of one model forward. Shapes use bs = sequences, T = tokens (T = bs*q_len in DECODE).

    Host ints (`bs`, `num_tokens`, `q_len`, `max_seq_len`) are known to the scheduler without
    reading device memory; under CUDA graphs they are the captured (padded) sizes and
    `max_seq_len` is `max_model_len`, so nothing is read back from the GPU per step. Padded rows
    (`num_seqs <= b < bs`) are filled on purpose: page table row of zeros (the dummy page 0),
    KV write slot 0 (inside page 0), seq_len 1, token 0, position 0.
    """

    mode: ForwardMode
    bs: int
    num_tokens: int
    q_len: int  # uniform modes: tokens per sequence; EXTEND: the largest q length in the batch
    max_seq_len: int  # upper bound of seq_lens (KV length incl. this step's tokens)
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its sequence
    seq_lens: torch.Tensor  # [bs] int32, KV length once this step's tokens are written
    cu_q_lens: torch.Tensor  # [bs + 1] int32, prefix sums of per-sequence query lengths
    block_tables: torch.Tensor  # [bs, max_pages_per_seq] int32, page ids; padding -> page 0
    slot_mapping: torch.Tensor  # [T] int64, page_id * page_size + offset: where new KV goes
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the hidden states to sample from
    kv_pool: MLAKVPool
    attn_backend: BatchAttention
    attn_metadata: Any = field(default=None)  # whatever attn_backend.prepare() built
    num_seqs: int = -1  # real (unpadded) sequences; rows >= num_seqs are padding. -1: = bs
    # EXTEND batches run eagerly, so the host's own per-sequence lengths come along for kernels
    # that size ragged work on the host (prefill). None in uniform modes: graphs never read them.
    seq_lens_host: list[int] | None = None
    q_lens_host: list[int] | None = None
    # EXTEND only. True: the caller reads the final hidden states of the `logits_indices` rows
    # alone (no draft model reads this forward's other rows), so the last layer runs its o_proj
    # and FFN on those rows only and the model returns [num_logits, hidden]. Every layer's KV,
    # the last one's included, is still written for every row. False: every row's.
    logits_hidden_only: bool = False

    def __post_init__(self) -> None:
        if self.num_seqs < 0:
            self.num_seqs = self.bs
        if self.mode.is_uniform and self.num_tokens != self.bs * self.q_len:
            raise ValueError(
                f"{self.mode.value} batch: {self.num_tokens} tokens != bs {self.bs} x q_len "
                f"{self.q_len}"
            )
        if self.logits_hidden_only and self.mode.is_uniform:
            raise ValueError(
                f"{self.mode.value} batch: logits_hidden_only is for EXTEND (a uniform batch's "
                "logits rows are all of its rows)"
            )
