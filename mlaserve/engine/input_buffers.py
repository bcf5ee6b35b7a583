"""Preallocated device buffers that every forward's inputs and attention metadata live in.

Sized once by `max_num_seqs`, `max_num_tokens` and `max_pages_per_seq`. A step writes its inputs
into prefixes of these buffers (one host->device copy per array) and the `ForwardBatch` it
returns holds views of them. Because the storage never moves, a CUDA graph captured against
these views replays correctly after the next step's copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode

__all__ = ["HostBatch", "InputBuffers"]


@dataclass
class HostBatch:
    """A step's inputs as host lists, as the scheduler knows them (no device reads)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]  # per sequence: KV length after this step
    q_lens: list[int]  # per sequence: new tokens this step
    block_tables: list[list[int]]  # per sequence: its pages (unpadded)
    logits_indices: list[int]  # token rows to compute logits for

    @property
    def is_uniform(self) -> bool:
        return len(set(self.q_lens)) == 1


class InputBuffers:
    def __init__(
        self, max_num_seqs: int, max_num_tokens: int, max_pages_per_seq: int, device: torch.device
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_pages_per_seq = max_pages_per_seq
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_num_tokens, dtype=torch.int64)
        self.positions = zeros(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = zeros(max_num_tokens, dtype=torch.int64)
        self.logits_indices = zeros(max_num_tokens, dtype=torch.int64)
        self.seq_lens = zeros(max_num_seqs, dtype=torch.int32)
        self.cu_q_lens = zeros(max_num_seqs + 1, dtype=torch.int32)
        self.block_tables = zeros(max_num_seqs, max_pages_per_seq, dtype=torch.int32)
        self._pin = device.type == "cuda"

    def _copy(self, dst: torch.Tensor, values: list[int] | torch.Tensor) -> None:
        src = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dst.dtype)
        if self._pin:
            src = src.pin_memory()
        dst[: src.shape[0]].copy_(src, non_blocking=self._pin)

    def fill(self, host: HostBatch, **batch_kwargs) -> ForwardBatch:
        """Copy a step's inputs into the buffers; returns a ForwardBatch of views.

        `batch_kwargs` supplies `kv_pool`, `attn_backend` and `max_seq_len`.
        """
        bs, num_tokens = len(host.seq_lens), len(host.input_ids)
        if bs > self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(f"batch of {bs} seqs / {num_tokens} tokens exceeds the buffers")
        table = torch.zeros(bs, self.max_pages_per_seq, dtype=torch.int32)
        for i, pages in enumerate(host.block_tables):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        cu_q_lens = [0]
        for n in host.q_lens:
            cu_q_lens.append(cu_q_lens[-1] + n)

        self._copy(self.input_ids, host.input_ids)
        self._copy(self.positions, host.positions)
        self._copy(self.slot_mapping, host.slot_mapping)
        self._copy(self.logits_indices, host.logits_indices)
        self._copy(self.seq_lens, host.seq_lens)
        self._copy(self.cu_q_lens, cu_q_lens)
        self._copy(self.block_tables.view(-1), table.view(-1))

        uniform = host.is_uniform
        return ForwardBatch(
            mode=ForwardMode.DECODE if uniform else ForwardMode.EXTEND,
            bs=bs,
            num_tokens=num_tokens,
            q_len=max(host.q_lens),
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            seq_lens=self.seq_lens[:bs],
            cu_q_lens=self.cu_q_lens[: bs + 1],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:num_tokens],
            logits_indices=self.logits_indices[: len(host.logits_indices)],
            **batch_kwargs,
        )
