"""Preallocated device buffers that every forward's inputs and attention metadata live in.

Sized once by `max_num_seqs`, `max_num_tokens` and `max_pages_per_seq`. A step writes its inputs
into prefixes of these buffers and the `ForwardBatch` it returns holds views of them. Because the
storage never moves, a CUDA graph captured against these views replays correctly after the next
step's copies.

Host -> device traffic is one copy per step: every array is packed into a pinned int64 staging
row (two of them, used in turn; an event recorded after each row's copy is waited on before the
host writes that row again, so a row is never rewritten while its copy is in flight: overlap
rule 2, `engine/overlap.py`), copied to a device staging row, and split into the typed buffers
by device-side copies. The four int64 token arrays are rows of one device tensor and the two
int32 length arrays rows of another, laid out as in the staging row, so the split is two copies
(each a kernel launch on CUDA), not six. Rows are 256-byte aligned, as separate allocations
would be.

A CUDA graph may replay the split itself (`split`, captured at the start of the graph; `fill`
with `split=False` then stages and uploads only): on a small model a decode step is host-bound,
and the split's three launches are a measurable share of its host time.

A decode step's shapes repeat, so the views a `ForwardBatch` hands out (and the upload's
source and destination views) are built once per shape and reused: a view is a Python object
over the same storage, and creating ~20 of them per step was a sizeable part of its host work.

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
from mlaserve.engine.overlap import RowFences

if TYPE_CHECKING:
    from collections.abc import Sequence

    from mlaserve.engine.prompt_logprobs import PromptLogprobSpan
    from mlaserve.engine.scheduler import ScheduledRequest

__all__ = ["HostBatch", "InputBuffers"]

_ALIGN_BYTES = 256  # each row of the grouped device buffers starts at this alignment
_MAX_SHAPES = 256  # cached view sets; cleared when full


@dataclass
class HostBatch:
    """A step's inputs as host lists, as the scheduler knows them (no device reads)."""

    mode: ForwardMode
    # Token rows: lists, or int64 arrays (`build_host_batch` makes arrays for a batch holding
    # a prompt chunk: `fill` then stages each row in one copy)
    input_ids: list[int] | np.ndarray
    positions: list[int] | np.ndarray
    slot_mapping: list[int] | np.ndarray
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
    # Overlap scheduling: the tokens the previous step sampled, still on the device ([n] int64,
    # >= 0). A row whose input id is -(j + 1) reads future_ids[j] instead; `fill` resolves them
    # on the device after the upload. `future_identity` = m > 0 says the pending rows are
    # exactly rows 0..m-1 reading future_ids[0..m-1] (a steady decode batch): one copy then.
    future_ids: torch.Tensor | None = None
    future_identity: int = 0
    # EXTEND: only the logits rows' final hidden states are read (`ForwardBatch` says what
    # that changes); whoever builds the batch knows whether a draft model reads the others.
    logits_hidden_only: bool = False
    # Per sequence: the scheduler's entry it was built from (`build_host_batch`), so that an
    # error found while staging names the request; empty for batches built by hand.
    scheduled: Sequence[ScheduledRequest] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def owner(self, seq: int) -> str:
        """Sequence `seq`'s request id, for error messages."""
        if seq < len(self.scheduled):
            return self.scheduled[seq].request.request_id
        return f"#{seq} of the batch"

    def owner_of(self, token_row: int) -> str:
        """The request id of the sequence owning token row `token_row` (error messages)."""
        end = 0
        for seq, q_len in enumerate(self.q_lens):
            end += q_len
            if token_row < end:
                return self.owner(seq)
        return f"token row {token_row} (past the batch)"


class InputBuffers:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_pages_per_seq: int,
        device: torch.device,
        num_pages: int | None = None,
    ) -> None:
        """`num_pages`: the KV pool's pages; page ids at or past it are refused when staged
        (a clear error naming the request instead of an out-of-bounds read on the device)."""
        self.max_num_seqs = max_num_seqs
        self.num_pages = num_pages
        self.max_num_tokens = max_num_tokens
        self.max_pages_per_seq = max_pages_per_seq
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        # [4, T]: input ids, positions, KV write slots, logits rows; [2, L] int32: seq_lens
        # (its last column a spare, see `fill`), cu_q_lens. Strides rounded up to 256 bytes.
        self._tok_stride = _round_up(max_num_tokens, _ALIGN_BYTES // 8)
        self._len_stride = _round_up(max_num_seqs + 1, _ALIGN_BYTES // 4)
        self._tokens = zeros(4, self._tok_stride, dtype=torch.int64)
        self._lens = zeros(2, self._len_stride, dtype=torch.int32)
        rows = self._tokens[:, :max_num_tokens].unbind(0)
        self.input_ids, self.positions, self.slot_mapping, self.logits_indices = rows
        self.seq_lens = self._lens[0, :max_num_seqs]
        self.cu_q_lens = self._lens[1, : max_num_seqs + 1]
        self.block_tables = zeros(max_num_seqs, max_pages_per_seq, dtype=torch.int32)
        # Persistent page table, one row per slot; row max_num_seqs stays zero (padding rows).
        self._page_rows = zeros(max_num_seqs + 1, max_pages_per_seq, dtype=torch.int32)
        # What each row holds: its length, the pages list it was written from (identity: that
        # list only grows) and its last page (a cheap check that the written prefix is intact).
        self._row_len = [0] * max_num_seqs
        self._row_pages: list[list[int] | None] = [None] * max_num_seqs
        self._row_last: list[int | None] = [None] * max_num_seqs
        self.last_page_writes = 0  # page-table entries the last fill uploaded (tests, benches)

        # Staging, int64: [the 4 token rows | the 2 length rows | table rows (max_num_seqs) |
        # n entry indices into the flat page table | n entry values, int32, in the first half
        # of n int64 slots]; the row groups have the device tensors' strides. Only the used
        # prefix is uploaded.
        self._table_off = 4 * self._tok_stride + 2 * self._len_stride
        self._staging_len = self._table_off + max_num_seqs
        self._staging_len += 2 * max_num_seqs * max_pages_per_seq
        pin = device.type == "cuda"
        self._host = [
            torch.zeros(self._staging_len, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._turn = 0
        self.fences = RowFences.for_device(2, device)  # overlap rule 2
        self._dev = zeros(self._staging_len, dtype=torch.int64) if pin else None
        # The device staging row's input-id row: where `fill(split=False)` resolves future ids
        # (the split that a graph replays copies them on with the rest).
        self._dev_ids = self._groups(self._dev)[0][0] if pin else None
        # The staging rows' groups (token rows, length rows, the page-table part) as arrays,
        # where `fill` writes them, and as tensors: the upload's sources, per turn (the host
        # rows on CPU; the device row, either turn, on CUDA).
        self._stage_np = [self._groups(h) for h in self._host_np]
        self._sources = [
            self._groups(t) for t in (self._host if self._dev is None else [self._dev] * 2)
        ]
        self._arange = np.arange(max(max_num_tokens, max_num_seqs + 1) + 1)
        # Per shape (num_tokens, n_logits, bs): the batch's views and the upload's destinations.
        self._shapes: dict[tuple[int, int, int], _ShapeViews] = {}

    def fill(
        self,
        host: HostBatch,
        *,
        pad_to: int | None = None,
        max_seq_len: int,
        q_len: int | None = None,
        split: bool = True,
        pad_tokens_to: int | None = None,
        **batch_kwargs,
    ) -> ForwardBatch:
        """Copy a step's inputs into the buffers; returns a ForwardBatch of views.

        `split=False` (CUDA only): stage and upload, but leave the device-side split to a CUDA
        graph that replays `split(batch)` before its forward; the views hold the previous
        step's values until it does. `pad_tokens_to`: the token rows that graph's split copies
        (an EXTEND batch's bucket); rows past the batch are staged as padding.

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
            if host.q_lens.count(q_len) != num_seqs:
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
        if not split and self._dev is None:
            raise ValueError("fill(split=False): the split is left to a CUDA graph; this is CPU")
        real_tokens = len(host.input_ids)
        uniform = mode.is_uniform
        n_logits = num_tokens if uniform else len(host.logits_indices)

        self.fences.before_write(self._turn)
        tokens, (seq_lens, cu), table = self._stage_np[self._turn]
        # Token rows; padded tokens: id 0, position 0, slot 0 (the dummy page).
        tokens[0, :real_tokens] = host.input_ids
        tokens[1, :real_tokens] = host.positions
        tokens[2, :real_tokens] = host.slot_mapping
        tokens[:3, real_tokens : max(num_tokens, pad_tokens_to or 0)] = 0
        tokens[3, :n_logits] = self._arange[:num_tokens] if uniform else host.logits_indices
        seq_lens[:num_seqs] = host.seq_lens
        # Padding rows, and the column after the batch, which the upload copies along.
        seq_lens[num_seqs : bs + 1] = q_len
        if uniform:
            np.multiply(self._arange[: bs + 1], q_len, out=cu[: bs + 1])
        else:  # never padded
            cu[0] = 0
            np.cumsum(np.asarray(host.q_lens), out=cu[1 : num_seqs + 1])
            cu[num_seqs + 1 : bs + 1] = cu[num_seqs]
        n_writes = self._stage_page_table(host, table, bs)

        views = self._views(num_tokens, n_logits, bs)
        self._upload(n_writes)
        if split:
            self._split(views)
        if host.future_ids is not None:
            ids = views.input_ids if split else self._dev_ids
            _resolve_future_ids(ids[:real_tokens], host)
        self._turn ^= 1
        return ForwardBatch(
            mode=mode,
            bs=bs,
            num_tokens=num_tokens,
            q_len=q_len,
            max_seq_len=max_seq_len,
            input_ids=views.input_ids,
            positions=views.positions,
            seq_lens=views.seq_lens,
            cu_q_lens=views.cu_q_lens,
            block_tables=views.block_tables,
            slot_mapping=views.slot_mapping,
            logits_indices=views.logits_indices,
            num_seqs=num_seqs,
            seq_lens_host=None if uniform else list(host.seq_lens),
            q_lens_host=None if uniform else list(host.q_lens),
            logits_hidden_only=host.logits_hidden_only and not uniform,
            **batch_kwargs,
        )

    def split(self, batch: ForwardBatch) -> None:
        """The device-side split of the uploaded staging row into `batch`'s buffers (token rows,
        length rows, the gather of its page-table rows): what `fill` runs after its upload, for
        a CUDA graph to capture ahead of its forward and replay after `fill(split=False)`.
        `batch`: one `fill` returned (its shape picks the views)."""
        if self._dev is None:
            raise ValueError("split: a CUDA graph's split reads the CUDA staging row; this is CPU")
        views = self._views(batch.num_tokens, batch.logits_indices.shape[0], batch.bs)
        self._split(views)

    def pad_tokens(self, start: int, end: int) -> None:
        """Token rows start..end-1 become padding (token 0, position 0, KV write slot 0): the
        rows past a batch that a piecewise prefill graph of `end` tokens replays over."""
        if end > start:
            self._tokens[:3, start:end].zero_()

    def _groups(self, flat):  # np.ndarray or torch.Tensor, a staging row
        """(token rows [4, T], length rows [2, L], the page-table part) of a staging row."""
        ts, ls = self._tok_stride, self._len_stride
        return (
            flat[: 4 * ts].reshape(4, ts),
            flat[4 * ts : 4 * ts + 2 * ls].reshape(2, ls),
            flat[self._table_off :],
        )

    def _views(self, num_tokens: int, n_logits: int, bs: int) -> _ShapeViews:
        key = (num_tokens, n_logits, bs)
        views = self._shapes.get(key)
        if views is None:
            if len(self._shapes) >= _MAX_SHAPES:  # EXTEND shapes vary; decode shapes repeat
                self._shapes.clear()
            width = max(num_tokens, n_logits)
            views = self._shapes[key] = _ShapeViews(
                input_ids=self.input_ids[:num_tokens],
                positions=self.positions[:num_tokens],
                seq_lens=self.seq_lens[:bs],
                cu_q_lens=self.cu_q_lens[: bs + 1],
                block_tables=self.block_tables[:bs],
                slot_mapping=self.slot_mapping[:num_tokens],
                logits_indices=self.logits_indices[:n_logits],
                tokens=self._tokens[:, :width],
                lens=self._lens[:, : bs + 1],
                src_tokens=tuple(tok[:, :width] for tok, _, _ in self._sources),
                src_lens=tuple(lens[:, : bs + 1] for _, lens, _ in self._sources),
                src_rows=tuple(table[:bs] for _, _, table in self._sources),
            )
        return views

    def _stage_page_table(self, host: HostBatch, stage: np.ndarray, bs: int) -> int:
        """Stage each batch row's table row and the entries that changed in those rows
        (after `stage[:max_num_seqs]`); returns how many entries."""
        num_seqs, smax, width = host.num_seqs, self.max_num_seqs, self.max_pages_per_seq
        owned = host.table_rows is not None
        rows = host.table_rows if owned else range(num_seqs)
        index: list[int] = []
        values: list[int] = []
        row_len, row_pages, row_last = self._row_len, self._row_pages, self._row_last
        for seq, (row, pages) in enumerate(zip(rows, host.block_tables, strict=True)):
            n, done, base = len(pages), row_len[row], row * width
            if n > width:
                raise ValueError(
                    f"request {host.owner(seq)}: {n} pages exceed the page table's {width} per "
                    "sequence"
                )
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
        pool = self.num_pages
        if values and pool is not None and not 0 <= min(values) <= max(values) < pool:
            bad = next(v for v in values if not 0 <= v < pool)
            seq = next(i for i, pages in enumerate(host.block_tables) if bad in pages)
            raise ValueError(
                f"request {host.owner(seq)}: page {bad} is outside the KV pool's {pool} pages"
            )
        stage[:num_seqs] = rows
        stage[num_seqs:bs] = smax  # padding rows gather the zero row
        k = len(index)
        stage[smax : smax + k] = index
        # the values as int32, the page table's dtype, in the next k int64 slots: no cast
        # launch before the upload's index_copy_
        stage[smax + k : smax + 2 * k].view(np.int32)[:k] = values
        self.last_page_writes = k
        return k

    def _upload(self, n_writes: int) -> None:
        """One host->device copy of the staging row's used prefix, then the changed page-table
        entries into the persistent table (only when some changed; before the split's gather,
        wherever that runs)."""
        turn, smax = self._turn, self.max_num_seqs
        if self._dev is not None:
            used = self._table_off + smax + 2 * n_writes
            self._dev[:used].copy_(self._host[turn][:used], non_blocking=True)
            self.fences.after_copy(turn)
        if n_writes:
            writes = self._sources[turn][2][smax : smax + 2 * n_writes]
            values = writes[n_writes:].view(torch.int32)[:n_writes]
            self._page_rows.view(-1).index_copy_(0, writes[:n_writes], values)

    def _split(self, views: _ShapeViews) -> None:
        """The token rows, the length rows (with the int32 cast), and the gather of the batch's
        table rows. (On CUDA both turns' sources are the one device staging row, so a graph
        that captured this reads whichever turn uploaded last.)"""
        turn = self._turn
        views.tokens.copy_(views.src_tokens[turn])
        views.lens.copy_(views.src_lens[turn])
        torch.index_select(self._page_rows, 0, views.src_rows[turn], out=views.block_tables)


def _resolve_future_ids(input_ids: torch.Tensor, host: HostBatch) -> None:
    """Rows staged as -(j + 1) take the previous step's sampled token j, on the device."""
    future, m = host.future_ids, host.future_identity
    if m:
        input_ids[:m].copy_(future[:m])
        return
    index = (-1 - input_ids).clamp_(min=0)  # rows with real ids read future[0], then drop it
    torch.where(input_ids < 0, future[index], input_ids, out=input_ids)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class _ShapeViews:
    """The buffers' views for one batch shape: what a ForwardBatch holds, the upload's
    destinations (`tokens` [4, max(num_tokens, n_logits)], `lens` [2, bs + 1]) and its
    sources, per turn (the same columns of the staging rows, and the batch's table rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    cu_q_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    tokens: torch.Tensor
    lens: torch.Tensor
    src_tokens: tuple[torch.Tensor, torch.Tensor]
    src_lens: tuple[torch.Tensor, torch.Tensor]
    src_rows: tuple[torch.Tensor, torch.Tensor]
