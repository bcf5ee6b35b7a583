"""Preallocated device buffers that every forward's inputs and attention metadata live in.

Sized once by `max_num_seqs`, `max_num_tokens` and `max_pages_per_seq`. A step writes its inputs
into prefixes of these buffers and the `ForwardBatch` it returns holds views of them. Because the
storage never moves, a CUDA graph captured against these views replays correctly after the next
step's copies.

Host -> device traffic is one copy per step: every array is packed into a pinned int64 staging
row (two of them, used in turn, so a row is never rewritten while its copy may be in flight),
copied to a device staging row, and split into the typed buffers by device-side copies.

Padding (CUDA-graph replay of a smaller batch in a larger graph) is explicit: rows
`num_seqs <= b < bs` get token 0, position 0, KV write slot 0 (page 0, the dummy page the
allocator never hands out), a page-table row of zeros and seq_len = q_len (the fewest keys a
causal row may see). Nothing a previous step left in the buffers survives into a padded row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from mlaserve.engine.prompt_logprobs import PromptLogprobSpan

__all__ = ["HostBatch", "InputBuffers"]


@dataclass
class HostBatch:
    """A step's inputs as host lists, as the scheduler knows them (no device reads)."""

    mode: ForwardMode
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]  # per sequence: KV length after this step
    q_lens: list[int]  # per sequence: new tokens this step
    block_tables: list[list[int]]  # per sequence: its pages (unpadded)
    logits_indices: list[int]  # token rows to compute logits for (EXTEND only; see fill)
    # EXTEND only: prompt positions scored for prompt logprobs. Their rows follow the sampling
    # rows in logits_indices (see engine/prompt_logprobs.py); empty unless a request asked.
    prompt_spans: list[PromptLogprobSpan] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


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

        # Staging: [4 token arrays | seq_lens | cu_q_lens | block table], int64.
        self._staging_len = 4 * max_num_tokens + 2 * max_num_seqs + 1
        self._staging_len += max_num_seqs * max_pages_per_seq
        pin = device.type == "cuda"
        self._host = [
            torch.zeros(self._staging_len, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._turn = 0
        self._dev = zeros(self._staging_len, dtype=torch.int64) if pin else None

    def fill(
        self,
        host: HostBatch,
        *,
        pad_to: int | None = None,
        max_seq_len: int,
        q_len: int | None = None,
        **batch_kwargs,
    ) -> ForwardBatch:
        """Copy a step's inputs into the buffers; returns a ForwardBatch of views.

        `pad_to`: the captured batch size this step replays in (uniform modes only); rows past
        `host.num_seqs` are padding. `q_len`: the uniform tokens per sequence (default: the
        host rows'; needed only for a batch made of padding alone, as at graph capture).
        Uniform modes compute logits for every row (the sampler or the speculative decoder picks
        what it needs); EXTEND for `host.logits_indices`. `batch_kwargs` supplies `kv_pool` and
        `attn_backend`.
        """
        mode, num_seqs = host.mode, host.num_seqs
        bs = num_seqs if pad_to is None else pad_to
        if mode.is_uniform:
            q_len = q_len or host.q_lens[0]
            if any(n != q_len for n in host.q_lens):
                raise ValueError(f"{mode.value} batch: q_lens must be uniform, got {host.q_lens}")
            num_tokens = bs * q_len
        else:
            if pad_to is not None:
                raise ValueError("EXTEND batches are never padded (they run eagerly)")
            q_len = max(host.q_lens)
            num_tokens = len(host.input_ids)
        if bs < num_seqs or bs > self.max_num_seqs or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"batch of {num_seqs} seqs (padded to {bs}) / {num_tokens} tokens exceeds the "
                f"buffers ({self.max_num_seqs} seqs / {self.max_num_tokens} tokens)"
            )
        real_tokens = len(host.input_ids)
        n_logits = num_tokens if mode.is_uniform else len(host.logits_indices)
        tmax, smax = self.max_num_tokens, self.max_num_seqs

        stage = self._host_np[self._turn]
        # Token arrays; padded tokens: id 0, position 0, slot 0 (the dummy page).
        for k, values in enumerate((host.input_ids, host.positions, host.slot_mapping)):
            view = stage[k * tmax : k * tmax + num_tokens]
            view[:real_tokens] = values
            view[real_tokens:] = 0
        logits = stage[3 * tmax : 3 * tmax + n_logits]
        logits[:] = np.arange(num_tokens) if mode.is_uniform else host.logits_indices
        off = 4 * tmax
        seq_lens = stage[off : off + bs]
        seq_lens[:num_seqs] = host.seq_lens
        seq_lens[num_seqs:] = q_len
        off += smax
        cu = stage[off : off + bs + 1]
        cu[0] = 0
        np.cumsum(host.q_lens, out=cu[1 : num_seqs + 1])
        cu[num_seqs + 1 :] = cu[num_seqs] + q_len * np.arange(1, bs - num_seqs + 1)
        off += smax + 1
        table = stage[off : off + bs * self.max_pages_per_seq].reshape(bs, -1)
        table[:] = 0
        for i, pages in enumerate(host.block_tables):
            table[i, : len(pages)] = pages

        self._upload(num_tokens, n_logits, bs)
        self._turn ^= 1
        return ForwardBatch(
            mode=mode,
            bs=bs,
            num_tokens=num_tokens,
            q_len=q_len,
            max_seq_len=max_seq_len,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            seq_lens=self.seq_lens[:bs],
            cu_q_lens=self.cu_q_lens[: bs + 1],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:num_tokens],
            logits_indices=self.logits_indices[:n_logits],
            num_seqs=num_seqs,
            seq_lens_host=None if mode.is_uniform else list(host.seq_lens),
            q_lens_host=None if mode.is_uniform else list(host.q_lens),
            **batch_kwargs,
        )

    def _upload(self, num_tokens: int, n_logits: int, bs: int) -> None:
        """One host->device copy of the staging row, then device-side splits."""
        src = self._host[self._turn]
        if self._dev is not None:
            self._dev.copy_(src, non_blocking=True)
            src = self._dev
        tmax, smax, pages = self.max_num_tokens, self.max_num_seqs, self.max_pages_per_seq
        self.input_ids[:num_tokens].copy_(src[:num_tokens])
        self.positions[:num_tokens].copy_(src[tmax : tmax + num_tokens])
        self.slot_mapping[:num_tokens].copy_(src[2 * tmax : 2 * tmax + num_tokens])
        self.logits_indices[:n_logits].copy_(src[3 * tmax : 3 * tmax + n_logits])
        off = 4 * tmax
        self.seq_lens[:bs].copy_(src[off : off + bs])
        off += smax
        self.cu_q_lens[: bs + 1].copy_(src[off : off + bs + 1])
        off += smax + 1
        self.block_tables[:bs].view(-1).copy_(src[off : off + bs * pages])
