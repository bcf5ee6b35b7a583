"""The step broadcast's wire format: every message encoded on rank 0 decodes to the same values
(no process group needed: the encoders and `decode_message` are the two ends), through the frame
a broadcast carries (`frame_message` / `unframe_message`) whether the body fits it or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.forward_route import EAGER, ForwardRoute, RoutePath
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.step_broadcast import (
    FRAME_LEN,
    HEADER_LEN,
    INLINE_LEN,
    CaptureDraftMsg,
    CaptureMsg,
    DraftDecodeMsg,
    DraftExtendMsg,
    GraphsMsg,
    StepMsg,
    decode_message,
    encode_capture,
    encode_capture_draft,
    encode_draft_decode,
    encode_draft_extend,
    encode_graphs,
    encode_step,
    frame_message,
    unframe_message,
)


@pytest.mark.parametrize("owned", [True, False])
def test_step_round_trip(owned: bool) -> None:
    host = HostBatch(
        ForwardMode.EXTEND,
        np.arange(7, dtype=np.int64) + 3,
        [0, 1, 2, 3, 0, 1, 5],
        [40, 41, 42, 43, 80, 81, 85],
        [4, 6],
        [4, 3],
        [[10], [20, 21]],
        [3, 6],
        table_rows=[2, 5] if owned else None,
        logits_hidden_only=True,
    )
    route = ForwardRoute(RoutePath.PIECEWISE, 16, graphed=True)
    header, body = encode_step(host, route, feed=2)
    assert header.shape == (HEADER_LEN,) and body.dtype == torch.int64
    msg = decode_message(header, body)
    assert isinstance(msg, StepMsg)
    assert (msg.route, msg.feed, msg.future_identity, msg.greedy_feed) == (route, 2, -1, False)
    greedy = decode_message(*encode_step(host, route, feed=2, greedy_feed=True))
    assert (greedy.feed, greedy.greedy_feed) == (2, True)
    got = msg.host
    assert got.mode is ForwardMode.EXTEND
    assert got.input_ids.tolist() == list(range(3, 10))
    assert got.positions.tolist() == host.positions
    assert got.slot_mapping.tolist() == host.slot_mapping
    assert (got.seq_lens, got.q_lens) == ([4, 6], [4, 3])
    assert got.block_tables == [[10], [20, 21]]
    assert got.logits_indices == [3, 6]
    assert got.table_rows == host.table_rows
    assert got.logits_hidden_only
    assert got.future_ids is None


@pytest.mark.parametrize("identity", [0, 2])
def test_future_ids_travel_as_placeholders(identity: int) -> None:
    """Rows -(j + 1) stay as they are; the worker reads its own fed ids for them."""
    host = HostBatch(ForwardMode.DECODE, [-1, -2], [4, 7], [9, 30], [5, 8], [1, 1], [[2], [7]], [])
    host.future_ids = torch.zeros(2, dtype=torch.int64)
    host.future_identity = identity
    msg = decode_message(*encode_step(host, ForwardRoute(RoutePath.UNIFORM, 2)))
    assert msg.host.input_ids.tolist() == [-1, -2]
    assert msg.future_identity == identity
    assert msg.route == ForwardRoute(RoutePath.UNIFORM, 2, graphed=False)


def test_other_messages_round_trip() -> None:
    shapes = ((ForwardMode.DECODE, 1), (ForwardMode.VERIFY, 3))
    for msg, encode in [
        (GraphsMsg((1, 2, 8), shapes, True, 4096), encode_graphs),
        (CaptureMsg((1, 2, 8), shapes, (16, 32, 40)), encode_capture),
        (CaptureMsg((), shapes[:1], ()), encode_capture),
        (CaptureDraftMsg((1, 3)), encode_capture_draft),
        (DraftDecodeMsg(5, 3, True), encode_draft_decode),
        (DraftDecodeMsg(1, 1, False), encode_draft_decode),
    ]:
        assert decode_message(*encode(msg)) == msg
    extend = DraftExtendMsg(np.array([4, 5, 0, 9], np.int64), [3, 12], [[7], [8, 9, 10]], True)
    got = decode_message(*encode_draft_extend(extend))
    assert got.ids.tolist() == [4, 5, 0, 9]
    assert (got.ends, got.tables, got.draft) == ([3, 12], [[7], [8, 9, 10]], True)
    empty = decode_message(
        *encode_draft_extend(DraftExtendMsg(np.zeros(3, np.int64), [], [], False))
    )
    assert (empty.ids.tolist(), empty.ends, empty.tables) == ([0, 0, 0], [], [])


def test_a_short_body_is_refused() -> None:
    header, body = encode_draft_extend(DraftExtendMsg(np.arange(4), [4], [[1]], False))
    with pytest.raises(ValueError, match="header says"):
        decode_message(header, body[:-1])


def test_routes_are_checked() -> None:
    assert EAGER.path is RoutePath.EAGER
    with pytest.raises(ValueError, match="size must be >= 1"):
        ForwardRoute(RoutePath.UNIFORM, 0)
    with pytest.raises(ValueError, match="EAGER"):
        ForwardRoute(RoutePath.EAGER, 4)


@pytest.mark.parametrize("tokens", [5, INLINE_LEN // 3, INLINE_LEN, 3 * INLINE_LEN])
def test_a_step_travels_in_one_frame_or_a_frame_and_the_rest(tokens: int) -> None:
    """A body up to INLINE_LEN values rides in the frame (one broadcast); a longer one sends
    the rest after it. Either way the message decodes as sent, and owns its arrays: the frame
    is the receiver's buffer, overwritten by the next message."""
    host = HostBatch(
        ForwardMode.EXTEND, np.arange(tokens, dtype=np.int64), list(range(tokens)),
        list(range(100, 100 + tokens)), [tokens], [tokens], [[3, 4]], [tokens - 1],
    )  # fmt: skip
    header, body = encode_step(host, EAGER)
    frame, rest = frame_message(header, body)
    assert frame.shape == (FRAME_LEN,) and frame.dtype == torch.int64
    assert rest.numel() == max(0, body.numel() - INLINE_LEN)
    got_header, got_body = unframe_message(frame, rest)
    frame.fill_(-7)  # the next message
    assert torch.equal(got_header, header) and torch.equal(got_body, body)
    msg = decode_message(got_header, got_body)
    assert msg.host.input_ids.tolist() == list(range(tokens))
    assert msg.host.slot_mapping.tolist() == list(range(100, 100 + tokens))
    assert msg.host.block_tables == [[3, 4]] and msg.host.logits_indices == [tokens - 1]


def test_a_frame_without_its_rest_is_refused() -> None:
    header, body = encode_capture(CaptureMsg(tuple(range(1, INLINE_LEN + 2)), (), ()))
    frame, rest = frame_message(header, body)
    assert rest.numel() == 1
    with pytest.raises(ValueError, match="header says"):
        decode_message(*unframe_message(frame))
