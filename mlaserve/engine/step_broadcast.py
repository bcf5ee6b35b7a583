"""A step's inputs from rank 0 to the other tensor-parallel ranks: the host batch as int64.

Rank 0 owns the scheduler; the other ranks run the same forward on the same inputs. What they
need is exactly what `InputBuffers.fill` stages from a `HostBatch` (plus the `make_batch`
arguments), so that is what crosses: two broadcasts per step over the control group (gloo, CPU
tensors; `engine/tp_workers.py` makes it), never a pickled request.

    header  int64 [HEADER_LEN]: op, mode, T, S, L, P, has_table_rows, logits_hidden_only,
            pad_to, max_seq_len, q_len, body length (-1: None)
    body    int64 [T + T + T + S + S (+ S) + S + P + L]:
            input_ids | positions | slot_mapping | seq_lens | q_lens | (table_rows) |
            pages per sequence | the pages, flat | logits_indices

T tokens, S sequences, L logits rows, P page-table entries. A STOP header (op 1) has no body:
the workers leave their loop. Ownership: rank 0 builds the body fresh each step (nothing of it
outlives `send`); a worker's `receive` returns a `HostBatch` of its own arrays, which its own
`InputBuffers` stage, as rank 0's stage its own. Page tables travel whole (a worker's
`InputBuffers` sees new list objects every step and rewrites those rows): O(batch x pages) int64
per step, small next to a forward; the per-slot diff is a later refinement.

Not here: overlap scheduling's device-resident future ids (overlap is off under TP in this
slice; a batch with them is refused), the prompt-logprob spans and the scheduled requests (rank
0's alone: sampling and logprobs happen once, there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch

__all__ = ["HEADER_LEN", "StepArgs", "StepReceiver", "StepSender", "decode_body", "encode_step"]

HEADER_LEN = 12
OP_STEP, OP_STOP = 0, 1
_MODES = list(ForwardMode)


@dataclass(frozen=True)
class StepArgs:
    """`ModelRunner.make_batch`'s arguments besides the host batch (None: not given)."""

    pad_to: int | None = None
    max_seq_len: int | None = None
    q_len: int | None = None


def _opt(v: int | None) -> int:
    return -1 if v is None else int(v)


def _unopt(v: int) -> int | None:
    return None if v < 0 else v


def encode_step(host: HostBatch, args: StepArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (header [HEADER_LEN], body) int64 CPU tensors for `host`."""
    if host.future_ids is not None:
        raise ValueError(
            "step broadcast: a batch reading device-resident future ids (overlap scheduling) "
            "cannot be sent to the other tensor-parallel ranks; overlap is off under TP"
        )
    tables = host.block_tables
    lens = [len(p) for p in tables]
    parts = [
        np.asarray(host.input_ids, dtype=np.int64),
        np.asarray(host.positions, dtype=np.int64),
        np.asarray(host.slot_mapping, dtype=np.int64),
        np.asarray(host.seq_lens, dtype=np.int64),
        np.asarray(host.q_lens, dtype=np.int64),
    ]
    if host.table_rows is not None:
        parts.append(np.asarray(host.table_rows, dtype=np.int64))
    parts.append(np.asarray(lens, dtype=np.int64))
    parts.append(np.fromiter((p for pages in tables for p in pages), np.int64, sum(lens)))
    parts.append(np.asarray(host.logits_indices, dtype=np.int64))
    body = torch.from_numpy(np.concatenate(parts))
    header = torch.tensor(
        [
            OP_STEP,
            _MODES.index(host.mode),
            len(host.input_ids),
            host.num_seqs,
            len(host.logits_indices),
            sum(lens),
            host.table_rows is not None,
            host.logits_hidden_only,
            _opt(args.pad_to),
            _opt(args.max_seq_len),
            _opt(args.q_len),
            body.numel(),
        ],
        dtype=torch.int64,
    )
    return header, body


def decode_body(header: torch.Tensor, body: torch.Tensor) -> tuple[HostBatch, StepArgs]:
    """The `HostBatch` and arguments `encode_step` encoded (the worker's own arrays)."""
    h = header.tolist()
    _, mode, t, s, n_logits, n_pages, owned, hidden_only, pad_to, max_seq_len, q_len, n = h
    flat = body.numpy()
    if flat.shape[0] != n:
        raise ValueError(f"step broadcast: body of {flat.shape[0]} values, header says {n}")
    sizes = [t, t, t, s, s, *([s] if owned else []), s, n_pages, n_logits]
    chunks = np.split(flat, np.cumsum(sizes)[:-1])
    ids, positions, slots, seq_lens, q_lens = chunks[:5]
    rest = chunks[5:]
    table_rows = rest.pop(0).tolist() if owned else None
    counts, pages, logits = rest
    ends = np.cumsum(counts)
    tables = [
        pages[e - c : e].tolist() for c, e in zip(counts.tolist(), ends.tolist(), strict=True)
    ]
    host = HostBatch(
        _MODES[mode],
        ids.copy(),
        positions.copy(),
        slots.copy(),
        seq_lens.tolist(),
        q_lens.tolist(),
        tables,
        logits.tolist(),
        table_rows=table_rows,
        logits_hidden_only=bool(hidden_only),
    )
    return host, StepArgs(_unopt(pad_to), _unopt(max_seq_len), _unopt(q_len))


class StepSender:
    """Rank 0's end: `send` each step's batch before its forward, `stop` once at shutdown.
    `group`: the control group (gloo); rank 0 is the source."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.num_sent = 0  # steps broadcast (the engine tells a desynchronised group by it)

    def send(self, host: HostBatch, args: StepArgs) -> None:
        header, body = encode_step(host, args)
        self.num_sent += 1
        dist.broadcast(header, 0, group=self.group)
        dist.broadcast(body, 0, group=self.group)

    def stop(self) -> None:
        header = torch.full((HEADER_LEN,), -1, dtype=torch.int64)
        header[0] = OP_STOP
        dist.broadcast(header, 0, group=self.group)


class StepReceiver:
    """A worker's end: `receive` blocks until rank 0's next step (its batch and arguments) or
    its stop (None)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._header = torch.empty(HEADER_LEN, dtype=torch.int64)

    def receive(self) -> tuple[HostBatch, StepArgs] | None:
        dist.broadcast(self._header, 0, group=self.group)
        if int(self._header[0]) == OP_STOP:
            return None
        body = torch.empty(int(self._header[-1]), dtype=torch.int64)
        dist.broadcast(body, 0, group=self.group)
        return decode_body(self._header, body)
