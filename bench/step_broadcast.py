"""Rank 0's cost of telling its tensor-parallel workers one decode step
(`engine/step_broadcast.py`): the frame through the shared-memory ring (`engine/host_ring.py`,
the default on one node) against one gloo broadcast on the control group (several nodes, or
`MLASERVE_STEP_RING=0`), over a real group of `--ranks` processes on this machine.

    python3 bench/step_broadcast.py [--ranks 2 8] [--batch-sizes 1 8 64 256] [--steps 2000]

Each batch size encodes a DECODE step of that many sequences (one token each, 16 pages a
sequence, table rows owned) with `encode_step`; rank 0 sends it `--steps` times back to back
(`StepSender`) and every worker receives and decodes each (`StepReceiver`). Prints rank 0's
microseconds a message (median of 3 rounds; back to back, so a message costs at least the
slowest worker's receive and decode) and the body's length, then one JSON line. CPU tensors on
a GPU host too: the host work the step message adds to rank 0's step, not a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.forward_route import ForwardRoute, RoutePath
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.step_broadcast import StepReceiver, StepSender, encode_step
from mlaserve.engine.tp_worker import open_step_ring

PAGES_PER_SEQ = 16


def decode_step(bs: int) -> tuple[HostBatch, ForwardRoute]:
    host = HostBatch(
        ForwardMode.DECODE, list(range(bs)), [1000] * bs, list(range(bs)), [1001] * bs, [1] * bs,
        [list(range(i * PAGES_PER_SEQ, (i + 1) * PAGES_PER_SEQ)) for i in range(bs)],
        list(range(bs)), table_rows=list(range(bs)),
    )  # fmt: skip
    return host, ForwardRoute(RoutePath.UNIFORM, bs, graphed=True)


def _rank(rank: int, world: int, port: int, sizes: list[int], steps: int, rounds: int,
          out: str) -> None:  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    ring = open_step_ring(rank, world, group, nnodes=1, device_type="cuda")  # spinning readers
    rows = []
    for bs in sizes:
        host, route = decode_step(bs)
        body = encode_step(host, route)[1]
        for channel in ("ring", "gloo"):
            times = []
            for _ in range(rounds):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    sender = StepSender(group, ring if channel == "ring" else None)
                    for _ in range(steps):
                        sender.send_step(host, route)
                else:
                    receiver = StepReceiver(group, ring if channel == "ring" else None)
                    for _ in range(steps):
                        receiver.receive()
                times.append((time.perf_counter() - t0) / steps * 1e6)
            rows.append({"bs": bs, "channel": channel, "body": body.numel(),
                         "us": statistics.median(times)})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2], help="group sizes (processes)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=29561)
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        out = Path(f"/tmp/step_broadcast_{os.getpid()}.json")
        mp.spawn(_rank, args=(world, args.port + world, args.batch_sizes, args.steps,
                              args.rounds, str(out)), nprocs=world)  # fmt: skip
        rows += [{"ranks": world, **r} for r in json.loads(out.read_text())]
        out.unlink()
    by = {(r["ranks"], r["bs"], r["channel"]): r for r in rows}
    print(f"{'ranks':>5} {'bs':>5} {'body':>6} {'ring us':>8} {'gloo us':>8} {'ring/gloo':>9}")
    for world in args.ranks:
        for bs in args.batch_sizes:
            r, g = by[(world, bs, "ring")], by[(world, bs, "gloo")]
            print(f"{world:>5} {bs:>5} {r['body']:>6} {r['us']:>8.1f} {g['us']:>8.1f} "
                  f"{r['us'] / g['us']:>9.2f}")  # fmt: skip
    print(json.dumps({"bench": "step_broadcast", "steps": args.steps, "rows": rows}))


if __name__ == "__main__":
    main()
