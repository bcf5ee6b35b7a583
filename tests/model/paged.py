"""Test helper: a paged KV pool plus the bookkeeping to build `ForwardBatch`es by hand.

The engine has its own batch builder; this one is deliberately independent so the model's
tests do not depend on it. Every cache page starts NaN-poisoned: a backend that reads a slot
it should not (unwritten, past a sequence's length, the dummy page 0) turns the logits NaN.
"""

from __future__ import annotations

import torch

from mlaserve.config import ModelConfig
from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.kernels_adapter.reference import ReferenceBackend
from mlaserve.kv_cache import MLAKVPool, PageAllocator


class PagedCache:
    def __init__(
        self,
        config: ModelConfig,
        *,
        kv_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int = 4,
        num_pages: int = 160,
        num_layers: int | None = None,
        max_model_len: int = 256,
        num_heads: int | None = None,
    ) -> None:
        """`num_heads`: the heads one tensor-parallel rank attends (None: all of them)."""
        self.device = torch.device(device)
        self.page_size = page_size
        self.pool = MLAKVPool(
            num_layers if num_layers is not None else config.num_hidden_layers,
            num_pages,
            page_size,
            config.kv_lora_rank,
            config.qk_rope_head_dim,
            kv_dtype,
            self.device,
        )
        for buf in self.pool.kv_buffers:
            buf.fill_(float("nan"))
        self.allocator = PageAllocator(num_pages)
        self.backend = ReferenceBackend(
            config, page_size, kv_dtype, self.device, 64, max_model_len, num_heads=num_heads
        )
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def batch(
        self, chunks: list[tuple[int, list[int]]], mode: ForwardMode = ForwardMode.EXTEND
    ) -> ForwardBatch:
        """chunks: (sequence id, new token ids) per sequence, appended after what the sequence
        already has in the cache. Returns a prepared batch whose logits_indices cover all rows."""
        q_lens = [len(ids) for _, ids in chunks]
        if mode is ForwardMode.DECODE and len(set(q_lens)) != 1:
            raise ValueError(f"DECODE needs a uniform q_len, got {q_lens}")
        input_ids, positions, slots, seq_lens, tables = [], [], [], [], []
        for seq_id, ids in chunks:
            start = self.lens.get(seq_id, 0)
            end = start + len(ids)
            pages = self.pages.setdefault(seq_id, [])
            need = -(-end // self.page_size) - len(pages)
            if need > 0:
                pages += self.allocator.allocate(need)
            input_ids += ids
            positions += range(start, end)
            slots += [
                pages[p // self.page_size] * self.page_size + p % self.page_size
                for p in range(start, end)
            ]
            seq_lens.append(end)
            tables.append(pages)
            self.lens[seq_id] = end
        width = max(len(t) for t in tables)
        dev = self.device
        batch = ForwardBatch(
            mode=mode,
            bs=len(chunks),
            num_tokens=len(input_ids),
            q_len=max(q_lens),
            max_seq_len=max(seq_lens),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_q_lens=torch.tensor(
                [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev
            ),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev
            ),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(len(input_ids), device=dev),
            kv_pool=self.pool,
            attn_backend=self.backend,
        )
        self.backend.prepare(batch)
        return batch
