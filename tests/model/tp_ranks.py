"""Test helper: run a function on N CPU processes joined in a gloo tensor-parallel group.

    results = run_on_ranks(fn, 2, tmp_path, *args)   # [fn(tp_rank0, *args), fn(tp_rank1, *args)]

`fn` must be a module-level function (the processes are spawned, so it is pickled by name); it
gets its `TensorParallel` and `args` and returns anything `torch.save` takes. The rendezvous is a
FileStore in `workdir` (no port to race for). Each rank writes its result or its traceback to
`workdir`; the parent reads them back.

No hang can outlive the test: a rank that fails makes the parent kill the others at once (they
would otherwise wait in a collective for gloo's timeout), every process is joined with a
deadline and killed past it, and each rank leaves the process group on its way out.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from mlaserve.tensor_parallel import destroy_tensor_parallel, init_tensor_parallel

__all__ = ["run_on_ranks"]

COLLECTIVE_TIMEOUT_S = 60.0  # gloo's bound on one collective, in the ranks


def _rank_main(
    fn: Callable[..., Any], rank: int, size: int, workdir: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)  # N ranks share the CI machine's few cores
    out = Path(workdir)
    tp = None
    try:
        tp = init_tensor_parallel(
            rank,
            size,
            backend="gloo",
            init_method=f"file://{out / 'store'}",
            timeout_s=COLLECTIVE_TIMEOUT_S,
        )
        torch.save(fn(tp, *args), out / f"rank{rank}.pt")
        # Leave together: a rank tearing gloo down while another is still in its last
        # collective aborts that one ("terminate called without an active exception").
        torch.distributed.barrier()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if tp is not None:
            destroy_tensor_parallel(tp)


def run_on_ranks(
    fn: Callable[..., Any], size: int, workdir: Path, *args: Any, timeout_s: float = 240.0
) -> list[Any]:
    """`fn(tp, *args)` on `size` spawned processes; their results in rank order. Raises
    RuntimeError with the failing ranks' tracebacks, or TimeoutError past `timeout_s`."""
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, size, str(workdir), args), daemon=True)
        for rank in range(size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        running = list(procs)
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=deadline - time.monotonic())
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode for p in procs):  # one failed: the others would wait for it
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    errors = [
        f"rank {r}:\n{(workdir / f'rank{r}.err').read_text()}"
        for r in range(size)
        if (workdir / f"rank{r}.err").exists()
    ]
    if errors:
        raise RuntimeError("\n".join(errors))
    codes = [p.exitcode for p in procs]
    if time.monotonic() >= deadline and any(code != 0 for code in codes):
        raise TimeoutError(f"ranks did not finish in {timeout_s:.0f} s (exit codes {codes})")
    if any(code != 0 for code in codes):
        raise RuntimeError(f"ranks exited abnormally, without a traceback (exit codes {codes})")
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(size)]
