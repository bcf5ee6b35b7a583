"""Preallocated device buffers that every forward's inputs and attention metadata live in.

Sized once by `max_num_seqs`, `max_num_tokens` and `max_pages_per_seq`. A step writes its inputs
into prefixes of these buffers and the `ForwardBatch` it returns holds views of them. Because the
storage never moves, a CUDA graph captured against these views replays correctly after the next
step's copies.

Host -> device traffic is one copy per step: every array is packed into a pinned int64 staging
row (two of them, used in turn, so a row is never rewritten while its copy may be in flight),
copied to a device staging row, and split into the typed buffers by device-side copies.

Page tables are not sent whole. A persistent device table holds one row per sequence slot (the
scheduler's `Request.slot`); a step sends only the entries that changed since that row was last
written (a decode step: the pages appended, usually none) and the slot of each batch row, and
the device gathers the batch's rows into `block_tables`. Host work and traffic per step are
O(batch + new pages), not O(batch x pages per sequence).

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
    # Per sequence: the row of the persistent page table it owns (its slot). A row's pages list
    # must only grow while it is the same list object (a new list after pages were freed); then
    # a step uploads only the pages appended since. None: rows 0.. are rewritten whole.
    table_rows: list[int] | None = None

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
        # Persistent page table, one row per slot; row max_num_seqs stays zero (padding rows).
        self._page_rows = zeros(max_num_seqs + 1, max_pages_per_seq, dtype=torch.int32)
        # What each row holds: its length, the pages list it was written from (identity: that
        # list only grows) and its last page (a cheap check that the written prefix is intact).
        self._row_len = [0] * max_num_seqs
        self._row_pages: list[list[int] | None] = [None] * max_num_seqs
        self._row_last: list[int | None] = [None] * max_num_seqs
        self.last_page_writes = 0  # page-table entries the last fill uploaded (tests, benches)

        # Staging: [4 token arrays | seq_lens | cu_q_lens | table rows | n entry indices into
        # the flat page table | n entry values], int64; only the used prefix is uploaded.
        self._staging_len = 4 * max_num_tokens + 3 * max_num_seqs + 1
        self._staging_len += 2 * max_num_seqs * max_pages_per_seq
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
        n_writes = self._stage_page_table(host, stage[off:], bs)

        self._upload(num_tokens, n_logits, bs, n_writes)
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

    def _stage_page_table(self, host: HostBatch, stage: np.ndarray, bs: int) -> int:
        """Stage each batch row's table row and the entries that changed in those rows
        (after `stage[:max_num_seqs]`); returns how many entries."""
        num_seqs, smax, width = host.num_seqs, self.max_num_seqs, self.max_pages_per_seq
        owned = host.table_rows is not None
        rows = host.table_rows if owned else range(num_seqs)
        index: list[int] = []
        values: list[int] = []
        row_len, row_pages, row_last = self._row_len, self._row_pages, self._row_last
        for row, pages in zip(rows, host.block_tables, strict=True):
            n, done, base = len(pages), row_len[row], row * width
            if n > width:
                raise ValueError(f"{n} pages exceed the page table's {width} per sequence")
            if (
                owned
                and row_pages[row] is pages
                and done <= n
                and (done == 0 or pages[done - 1] == row_last[row])
            ):
                if n > done:  # the pages appended since the row was written
                    index.extend(range(base + done, base + n))
                    values.extend(pages[done:])
            else:  # a new owner (or rows that are not owned): the whole row, stale tail zeroed
                index.extend(range(base, base + max(n, done)))
                values.extend(pages)
                values.extend([0] * (done - n))
            row_len[row] = n
            row_pages[row] = pages if owned else None
            row_last[row] = pages[-1] if n else None
        stage[:num_seqs] = rows
        stage[num_seqs:bs] = smax  # padding rows gather the zero row
        k = len(index)
        stage[smax : smax + k] = index
        stage[smax + k : smax + 2 * k] = values
        self.last_page_writes = k
        return k

    def _upload(self, num_tokens: int, n_logits: int, bs: int, n_writes: int) -> None:
        """One host->device copy of the staging row's used prefix, then device-side splits."""
        tmax, smax = self.max_num_tokens, self.max_num_seqs
        table_off = 4 * tmax + 2 * smax + 1
        used = table_off + smax + 2 * n_writes
        src = self._host[self._turn]
        if self._dev is not None:
            self._dev[:used].copy_(src[:used], non_blocking=True)
            src = self._dev
        self.input_ids[:num_tokens].copy_(src[:num_tokens])
        self.positions[:num_tokens].copy_(src[tmax : tmax + num_tokens])
        self.slot_mapping[:num_tokens].copy_(src[2 * tmax : 2 * tmax + num_tokens])
        self.logits_indices[:n_logits].copy_(src[3 * tmax : 3 * tmax + n_logits])
        off = 4 * tmax
        self.seq_lens[:bs].copy_(src[off : off + bs])
        off += smax
        self.cu_q_lens[: bs + 1].copy_(src[off : off + bs + 1])
        off += smax + 1
        writes = src[off + smax : off + smax + 2 * n_writes].view(2, n_writes)
        if n_writes:
            self._page_rows.view(-1).index_copy_(0, writes[0], writes[1].to(torch.int32))
        torch.index_select(self._page_rows, 0, src[off : off + bs], out=self.block_tables[:bs])
