"""The step broadcast's wire format: a HostBatch encoded on rank 0 decodes to the same inputs
(no process group needed: encode_step / decode_body are the two ends)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.step_broadcast import HEADER_LEN, StepArgs, decode_body, encode_step


@pytest.mark.parametrize("owned", [True, False])
def test_round_trip(owned: bool) -> None:
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
    header, body = encode_step(host, StepArgs(None, 6, None))
    assert header.shape == (HEADER_LEN,) and body.dtype == torch.int64
    got, args = decode_body(header, body)
    assert args == StepArgs(None, 6, None)
    assert got.mode is ForwardMode.EXTEND
    assert got.input_ids.tolist() == list(range(3, 10))
    assert got.positions.tolist() == host.positions
    assert got.slot_mapping.tolist() == host.slot_mapping
    assert (got.seq_lens, got.q_lens) == ([4, 6], [4, 3])
    assert got.block_tables == [[10], [20, 21]]
    assert got.logits_indices == [3, 6]
    assert got.table_rows == host.table_rows
    assert got.logits_hidden_only


def test_future_ids_are_refused() -> None:
    host = HostBatch(ForwardMode.DECODE, [-1], [4], [9], [5], [1], [[2]], [])
    host.future_ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="overlap is off under TP"):
        encode_step(host, StepArgs())
