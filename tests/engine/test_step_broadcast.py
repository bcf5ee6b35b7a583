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


STEP_TOKENS = (5, 3 * INLINE_LEN, 1, INLINE_LEN)  # in the frame, with a rest, ...


def _group_rank(rank: int, world: int, port: int, ring_on: str, out: str) -> None:
    """One rank of a gloo group on the CPU: rank 0 sends STEP_TOKENS' steps and a stop through
    `open_step_ring`'s channel; a worker writes what it received to `out`.rank."""
    import json
    import os

    import torch.distributed as dist

    from mlaserve.engine.step_broadcast import StepReceiver, StepSender
    from mlaserve.engine.tp_worker import open_step_ring

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MLASERVE_STEP_RING=ring_on)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    ring = open_step_ring(rank, world, group, nnodes=1, device_type="cpu")
    if rank == 0:
        sender = StepSender(group, ring)
        for tokens in STEP_TOKENS:
            host = HostBatch(
                ForwardMode.EXTEND, np.arange(tokens, dtype=np.int64) + rank, list(range(tokens)),
                list(range(100, 100 + tokens)), [tokens], [tokens], [[3, 4]], [tokens - 1],
            )  # fmt: skip
            sender.send_step(host, EAGER)
        sender.stop()
        got = {"ring": ring is not None, "sent": sender.num_sent}
    else:
        receiver = StepReceiver(group, ring)
        steps = []
        while (msg := receiver.receive()) is not None:
            steps.append([msg.host.input_ids.tolist(), msg.host.slot_mapping.tolist()])
        got = {"ring": ring is not None, "steps": steps}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("ring_on", ["1", "0"])
def test_every_worker_receives_every_step_in_order_through_the_ring_or_gloo(
    tmp_path, ring_on: str
) -> None:
    """Three ranks on the CPU: with the ring (the default) and without, each worker receives
    rank 0's steps whole and in order, bodies past the frame included, then the stop; the ring's
    file is gone once the group has met."""
    import glob
    import json

    import torch.multiprocessing as mp

    before = set(glob.glob("/dev/shm/mlaserve-step-ring-*"))
    out = str(tmp_path / "got")
    mp.spawn(_group_rank, args=(3, 29671 + int(ring_on), ring_on, out), nprocs=3)
    got = [json.loads((tmp_path / f"got.{r}").read_text()) for r in range(3)]
    assert [g["ring"] for g in got] == [ring_on == "1"] * 3
    assert got[0]["sent"] == len(STEP_TOKENS)
    want = [[list(range(t)), list(range(100, 100 + t))] for t in STEP_TOKENS]
    assert got[1]["steps"] == want and got[2]["steps"] == want
    assert set(glob.glob("/dev/shm/mlaserve-step-ring-*")) <= before


def test_without_room_for_the_ring_the_group_falls_back_to_gloo(tmp_path, monkeypatch) -> None:
    """A ring that cannot be made (/dev/shm full or read-only) leaves rank 0's decision at gloo,
    which every rank follows: a one-rank group here, the broadcast of the decision included."""
    import torch.distributed as dist

    from mlaserve.engine import host_ring
    from mlaserve.engine.tp_worker import open_step_ring

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(host_ring.HostRing, "create", classmethod(lambda cls, *a, **k: no_room()))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdv'}", rank=0, world_size=1)
    try:
        assert open_step_ring(0, 2, dist.group.WORLD, nnodes=1, device_type="cpu") is None
    finally:
        dist.destroy_process_group()
