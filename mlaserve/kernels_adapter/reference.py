"""Pure-torch MLA attention over the paged cache: the oracle for every other backend.

It gathers each sequence's pages through its page table, dequantizes to fp32, and computes
softmax(q . k * scale) @ c_kv with an explicit causal mask. Works on CPU and CUDA, in EXTEND
(ragged) and DECODE (uniform q_len) modes, without reading device values on the host, so its
DECODE path can be captured in a CUDA graph. Keys past a sequence's length are zeroed before use,
so stale or NaN-poisoned cache pages cannot leak into the result.

Per tensor-parallel rank it attends its own `num_heads` heads (q_nope [T, H_rank, r], q_pe
[T, H_rank, d_r] -> [T, H_rank, r]) over the whole latent cache, which has no head axis; heads
are independent, so a rank's output is TP1's output sliced to its heads. It sizes nothing per
head, but still refuses a query with another head count (`check_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from mlaserve.kernels_adapter.base import AttentionBackend

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["ReferenceBackend"]


@dataclass
class _Metadata:
    num_pages: int  # page-table columns to gather (covers max_seq_len)
    token_index: torch.Tensor | None  # [bs, q_len] row of each (seq, query) in the token arrays
    q_valid: torch.Tensor | None  # [bs, q_len] bool, False for padding of ragged batches
    visible: torch.Tensor  # [bs, q_len, S] bool, key s visible to query row
    key_valid: torch.Tensor  # [bs, S] bool, s < seq_len


class ReferenceBackend(AttentionBackend):
    name: ClassVar[str] = "reference"
    supports_cuda_graph: ClassVar[bool] = True
    accepts_written_kv: ClassVar[bool] = True

    def prepare(self, batch: ForwardBatch) -> None:
        q_len, device = batch.q_len, batch.seq_lens.device
        num_pages = min(-(-batch.max_seq_len // self.page_size), batch.block_tables.shape[1])
        seq_lens = batch.seq_lens.long()
        q_lens = (batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]).long()
        rows = torch.arange(q_len, device=device)
        if batch.mode.is_uniform:
            token_index = q_valid = None
        else:
            q_valid = rows[None, :] < q_lens[:, None]
            token_index = (batch.cu_q_lens[:-1, None].long() + rows[None, :]).clamp_(
                max=max(batch.num_tokens - 1, 0)
            )
        # Absolute position of query row i: L - q_len_b + i; clamp keeps padded rows finite.
        q_pos = (seq_lens[:, None] - q_lens[:, None] + rows[None, :]).clamp_(min=0)
        keys = torch.arange(num_pages * self.page_size, device=device)
        batch.attn_metadata = _Metadata(
            num_pages=num_pages,
            token_index=token_index,
            q_valid=q_valid,
            visible=keys[None, None, :] <= q_pos[:, :, None],
            key_valid=keys[None, :] < seq_lens[:, None],
        )

    def forward(
        self,
        layer_id: int,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor | None,
        k_pe: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        meta: _Metadata = batch.attn_metadata
        self.check_heads(q_nope, "q_nope")
        self.check_heads(q_pe, "q_pe")
        if kv_c is not None:  # else the layer has written it (`accepts_written_kv`)
            batch.kv_pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
        num_tokens, num_heads, rank = q_nope.shape
        q = torch.cat([q_nope, q_pe], dim=-1).float()  # [T, H, 576]
        if meta.token_index is None:
            qb = q.view(batch.bs, batch.q_len, num_heads, -1)
        else:
            qb = q[meta.token_index]  # [bs, q_len, H, 576]

        kv = batch.kv_pool.gather(layer_id, batch.block_tables[:, : meta.num_pages])  # [bs,S,576]
        kv = torch.where(meta.key_valid[:, :, None], kv, 0.0)
        scores = torch.einsum("bqhd,bsd->bqhs", qb, kv) * self.softmax_scale
        scores = scores.masked_fill(~meta.visible[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bqhs,bsc->bqhc", probs, kv[..., :rank])  # [bs, q_len, H, 512]

        if meta.token_index is None:
            return out.reshape(num_tokens, num_heads, rank).to(q_nope.dtype)
        result = q_nope.new_zeros(num_tokens, num_heads, rank)
        flat_index = meta.token_index[meta.q_valid]
        result[flat_index] = out[meta.q_valid].to(q_nope.dtype)
        return result
