"""The attention backend of the deterministic (batch-invariant) mode: every phase absorbed.

`EngineConfig.deterministic_inference` selects it (and nothing else does by `auto`). EXTEND,
DECODE, VERIFY and DRAFT_EXTEND batches all take the same path: the layer hands it the absorbed
query (q_nope @ W_UK, `ops/invariant_matmul.py`) and the new tokens' latent KV; `forward` writes
that KV into the pool first, then runs `ops/invariant_mla_attention.py`, where each query row
attends its own keys 0..p straight from the cache (grid over rows; no split over keys, no MHA
prefill, no fresh-chunk kernel). So a token's attention output is bitwise the same whether it
is computed in a prompt chunk of any size, a decode step of any batch, a verify or a draft row,
or a recomputation after preemption (keys come from the cache in its dtype in every case).

`prepare` turns the batch's layout into two [T] int32 vectors on the device (no host read:
capturable): each row's sequence and its absolute position p = seq_len - q_len + i (the same
rule as every backend, `base.py`). Rows past the batch's tokens (a padded bucket) attend key 0
of the last sequence: finite, never read, and they do not touch real rows.

Off CUDA (fused ops off) the torch form of the kernel runs (`rowwise_mla_attention`), one row
at a time: invariant too, eager only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from mlaserve.kernels_adapter.base import AttentionBackend
from mlaserve.ops import fused_ops_enabled

if TYPE_CHECKING:
    from mlaserve.engine.forward_batch import ForwardBatch

__all__ = ["InvariantBackend"]


@dataclass
class _Metadata:
    row_seq: torch.Tensor  # [T] int32, the sequence of each query row
    row_pos: torch.Tensor  # [T] int32, its absolute position: it sees keys 0..row_pos


class InvariantBackend(AttentionBackend):
    name: ClassVar[str] = "invariant"
    supports_cuda_graph: ClassVar[bool] = True
    accepts_written_kv: ClassVar[bool] = True
    # one row per program at any q_len: the limit is only what the engine sizes for
    max_uniform_q_len: ClassVar[int] = 64

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if fused_ops_enabled(self.device):
            from mlaserve.ops.invariant_mla_attention import invariant_mla_attention as attend
        else:
            from mlaserve.ops.invariant_rowwise import rowwise_mla_attention as attend
        self._attend = attend

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        t = torch.arange(batch.num_tokens, device=device)
        cu = batch.cu_q_lens.long()
        if batch.mode.is_uniform:
            seq = t // batch.q_len
            first, q_len = seq * batch.q_len, batch.q_len
        else:
            # searchsorted over the ends: the sequence whose rows hold t; past the last
            # sequence's rows (padding), the last sequence
            seq = torch.searchsorted(cu[1 : batch.bs + 1], t, right=True).clamp_(max=batch.bs - 1)
            first, q_len = cu[seq], cu[seq + 1] - cu[seq]
        seq_len = batch.seq_lens.long()[seq]
        pos = (seq_len - q_len + (t - first)).clamp_(min=0)
        pos = torch.minimum(pos, (seq_len - 1).clamp_(min=0))
        if not batch.mode.is_uniform:
            pos = pos.masked_fill_(t >= cu[batch.bs], 0)
        batch.attn_metadata = _Metadata(row_seq=seq.to(torch.int32), row_pos=pos.to(torch.int32))

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
        pool = batch.kv_pool
        if kv_c is not None:  # first: every row's keys, its own included, come from the cache
            pool.write(layer_id, batch.slot_mapping, kv_c, k_pe)
        return self._attend(
            q_nope,
            q_pe,
            pool.kv_buffers[layer_id],
            pool.k_scales[layer_id],
            batch.block_tables,
            meta.row_seq,
            meta.row_pos,
            self.softmax_scale,
        )
