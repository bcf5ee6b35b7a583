"""InputBuffers' persistent page table: a step uploads only the page-table entries that changed,
and the gathered `block_tables` always equal the rows written whole."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch, InputBuffers
from tests.device_ops import DeviceOps

WIDTH = 8  # pages per sequence


def buffers(max_num_seqs: int = 4) -> InputBuffers:
    return InputBuffers(
        max_num_seqs=max_num_seqs,
        max_num_tokens=32,
        max_pages_per_seq=WIDTH,
        device=torch.device("cpu"),
    )


def decode(tables: list[list[int]], rows: list[int] | None) -> HostBatch:
    n = len(tables)
    return HostBatch(
        ForwardMode.DECODE, [1] * n, [0] * n, [0] * n, [1] * n, [1] * n, tables, [], table_rows=rows
    )


def fill(bufs: InputBuffers, host: HostBatch, pad_to: int | None = None) -> list[list[int]]:
    batch = bufs.fill(host, pad_to=pad_to, max_seq_len=64, kv_pool=None, attn_backend=None)
    return batch.block_tables.tolist()


def whole(tables: list[list[int]], bs: int) -> list[list[int]]:
    rows = [pages + [0] * (WIDTH - len(pages)) for pages in tables]
    return rows + [[0] * WIDTH] * (bs - len(tables))


def test_a_decode_step_uploads_only_appended_pages() -> None:
    bufs = buffers()
    a, b = [3, 4], [7]
    assert fill(bufs, decode([a, b], [2, 0])) == whole([a, b], 2)
    assert bufs.last_page_writes == 3  # new rows: written whole
    assert fill(bufs, decode([a, b], [2, 0]), pad_to=4) == whole([a, b], 4)
    assert bufs.last_page_writes == 0  # nothing appended
    a.append(9)
    assert fill(bufs, decode([b, a], [0, 2])) == whole([b, a], 2)  # any batch order
    assert bufs.last_page_writes == 1


def test_a_new_owner_rewrites_the_row_and_clears_its_tail() -> None:
    bufs = buffers()
    fill(bufs, decode([[1, 2, 3, 4]], [1]))
    new = [5]  # the slot's next request (or the same one after preemption: a new list)
    assert fill(bufs, decode([new], [1])) == whole([new], 1)
    assert bufs.last_page_writes == 4  # one page and three stale entries zeroed


def test_a_list_that_shrank_or_changed_is_rewritten() -> None:
    bufs = buffers()
    pages = [1, 2, 3]
    fill(bufs, decode([pages], [0]))
    del pages[1:]
    assert fill(bufs, decode([pages], [0])) == whole([[1]], 1)
    pages[:] = [1, 6, 7]  # regrown to the old length with other pages
    assert fill(bufs, decode([pages], [0])) == whole([[1, 6, 7]], 1)


def test_batches_without_rows_are_written_whole_and_do_not_confuse_owned_rows() -> None:
    bufs = buffers()
    owned = [1, 2]
    fill(bufs, decode([owned], [0]))
    assert fill(bufs, decode([[9, 9, 9]], None)) == whole([[9, 9, 9]], 1)  # row 0, unowned
    assert fill(bufs, decode([owned], [0])) == whole([owned], 1)


def test_random_steps_match_whole_rows() -> None:
    """Admissions, growth, finishes and preemptions in random order over many steps."""
    rng = random.Random(0)
    slots = 4
    bufs = buffers(slots)
    tables: list[list[int] | None] = [None] * slots
    for _ in range(500):
        for s in range(slots):
            if tables[s] is None or rng.random() < 0.1:
                tables[s] = [rng.randrange(1, 100) for _ in range(rng.randint(0, 3))]
            elif len(tables[s]) < WIDTH and rng.random() < 0.3:
                tables[s].append(rng.randrange(1, 100))
        batch = rng.sample(range(slots), rng.randint(1, slots))
        got = fill(bufs, decode([tables[s] for s in batch], batch), pad_to=slots)
        assert got == whole([tables[s] for s in batch], slots)


def test_more_pages_than_the_table_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="pages exceed"):
        fill(buffers(), decode([list(range(1, WIDTH + 2))], [0]))


def test_every_array_is_written_with_explicit_padding() -> None:
    """Token arrays, lengths and logits rows of an EXTEND batch, then of a padded decode batch
    after it: nothing the larger batch left survives into a padded row."""
    bufs = buffers()
    extend = HostBatch(
        ForwardMode.EXTEND, [5, 6, 7, 8, 9], [0, 1, 2, 0, 1], [8, 9, 10, 16, 17], [3, 2],
        [3, 2], [[1], [2]], [2, 4], table_rows=[0, 1],
    )  # fmt: skip
    batch = bufs.fill(extend, max_seq_len=64, kv_pool=None, attn_backend=None)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1]
    assert batch.slot_mapping.tolist() == [8, 9, 10, 16, 17]
    assert batch.logits_indices.tolist() == [2, 4]
    assert batch.seq_lens.tolist() == [3, 2]
    assert batch.cu_q_lens.tolist() == [0, 3, 5]
    step = HostBatch(
        ForwardMode.DECODE, [3], [3], [11], [4], [1], [[1]], [], table_rows=[0]
    )  # fmt: skip
    batch = bufs.fill(step, pad_to=4, max_seq_len=64, kv_pool=None, attn_backend=None)
    assert batch.input_ids.tolist() == [3, 0, 0, 0]
    assert batch.positions.tolist() == [3, 0, 0, 0]
    assert batch.slot_mapping.tolist() == [11, 0, 0, 0]
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.seq_lens.tolist() == [4, 1, 1, 1]
    assert batch.cu_q_lens.tolist() == [0, 1, 2, 3, 4]
    assert batch.block_tables.tolist() == whole([[1]], 4)


def test_a_decode_fill_is_two_copies_and_one_gather() -> None:
    """Token rows and length rows are one copy each (on CUDA plus the one host->device copy,
    which a CPU buffer does not need), the table rows one gather; no page writes when no page
    was appended."""
    bufs = buffers()
    tables = [[1, 2], [3]]
    fill(bufs, decode(tables, [0, 1]), pad_to=4)
    with DeviceOps() as counted:
        bufs.fill(decode(tables, [0, 1]), pad_to=4, max_seq_len=64, kv_pool=None, attn_backend=None)
    assert dict(counted.ops) == {"copy_": 2, "index_select": 1}


def test_the_buffers_are_separate_aligned_rows() -> None:
    bufs = InputBuffers(
        max_num_seqs=5, max_num_tokens=33, max_pages_per_seq=3, device=torch.device("cpu")
    )
    arrays = [bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.logits_indices]
    assert all(a.shape == (33,) and a.dtype == torch.int64 for a in arrays)
    assert bufs.seq_lens.shape == (5,) and bufs.cu_q_lens.shape == (6,)
    lens = [bufs.seq_lens, bufs.cu_q_lens]
    for group in (arrays, lens):  # each group is one allocation, its rows 256-byte apart
        assert all((a.data_ptr() - group[0].data_ptr()) % 256 == 0 for a in group)
    spans = sorted(
        (a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()) for a in arrays + lens
    )
    assert all(a.is_contiguous() for a in arrays + lens)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # no overlap


def test_leaving_the_split_to_a_graph_needs_cuda() -> None:
    """`fill(split=False)` stages for a CUDA graph that replays the split itself; on CPU there
    is no device staging row for it to read, and asking is a clear error, not a stale batch."""
    buffers = InputBuffers(max_num_seqs=4, max_num_tokens=16, max_pages_per_seq=4,
                           device=torch.device("cpu"))  # fmt: skip
    host = HostBatch(ForwardMode.DECODE, [5], [3], [3], [4], [1], [[1]], [])
    with pytest.raises(ValueError, match="split"):
        buffers.fill(host, max_seq_len=4, split=False, kv_pool=None, attn_backend=None)
    batch = buffers.fill(host, max_seq_len=4, kv_pool=None, attn_backend=None)
    with pytest.raises(ValueError, match="split"):
        buffers.split(batch)
