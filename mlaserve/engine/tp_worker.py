"""A tensor-parallel worker process: ranks 1..N-1 (rank 0 is the engine's own process).

    worker_main(config, rank, size, rendezvous, timeout_s, conn)   # the spawn target

Started by rank 0 (`engine/tp_workers.py`) for node 0's ranks, and by a node's launcher
(`engine/tp_node.py`) on the other nodes. Meets the other ranks (`engine/tp_rendezvous.py`), joins
the group (the model group: NCCL on CUDA, gloo on CPU; the control group: gloo), builds the
same `ModelRunner` as rank 0 with `TensorParallel(rank, N, group)` on `cuda:local_rank` (its
index on its node; CPU: all on cpu), (with speculation) the same MTP drafter and the graph
runner rank 0 announces (GRAPHS: its batch sizes, shapes, prefill buckets and whether it
graphs), then follows rank 0's messages in order (`engine/step_broadcast.py`, `Follower`): a target forward by rank 0's
route (a graph replay, a piecewise prefill or an eager forward, its collectives meeting rank
0's), the sampled ids rank 0 broadcasts on the device after it (the next step's future ids under
overlap scheduling), the MTP's draft-extend and draft after a decode or an EXTEND forward (with
the emitted tokens and accept lengths, or the sampled ids, from rank 0's device), and the
capture of the graphs. No sampling and no acceptance: rank 0 does both, once. A stop message
ends the loop.

Invariant (CUDA graphs under TP): every rank captures the same graphs in the same order with
the same shapes, since the collectives recorded in them must meet on replay. Rank 0 decides: its
capture plan (batch sizes, shapes, prefill buckets) comes first, and a worker whose own plan
differs raises instead of capturing (`Follower.follow`); each replay names its graph, and a
worker without that graph raises (`CudaGraphRunner.execute`).

Failures: anything raised here is sent to the parent over `conn` (its traceback: rank 0 on node 0,
the launcher elsewhere, which logs it) and the process exits 1; rank 0's next collective then fails
(the peer's sockets closed) and it raises the engine dead, with that traceback. A worker waits for
the next step without a deadline (an idle engine is not a failure), on the node's step ring
(`open_step_ring`) or the control group; if rank 0 dies, a gloo wait raises here as its sockets
close, and a thread that watches the parent (rank 0, or the node's launcher) exits the process even
where it sits in a collective (`engine/tp_watchdog.py`), so a worker never outlives its engine. The
model group's eager collectives have `timeout_s` (collectives replayed from a CUDA graph are not
watched by torch's NCCL watchdog).
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from mlaserve.engine.host_ring import HostRing

# NVLink multicast stays off in every process of the group (the lent machines require it).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# A worker waits this long for rank 0's next step (idle engines are fine; a dead rank 0 closes
# the sockets, which ends the wait at once).
IDLE_WAIT = timedelta(days=365)
# The step ring: rank 0 runs at most a step or two ahead of its workers (its host waits for each
# step's result), so 8 frames never fill; a CUDA worker spins this long for the next frame
# before it polls (a served step's message comes well within it).
STEP_RING_SLOTS = 8
STEP_RING_SPIN_S = 0.05

logger = logging.getLogger(__name__)

__all__ = [
    "IDLE_WAIT",
    "MULTICAST_OFF",
    "STEP_RING_SLOTS",
    "Follower",
    "init_groups",
    "open_step_ring",
    "worker_main",
]


def init_groups(
    rank: int, size: int, *, device_type: str, rendezvous: Any, timeout_s: float, idle: bool
) -> tuple[Any, Any, Any]:
    """Meet the other ranks (`rendezvous`, an `engine/tp_rendezvous.Rendezvous`), join the model
    group (the default one: NCCL on CUDA, gloo on CPU, `timeout_s` per collective) and make the
    control group (gloo; `idle`: a worker's, waiting without a deadline) -> (TensorParallel,
    control group, the TCP store or None). Every rank calls this, in the same order."""
    import torch.distributed as dist

    from mlaserve.tensor_parallel import init_tensor_parallel

    backend = "nccl" if device_type == "cuda" else "gloo"
    joined = rendezvous.join(rank)
    tp = init_tensor_parallel(
        rank, size, backend=backend, timeout_s=timeout_s, single_node=rendezvous.nnodes == 1,
        **joined.init_kwargs,
    )  # fmt: skip
    if rendezvous.nnodes > 1 and rank == 0:
        logger.info(
            "tensor parallel over %d nodes: no custom all-reduce (symmetric memory is within a "
            "node); NCCL takes every size", rendezvous.nnodes,
        )  # fmt: skip
    control = dist.new_group(
        backend="gloo", timeout=IDLE_WAIT if idle else timedelta(seconds=timeout_s)
    )
    return tp, control, joined.store


def open_step_ring(
    rank: int, size: int, control: Any, *, nnodes: int, device_type: str
) -> HostRing | None:
    """This node's ring for rank 0's step frames (`engine/host_ring.py`): the writer's end on
    rank 0, reader rank - 1's on a worker; None where frames go on the control group (several
    nodes, or `MLASERVE_STEP_RING=0` on rank 0, which decides for every rank). Every rank calls
    this right after `init_groups`. Rank 0 unlinks the file once every worker has attached."""
    import torch.distributed as dist

    from mlaserve import switches
    from mlaserve.engine.step_broadcast import FRAME_LEN

    ring, path = None, [None]
    if rank == 0 and nnodes == 1 and switches.step_ring():
        try:
            ring = HostRing.create(size - 1, STEP_RING_SLOTS, FRAME_LEN)
            path = [ring.path]
        except OSError as exc:  # no room or no rights in /dev/shm: the control group serves
            logger.warning("tensor parallel: no step ring (%s); step messages over gloo", exc)
    try:
        dist.broadcast_object_list(path, 0, group=control)
        if rank and path[0] is not None:
            spin = STEP_RING_SPIN_S if device_type == "cuda" else 0.0  # CPU: cores are shared
            ring = HostRing.attach(path[0], rank - 1, size - 1, STEP_RING_SLOTS, FRAME_LEN, spin)
        dist.barrier(group=control)
    finally:
        if rank == 0 and ring is not None:
            ring.unlink()
    if rank == 0 and ring is not None:
        logger.info("tensor parallel: step messages through a shared-memory ring (%d slots)",
                    STEP_RING_SLOTS)  # fmt: skip
    return ring


def worker_main(
    config: Any, rank: int, size: int, rendezvous: Any, timeout_s: float, conn: Connection
) -> None:
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    from mlaserve.jit_cache import apply_jit_cache, cache_python_bytecode

    # Inherited from rank 0 already; applied again in case a worker is started another way.
    apply_jit_cache(config.cache_dir)
    cache_python_bytecode(config.cache_dir)  # before torch's import: its bytecode
    import torch

    from mlaserve.config import ModelConfig
    from mlaserve.engine.model_runner import ModelRunner
    from mlaserve.engine.step_broadcast import StepReceiver
    from mlaserve.engine.tp_watchdog import exit_with_parent
    from mlaserve.spec import MTPDrafter
    from mlaserve.tensor_parallel import leave_process_group

    exit_with_parent()  # even from inside a graphed collective that rank 0 will never join
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [tp rank {rank}] %(message)s")
    tp = None
    try:
        device = config.resolved_device()
        local = rendezvous.local_rank(rank)  # this node's GPU (rank r on one node: cuda:r)
        if device.type == "cuda":
            torch.cuda.set_device(local)
            config = config.replace(device=f"cuda:{local}")
        else:  # the node's ranks share its cores
            torch.set_num_threads(max(1, torch.get_num_threads() // rendezvous.local_size))
        tp, control, _ = init_groups(
            rank, size, device_type=device.type, rendezvous=rendezvous,
            timeout_s=timeout_s, idle=True,
        )  # fmt: skip
        ring = open_step_ring(rank, size, control, nnodes=rendezvous.nnodes,
                              device_type=device.type)  # fmt: skip
        model_config = ModelConfig.from_pretrained(config.model_path)
        runner = ModelRunner(config, model_config, tp=tp, control_group=control)
        spec = config.speculative
        drafter = MTPDrafter(runner, spec.k) if spec is not None else None
        follower = Follower(runner, drafter)  # its graph runner: rank 0's GRAPHS message
        receiver = StepReceiver(control, ring)
        while (msg := receiver.receive()) is not None:
            follower.follow(msg)
        follower.release()  # before the group is left: captured collectives hang its teardown
    except BaseException:
        with contextlib.suppress(OSError):  # rank 0 gone: nobody to tell
            conn.send(traceback.format_exc())
        os._exit(1)  # no teardown: the group is broken, and a destroy could wait on it
    if tp is not None:
        leave_process_group()
    conn.close()


class Follower:
    """A worker's side of each message (module doc): the device work rank 0 does for it, in
    the order it comes. Holds the last target forward (the draft reads it) and the last fed
    ids (the next forward's future ids)."""

    def __init__(self, runner: Any, drafter: Any | None) -> None:
        self.runner = runner
        self.graphs = None  # rank 0's graph runner's twin (GRAPHS)
        self.drafter = drafter
        self.target = None  # the last target forward's TargetOutput
        self.feed = None  # the ids rank 0 fed after the last target forward, if any
        self.num_messages = 0

    def release(self) -> None:
        """Destroy this rank's CUDA graphs (`LLMEngine.release_graphs`, rank 0's twin)."""
        if self.drafter is not None:
            self.drafter.release()
        if self.graphs is not None:
            self.graphs.release()

    def follow(self, msg: Any) -> None:
        import torch

        from mlaserve.engine import step_broadcast as sb

        self.num_messages += 1
        if isinstance(msg, sb.GraphsMsg):
            from mlaserve.graph_runner import CudaGraphRunner

            self.graphs = CudaGraphRunner(
                self.runner, msg.batch_sizes, use_graphs=msg.use_graphs, shapes=msg.shapes,
                piecewise_max_tokens=msg.piecewise_max_tokens,
            )  # fmt: skip
            self.target = None  # the old runner's outputs
            return
        if self.graphs is None:
            raise RuntimeError(f"tensor parallel worker: {msg!r} before rank 0's graph runner")
        if isinstance(msg, sb.CaptureMsg):
            plan = self.graphs.capture_plan()
            if msg != plan:
                raise RuntimeError(
                    f"tensor parallel rank {self.runner.tp.rank}: rank 0 captures {msg}, this "
                    f"rank would capture {plan}; every rank must capture the same graphs"
                )
            self.graphs.capture()
            return
        if isinstance(msg, sb.CaptureDraftMsg):
            self._need_drafter(msg).capture(self.graphs, msg.q_lens)
            return
        with torch.inference_mode():
            if isinstance(msg, sb.StepMsg):
                self._step(msg)
            elif isinstance(msg, sb.DraftDecodeMsg):
                bs, q = msg.bs, msg.q
                packed = self._receive((bs, q + 1))
                self._need_drafter(msg).draft_after_decode(
                    self._last_target(msg), packed[:, :q], packed[:, q], bs, msg.draft
                )
            elif isinstance(msg, sb.DraftExtendMsg):
                sampled = self._receive((len(msg.ends),))
                self._need_drafter(msg).draft_after_extend(self._last_target(msg), msg, sampled)
            else:
                raise RuntimeError(f"tensor parallel worker: unexpected message {msg!r}")

    def _step(self, msg: Any) -> None:
        host = msg.host
        if msg.future_identity >= 0:  # rows -(j + 1) read the ids fed after the last forward
            if self.feed is None:
                raise RuntimeError(
                    "tensor parallel worker: a step reads future ids, but the step before fed "
                    "none (overlap rule 4, engine/overlap.py)"
                )
            host.future_ids = self.feed
            host.future_identity = msg.future_identity
        self.target = self.graphs.execute(host, msg.route)
        if msg.greedy_feed:  # rank 0 samples this graph's argmax rows: this rank made the same
            if self.target.greedy is None:
                raise RuntimeError(
                    f"tensor parallel worker: a greedy feed from route {msg.route}, whose "
                    "forward took no argmax on this rank"
                )
            self.feed = self.target.greedy.token_ids[: msg.feed]
        else:
            self.feed = self._receive((msg.feed,)) if msg.feed else None

    def _receive(self, shape: tuple[int, ...]) -> Any:
        """A device tensor rank 0 broadcasts on the model group (empty: none is sent)."""
        import torch

        buf = torch.empty(shape, dtype=torch.int64, device=self.runner.device)
        if buf.numel():
            self.runner.tp.broadcast(buf, src=0)
        return buf

    def _last_target(self, msg: Any) -> Any:
        if self.target is None:
            raise RuntimeError(f"tensor parallel worker: {msg!r} before any target forward")
        return self.target

    def _need_drafter(self, msg: Any) -> Any:
        if self.drafter is None:
            raise RuntimeError(f"tensor parallel worker: {msg!r}, but this rank has no drafter")
        return self.drafter
