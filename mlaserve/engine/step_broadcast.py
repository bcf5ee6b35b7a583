"""What rank 0 tells the other tensor-parallel ranks, in order: small int64 messages, never a
pickled request. On one node a message's frame goes through a shared-memory ring
(`engine/host_ring.py`, one copy for rank 0); across nodes, or with `MLASERVE_STEP_RING=0`, it
is a broadcast on the control group (gloo, CPU tensors; `engine/tp_worker.py` makes both).

Rank 0 owns the scheduler, sampling and acceptance; the other ranks run the same device work on
the same inputs, in the same order, so that their collectives meet. A message is a header and a
body:

    header  int64 [HEADER_LEN]: op, then the op's fields (below), ..., body length (last)

and travels as one fixed frame, int64 [FRAME_LEN] = the header, then the body's first
INLINE_LEN values (zero-padded), through the ring (or one broadcast); only a longer body sends
the rest in a broadcast on the control group after it. A decode step's body is 7 values a
sequence plus its pages (16 at 1024 tokens of 64-token pages): up to ~90 such sequences fit in
the frame (`bench/step_broadcast.py` measures a message both ways).

    STEP          a target forward: mode, T, S, L, P, has_table_rows, logits_hidden_only,
                  route path, route size, route graphed, future_identity (-1: no future ids),
                  feed, greedy_feed
                  body [T + T + T + S + S (+ S) + S + P + L]: input_ids | positions |
                  slot_mapping | seq_lens | q_lens | (table_rows) | pages per sequence | the
                  pages, flat | logits_indices
    GRAPHS        rank 0's graph runner (the worker builds the same): use_graphs, piecewise max
                  tokens, number of batch sizes B, of shapes Q
                  body [B + 2Q]: batch sizes | (mode, q_len) per shape
    CAPTURE       the target graphs: number of batch sizes B, of shapes Q, of token buckets K
                  body [B + 2Q + K]: batch sizes | (mode, q_len) per shape | buckets
    CAPTURE_DRAFT the draft graphs: number of q_lens Q
                  body [Q]: the draft-extend q_lens
    DRAFT_DECODE  the MTP after a decode / verify forward: bs, q, draft
    DRAFT_EXTEND  the MTP after an EXTEND forward: n sampled, draft, T
                  body [T + n + n + P]: the MTP's input ids | sequence ends | pages per
                  sequence | the pages, flat
    STOP          leave the loop (no body)

Device values go on the model group (NCCL on CUDA) right after the message's device work, by
`TensorParallel.broadcast` from rank 0, never through the host: a STEP with feed n > 0 is
followed by its n sampled ids ([n] int64: the next step's future ids under overlap scheduling),
unless it sets greedy_feed: then the ids are the first n of the replayed DECODE graph's own
argmax rows (`TargetOutput.greedy`), which every rank computed from the same gathered logits,
and nothing follows (rank 0 sends it only where its sampler takes exactly those rows:
`ModelRunner.feed_workers` checks);
DRAFT_DECODE by the emitted tokens and accept lengths ([bs, q + 1] int64: tokens | length);
DRAFT_EXTEND with n > 0 by the sampled ids ([n] int64).

Future ids (overlap scheduling): a STEP row whose input id is -(j + 1) reads the previous STEP's
fed id j; the worker keeps its last received feed for that (`engine/tp_worker.py`).

Ownership: rank 0 builds each body fresh (nothing of it outlives the send); a worker's messages
hold its own arrays. Page tables travel whole (a worker's `InputBuffers` sees new list objects
every step and rewrites those rows): O(batch x pages) int64 per step, small next to a forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.forward_route import ForwardRoute, RoutePath
from mlaserve.engine.host_ring import HostRing
from mlaserve.engine.input_buffers import HostBatch

__all__ = [
    "FRAME_LEN",
    "HEADER_LEN",
    "INLINE_LEN",
    "CaptureDraftMsg",
    "CaptureMsg",
    "DraftDecodeMsg",
    "DraftExtendMsg",
    "GraphsMsg",
    "StepMsg",
    "StepReceiver",
    "StepSender",
    "decode_message",
    "encode_capture",
    "encode_capture_draft",
    "encode_draft_decode",
    "encode_draft_extend",
    "encode_graphs",
    "encode_step",
    "frame_message",
    "unframe_message",
]

HEADER_LEN = 16
INLINE_LEN = 2048
FRAME_LEN = HEADER_LEN + INLINE_LEN
OP_STEP, OP_STOP, OP_GRAPHS, OP_CAPTURE, OP_CAPTURE_DRAFT, OP_DRAFT_DECODE, OP_DRAFT_EXTEND = range(
    7
)
_MODES = list(ForwardMode)


@dataclass
class StepMsg:
    host: HostBatch
    route: ForwardRoute
    feed: int  # sampled ids the next step may read as future ids (0: none)
    future_identity: int  # -1: the batch reads no future ids; else `HostBatch.future_identity`
    # the feed is this forward's graph's greedy rows (no broadcast); else broadcast after it
    greedy_feed: bool = False


@dataclass(frozen=True)
class GraphsMsg:
    """`CudaGraphRunner`'s arguments: rank 0 decides them, every worker builds the same."""

    batch_sizes: tuple[int, ...]
    shapes: tuple[tuple[ForwardMode, int], ...]
    use_graphs: bool
    piecewise_max_tokens: int


@dataclass(frozen=True)
class CaptureMsg:
    batch_sizes: tuple[int, ...]
    shapes: tuple[tuple[ForwardMode, int], ...]
    buckets: tuple[int, ...]


@dataclass(frozen=True)
class CaptureDraftMsg:
    q_lens: tuple[int, ...]


@dataclass(frozen=True)
class DraftDecodeMsg:
    bs: int
    q: int
    draft: bool


@dataclass
class DraftExtendMsg:
    ids: np.ndarray  # [T] int64: the MTP's input ids (sampled rows: 0, set on the device)
    ends: list[int]  # per sampled sequence: its length after the step
    tables: list[list[int]]  # per sampled sequence: its pages
    draft: bool


Message = StepMsg | GraphsMsg | CaptureMsg | CaptureDraftMsg | DraftDecodeMsg | DraftExtendMsg


def _header(op: int, fields: Sequence[int], body_len: int) -> torch.Tensor:
    if len(fields) > HEADER_LEN - 2:
        raise ValueError(f"step broadcast: {len(fields)} header fields, at most {HEADER_LEN - 2}")
    values = [op, *(int(f) for f in fields)]
    values += [0] * (HEADER_LEN - 1 - len(values)) + [body_len]
    return torch.tensor(values, dtype=torch.int64)


def _i64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _tables(tables: Sequence[Sequence[int]]) -> tuple[list[int], np.ndarray]:
    lens = [len(p) for p in tables]
    return lens, np.fromiter((p for pages in tables for p in pages), np.int64, sum(lens))


def _untables(counts: np.ndarray, pages: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(counts)
    return [pages[e - c : e].tolist() for c, e in zip(counts.tolist(), ends.tolist(), strict=True)]


def _pack(header_fields: tuple[int, Sequence[int]], parts: list[np.ndarray]):
    op, fields = header_fields
    body = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    return _header(op, fields, body.numel()), body


def encode_step(host: HostBatch, route: ForwardRoute, feed: int = 0, greedy_feed: bool = False):
    """-> (header [HEADER_LEN], body) int64 CPU tensors for a target forward of `host`."""
    lens, pages = _tables(host.block_tables)
    parts = [
        _i64(host.input_ids),
        _i64(host.positions),
        _i64(host.slot_mapping),
        _i64(host.seq_lens),
        _i64(host.q_lens),
    ]
    if host.table_rows is not None:
        parts.append(_i64(host.table_rows))
    parts += [_i64(lens), pages, _i64(host.logits_indices)]
    future = -1 if host.future_ids is None else host.future_identity
    fields = [
        _MODES.index(host.mode), len(host.input_ids), host.num_seqs, len(host.logits_indices),
        len(pages), host.table_rows is not None, host.logits_hidden_only,
        int(route.path), route.size, route.graphed, future, feed, greedy_feed,
    ]  # fmt: skip
    return _pack((OP_STEP, fields), parts)


def _shape_values(shapes: Sequence[tuple[ForwardMode, int]]) -> np.ndarray:
    return _i64([v for mode, q in shapes for v in (_MODES.index(mode), q)])


def _shapes(values: np.ndarray) -> tuple[tuple[ForwardMode, int], ...]:
    return tuple((_MODES[m], q) for m, q in values.reshape(-1, 2).tolist())


def encode_graphs(msg: GraphsMsg):
    fields = [msg.use_graphs, msg.piecewise_max_tokens, len(msg.batch_sizes), len(msg.shapes)]
    return _pack((OP_GRAPHS, fields), [_i64(msg.batch_sizes), _shape_values(msg.shapes)])


def encode_capture(msg: CaptureMsg):
    fields = [len(msg.batch_sizes), len(msg.shapes), len(msg.buckets)]
    parts = [_i64(msg.batch_sizes), _shape_values(msg.shapes), _i64(msg.buckets)]
    return _pack((OP_CAPTURE, fields), parts)


def encode_capture_draft(msg: CaptureDraftMsg):
    return _pack((OP_CAPTURE_DRAFT, [len(msg.q_lens)]), [_i64(msg.q_lens)])


def encode_draft_decode(msg: DraftDecodeMsg):
    return _pack((OP_DRAFT_DECODE, [msg.bs, msg.q, msg.draft]), [])


def encode_draft_extend(msg: DraftExtendMsg):
    lens, pages = _tables(msg.tables)
    fields = [len(msg.ends), msg.draft, len(msg.ids)]
    return _pack((OP_DRAFT_EXTEND, fields), [_i64(msg.ids), _i64(msg.ends), _i64(lens), pages])


def frame_message(header: torch.Tensor, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER_LEN], body) -> (frame [FRAME_LEN], rest): the frame holds the header and
    the body's first INLINE_LEN values; rest is the remainder (empty: nothing more to send)."""
    frame = torch.zeros(FRAME_LEN, dtype=torch.int64)
    frame[:HEADER_LEN] = header
    inline = body[:INLINE_LEN]
    frame[HEADER_LEN : HEADER_LEN + inline.numel()] = inline
    return frame, body[INLINE_LEN:]


def unframe_message(
    frame: torch.Tensor, rest: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`frame_message`'s inverse -> (header, body), both copies (the frame is a receive buffer
    the next message overwrites). `rest`: the body past INLINE_LEN, when the header says there
    is one (`_rest_len`)."""
    header = frame[:HEADER_LEN].clone()
    n = int(header[-1])
    body = frame[HEADER_LEN : HEADER_LEN + min(n, INLINE_LEN)].clone()
    if rest is not None and rest.numel():
        body = torch.cat([body, rest])
    return header, body


def _rest_len(frame: torch.Tensor) -> int:
    """How many body values follow the frame in a second broadcast (0: none)."""
    return max(0, int(frame[HEADER_LEN - 1]) - INLINE_LEN)


def decode_message(header: torch.Tensor, body: torch.Tensor) -> Message:
    """The message `encode_*` encoded (the worker's own arrays)."""
    h = header.tolist()
    op, f, n = h[0], h[1:-1], h[-1]
    flat = body.numpy()
    if flat.shape[0] != n:
        raise ValueError(f"step broadcast: body of {flat.shape[0]} values, header says {n}")
    if op == OP_STEP:
        return _decode_step(f, flat)
    if op == OP_GRAPHS:
        use_graphs, pw, b = f[:3]
        sizes, shapes = np.split(flat, [b])
        return GraphsMsg(tuple(sizes.tolist()), _shapes(shapes), bool(use_graphs), pw)
    if op == OP_CAPTURE:
        b, q = f[:2]  # (f[2]: the bucket count, the rest of the body)
        sizes, shapes, buckets = np.split(flat, [b, b + 2 * q])
        return CaptureMsg(tuple(sizes.tolist()), _shapes(shapes), tuple(buckets.tolist()))
    if op == OP_CAPTURE_DRAFT:
        return CaptureDraftMsg(tuple(flat.tolist()))
    if op == OP_DRAFT_DECODE:
        return DraftDecodeMsg(f[0], f[1], bool(f[2]))
    if op == OP_DRAFT_EXTEND:
        s, draft, t = f[:3]
        ids, ends, counts, pages = np.split(flat, [t, t + s, t + 2 * s])
        return DraftExtendMsg(ids.copy(), ends.tolist(), _untables(counts, pages), bool(draft))
    raise ValueError(f"step broadcast: unknown op {op}")


def _decode_step(f: list[int], flat: np.ndarray) -> StepMsg:
    mode, t, s, n_logits, n_pages, owned, hidden_only, path, size, graphed, future, feed = f[:12]
    greedy_feed = bool(f[12])
    sizes = [t, t, t, s, s, *([s] if owned else []), s, n_pages, n_logits]
    chunks = np.split(flat, np.cumsum(sizes)[:-1])
    ids, positions, slots, seq_lens, q_lens = chunks[:5]
    rest = chunks[5:]
    table_rows = rest.pop(0).tolist() if owned else None
    counts, pages, logits = rest
    host = HostBatch(
        _MODES[mode],
        ids.copy(),
        positions.copy(),
        slots.copy(),
        seq_lens.tolist(),
        q_lens.tolist(),
        _untables(counts, pages),
        logits.tolist(),
        table_rows=table_rows,
        logits_hidden_only=bool(hidden_only),
    )
    route = ForwardRoute(RoutePath(path), size, bool(graphed))
    return StepMsg(host, route, feed, future, greedy_feed)


class StepSender:
    """Rank 0's end: each message before its device work, `stop` once at shutdown. `group`: the
    control group (gloo); rank 0 is the source. `ring`: this node's frame ring (the writer's
    end), None: frames broadcast on `group`; `alive`, `timeout_s`: how long the ring's writer
    waits for a reader a full ring behind (`HostRing.write`)."""

    def __init__(self, group: Any, ring: HostRing | None = None,
                 alive: Callable[[], bool] | None = None, timeout_s: float = 300.0) -> None:  # fmt: skip
        self.group = group
        self.ring = ring
        self._alive, self._timeout_s = alive, timeout_s
        self.num_sent = 0  # messages sent (the engine tells a desynchronised group by it)

    def _frame(self, frame: torch.Tensor) -> None:
        if self.ring is None:
            dist.broadcast(frame, 0, group=self.group)
        else:
            self.ring.write(frame.numpy(), self._timeout_s, self._alive)

    def _send(self, header: torch.Tensor, body: torch.Tensor) -> None:
        self.num_sent += 1
        frame, rest = frame_message(header, body)
        self._frame(frame)
        if rest.numel():  # only a body past the frame (the receiver reads its length first)
            dist.broadcast(rest.contiguous(), 0, group=self.group)

    def send_step(
        self, host: HostBatch, route: ForwardRoute, feed: int = 0, greedy_feed: bool = False
    ) -> None:
        self._send(*encode_step(host, route, feed, greedy_feed))

    def send(self, msg: Message) -> None:
        """Any message but a STEP (`send_step`)."""
        encode = {
            GraphsMsg: encode_graphs,
            CaptureMsg: encode_capture,
            CaptureDraftMsg: encode_capture_draft,
            DraftDecodeMsg: encode_draft_decode,
            DraftExtendMsg: encode_draft_extend,
        }[type(msg)]
        self._send(*encode(msg))

    def stop(self) -> None:
        self._frame(frame_message(_header(OP_STOP, [], 0), torch.zeros(0, dtype=torch.int64))[0])


class StepReceiver:
    """A worker's end: `receive` blocks until rank 0's next message, or its stop (None).
    `ring`: this worker's reader end of the node's frame ring (None: frames from `group`)."""

    def __init__(self, group: Any, ring: HostRing | None = None) -> None:
        self.group = group
        self.ring = ring
        self._frame = torch.empty(FRAME_LEN, dtype=torch.int64)

    def receive(self) -> Message | None:
        if self.ring is None:
            dist.broadcast(self._frame, 0, group=self.group)
        else:
            self.ring.read(self._frame.numpy())
        if int(self._frame[0]) == OP_STOP:
            return None
        rest = None
        if n := _rest_len(self._frame):
            rest = torch.empty(n, dtype=torch.int64)
            dist.broadcast(rest, 0, group=self.group)
        return decode_message(*unframe_message(self._frame, rest))
