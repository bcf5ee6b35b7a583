"""Rank 0's cost of telling a tensor-parallel worker one decode step (`engine/step_broadcast.py`):
the framed message (one gloo broadcast while the body fits the frame) against the header and
body as two broadcasts (the wire format before the frame), over a real gloo group of 2
processes on this machine.

    python3 bench/step_broadcast.py [--batch-sizes 1 8 64 256] [--steps 2000]

Each batch size encodes a DECODE step of that many sequences (one token each, 16 pages a
sequence, table rows owned) with `encode_step`; rank 0 sends it `--steps` times back to back
and the worker receives and decodes each (`StepReceiver` for the frame; its two-broadcast twin
here for the old format). Prints rank 0's microseconds a message (median of 3 rounds) and the
body's length, then one JSON line. The control group is gloo on CPU tensors on a GPU host too:
this is the host work the step message adds to rank 0's step, not a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.forward_route import ForwardRoute, RoutePath
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.step_broadcast import (
    HEADER_LEN,
    StepReceiver,
    StepSender,
    decode_message,
    encode_step,
)

PAGES_PER_SEQ = 16


def decode_step(bs: int) -> tuple[HostBatch, ForwardRoute]:
    host = HostBatch(
        ForwardMode.DECODE, list(range(bs)), [1000] * bs, list(range(bs)), [1001] * bs, [1] * bs,
        [list(range(i * PAGES_PER_SEQ, (i + 1) * PAGES_PER_SEQ)) for i in range(bs)],
        list(range(bs)), table_rows=list(range(bs)),
    )  # fmt: skip
    return host, ForwardRoute(RoutePath.UNIFORM, bs, graphed=True)


def _two_broadcasts_send(group, header: torch.Tensor, body: torch.Tensor) -> None:
    dist.broadcast(header, 0, group=group)
    if body.numel():
        dist.broadcast(body, 0, group=group)


def _two_broadcasts_receive(group, header: torch.Tensor) -> None:
    dist.broadcast(header, 0, group=group)
    body = torch.empty(int(header[-1]), dtype=torch.int64)
    if body.numel():
        dist.broadcast(body, 0, group=group)
    decode_message(header, body)


def _rank(rank: int, port: int, sizes: list[int], steps: int, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.group.WORLD
    rows = []
    for bs in sizes:
        host, route = decode_step(bs)
        body = encode_step(host, route)[1]
        for fmt in ("frame", "two"):
            times = []
            for _ in range(rounds):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    sender = StepSender(group)
                    for _ in range(steps):
                        if fmt == "frame":
                            sender.send_step(host, route)
                        else:
                            _two_broadcasts_send(group, *encode_step(host, route))
                elif fmt == "frame":
                    receiver = StepReceiver(group)
                    for _ in range(steps):
                        receiver.receive()
                else:
                    buf = torch.empty(HEADER_LEN, dtype=torch.int64)
                    for _ in range(steps):
                        _two_broadcasts_receive(group, buf)
                times.append((time.perf_counter() - t0) / steps * 1e6)
            rows.append({"bs": bs, "format": fmt, "body": body.numel(),
                         "us": statistics.median(times)})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args()
    out = Path(f"/tmp/step_broadcast_{os.getpid()}.json")
    mp.spawn(_rank, args=(args.port, args.batch_sizes, args.steps, args.rounds, str(out)),
             nprocs=2)  # fmt: skip
    rows = json.loads(out.read_text())
    out.unlink()
    by = {(r["bs"], r["format"]): r for r in rows}
    print(f"{'bs':>5} {'body':>6} {'frame us':>9} {'two us':>8} {'frame/two':>9}")
    for bs in args.batch_sizes:
        f, t = by[(bs, "frame")], by[(bs, "two")]
        print(f"{bs:>5} {f['body']:>6} {f['us']:>9.1f} {t['us']:>8.1f} {f['us'] / t['us']:>9.2f}")
    print(json.dumps({"bench": "step_broadcast", "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
