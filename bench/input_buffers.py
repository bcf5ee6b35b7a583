"""Host cost of `InputBuffers.fill` for a decode step, by pages per sequence (issue 13).

    python3 bench/input_buffers.py [--bs 64] [--device cpu|cuda]

A decode batch of `--bs` sequences that each hold `pages` pages, in page tables `width` wide
(max_model_len / page_size), filled again and again as consecutive decode steps do (no page
appended): the per-step cost should not depend on `pages`. On CPU the "device" copies and
gathers run on the host too. Median of five rounds of 200 fills. Not a test.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import timeit

import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch, InputBuffers

CASES = ((33, 32), (512, 32), (512, 500), (2560, 100), (2560, 2000))  # (width, pages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bs", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device, bs = torch.device(args.device), args.bs
    # Checkouts from before the persistent page table have no `table_rows`: rows written whole.
    rows = "table_rows" in inspect.signature(HostBatch).parameters
    print(f"InputBuffers.fill, decode, bs {bs}, device {device}, table rows owned: {rows}")
    print(f"{'width':>6}{'pages':>7}{'us/fill':>10}")
    for width, pages in CASES:
        bufs = InputBuffers(bs, 2048, width, device)
        tables = [list(range(1 + i * width, 1 + i * width + pages)) for i in range(bs)]
        kwargs = {"table_rows": list(range(bs))} if rows else {}
        host = HostBatch(
            ForwardMode.DECODE, [1] * bs, [5] * bs, [7] * bs, [6] * bs, [1] * bs, tables, [],
            **kwargs,
        )  # fmt: skip

        def fill(host: HostBatch = host, bufs: InputBuffers = bufs) -> None:
            bufs.fill(host, max_seq_len=64, kv_pool=None, attn_backend=None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        fill()
        us = statistics.median(timeit.repeat(fill, number=200, repeat=5)) / 200 * 1e6
        print(f"{width:>6}{pages:>7}{us:>10.1f}")


if __name__ == "__main__":
    main()
