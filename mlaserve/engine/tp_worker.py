"""A tensor-parallel worker process: ranks 1..N-1 (rank 0 is the engine's own process).

    worker_main(config, rank, size, init_method, timeout_s, conn)   # the spawn target

Joins the group (the model group: NCCL on CUDA, gloo on CPU; the control group: gloo), builds
the same `ModelRunner` as rank 0 with `TensorParallel(rank, N, group)` on `cuda:rank` (CPU: all
on cpu), then loops: receive the step's host batch (`engine/step_broadcast.py`), stage it in its
own `InputBuffers`, run the same forward (its collectives meet rank 0's), repeat; no sampling
(the LM head's logits are all-gathered: rank 0 samples once). A stop message ends the loop.

Failures: anything raised here is sent to rank 0 over `conn` (its traceback) and the process
exits 1; rank 0's next collective then fails (the peer's sockets closed) and it raises the engine
dead, with that traceback. The control group waits for the next step without a deadline (an idle
engine is not a failure); if rank 0 dies, its sockets close and the wait raises here, so a worker
never outlives its engine. The model group's collectives have `timeout_s`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

# NVLink multicast stays off in every process of the group (the lent machines require it).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# A worker waits this long for rank 0's next step (idle engines are fine; a dead rank 0 closes
# the sockets, which ends the wait at once).
IDLE_WAIT = timedelta(days=365)

logger = logging.getLogger(__name__)

__all__ = ["IDLE_WAIT", "MULTICAST_OFF", "init_groups", "worker_main"]


def init_groups(
    rank: int, size: int, *, device_type: str, init_method: str, timeout_s: float, idle: bool
) -> tuple[Any, Any]:
    """Join the model group (the default one: NCCL on CUDA, gloo on CPU, `timeout_s` per
    collective) and make the control group (gloo; `idle`: a worker's, waiting without a deadline)
    -> (TensorParallel, control group). Every rank calls this, in the same order."""
    import torch.distributed as dist

    from mlaserve.tensor_parallel import init_tensor_parallel

    backend = "nccl" if device_type == "cuda" else "gloo"
    tp = init_tensor_parallel(
        rank, size, backend=backend, init_method=init_method, timeout_s=timeout_s
    )
    control = dist.new_group(
        backend="gloo", timeout=IDLE_WAIT if idle else timedelta(seconds=timeout_s)
    )
    return tp, control


def worker_main(
    config: Any, rank: int, size: int, init_method: str, timeout_s: float, conn: Connection
) -> None:
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist

    from mlaserve.config import ModelConfig
    from mlaserve.engine.model_runner import ModelRunner
    from mlaserve.engine.step_broadcast import StepReceiver

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [tp rank {rank}] %(message)s")
    tp = None
    try:
        device = config.resolved_device()
        if device.type == "cuda":
            torch.cuda.set_device(rank)
            config = config.replace(device=f"cuda:{rank}")
        else:  # N ranks share the host's cores
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        tp, control = init_groups(
            rank, size, device_type=device.type, init_method=init_method,
            timeout_s=timeout_s, idle=True,
        )  # fmt: skip
        model_config = ModelConfig.from_pretrained(config.model_path)
        runner = ModelRunner(config, model_config, tp=tp, control_group=control)
        receiver = StepReceiver(control)
        with torch.inference_mode():
            while (step := receiver.receive()) is not None:
                host, args = step
                batch = runner.make_batch(
                    host, pad_to=args.pad_to, max_seq_len=args.max_seq_len, q_len=args.q_len
                )
                runner.forward_with_hidden(batch)
    except BaseException:
        with contextlib.suppress(OSError):  # rank 0 gone: nobody to tell
            conn.send(traceback.format_exc())
        os._exit(1)  # no teardown: the group is broken, and a destroy could wait on it
    if tp is not None and dist.is_initialized():
        dist.destroy_process_group()
    conn.close()
