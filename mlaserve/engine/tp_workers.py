"""Rank 0's side of tensor parallelism: it starts, watches and stops the worker processes.

    workers = TPWorkers.start(config)          # ranks 1..N-1 spawned, the groups joined
    runner = ModelRunner(config, mc, tp=workers.tp, control_group=workers.control)
    runner.step_sender = workers.sender        # each step's batch reaches the workers
    ...
    workers.failed(exc)                        # a step raised: -> EngineDeadError to raise
    workers.stop()                             # stop message, leave the group, join / kill

Process model (SGLang's and vLLM's): the process that runs the `LLMEngine` is rank 0, with the
scheduler and the step loop; ranks 1..N-1 are spawned here (`engine/tp_worker.py`), each builds
the same `ModelRunner` on `cuda:rank` (CPU: cpu) and runs every forward rank 0 broadcasts. The
rendezvous is a FileStore in a fresh temporary folder (no port to race for). Each child gets
NVLink multicast off in its environment (set by default here, so they inherit it).

Several nodes (`--nnodes K`): this process spawns node 0's ranks 1..N/K-1 only; each other node's
launcher (`engine/tp_node.py`) spawns its own N/K ranks. Everyone meets at the TCP store this
process hosts at `--dist-init-addr` (`engine/tp_rendezvous.py`: a rendezvous that does not
complete within `--dist-timeout` fails naming the missing ranks). Remote ranks are not our
children, so their liveness comes from their launchers' heartbeats in that store
(`engine/tp_heartbeat.py`): a silent node counts as a dead worker (the next step raises the
engine dead; the watchdog ends a step stuck on the device). Closing the store at `stop` (or this
process's death) is how the other launchers learn that node 0 is gone.

Who owns what: this object owns the child processes, the pipes they report failures on, the
rendezvous folder and rank 0's membership of the groups; `stop` releases all of them, and runs
by itself when the object is collected or the interpreter exits (a `weakref.finalize`).

Failures: the model group's collectives time out after `COLLECTIVE_TIMEOUT_S`, and a dead peer
closes its sockets, which fails the next collective at once; either way the step raises on rank
0, `failed` kills every worker (a survivor may sit in a collective with the dead one) and returns
the error that names the rank, its exit code and its traceback. The engine is dead from then on.
A collective replayed from a CUDA graph has no timeout: a rank 0 stuck in one after a worker
died is ended by the watchdog (`engine/tp_watchdog.py`), which kills the workers and exits.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from mlaserve.config import EngineConfig, ModelConfig
from mlaserve.engine.model_runner import ModelRunner
from mlaserve.engine.step_broadcast import StepSender
from mlaserve.engine.tp_heartbeat import watch_heartbeats
from mlaserve.engine.tp_rendezvous import Rendezvous
from mlaserve.engine.tp_watchdog import GroupLoss, StepWatch, watch_workers
from mlaserve.engine.tp_worker import MULTICAST_OFF, init_groups, open_step_ring, worker_main
from mlaserve.startup_times import StartupTimes
from mlaserve.tensor_parallel import TensorParallel, leave_process_group

__all__ = ["COLLECTIVE_TIMEOUT_S", "EngineDeadError", "TPWorkers", "start_runner"]

logger = logging.getLogger(__name__)

# A forward's collective never takes this long; past it the peer is hung or dead. Rank 0 also
# waits this long for the workers' weights at start-up (the KV-size agreement).
COLLECTIVE_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 10.0  # a stopped worker exits within this, else it is killed

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank failed: the engine cannot step any more (make a new one)."""


@dataclass
class _State:
    """What `stop` releases (held apart from `TPWorkers` so that its finalizer may hold it)."""

    procs: list[Any]
    conns: list[Connection]
    rendezvous_dir: str
    sender: StepSender | None = None
    stopped: bool = False  # `_stop` began: no step may start
    # `_stop` ended: the watchdog stands down. The watch threads get `released.is_set`, never a
    # closure over this state: the state holds the group (through `sender`), and a daemon thread
    # that drops the last reference to a ProcessGroup frees it off the main thread, which
    # aborts the process when that lands in interpreter shutdown (pybind11 retakes the GIL).
    released: threading.Event = field(default_factory=threading.Event)
    errors: dict[int, str] = field(default_factory=dict)  # rank -> traceback it sent
    watch: StepWatch = field(default_factory=StepWatch)  # rank 0 busy (`engine/tp_watchdog.py`)
    loss: GroupLoss = field(default_factory=GroupLoss)  # a worker exited or a node went silent
    store: Any = None  # several nodes: the TCP store this process hosts
    nnodes: int = 1


class TPWorkers:
    def __init__(self, state: _State, tp: TensorParallel, control: Any) -> None:
        self._state = state
        self.tp = tp
        self.control = control
        self.sender = state.sender
        self.dead: EngineDeadError | None = None
        self._finalizer = weakref.finalize(self, _stop, state)

    @classmethod
    def start(cls, config: EngineConfig, timeout_s: float | None = None) -> TPWorkers:
        """Spawn this node's ranks 1..N/K-1 and join the groups as rank 0 (N =
        config.tensor_parallel_size, K = config.nnodes; the other nodes' ranks come from their
        launchers, `engine/tp_node.py`)."""
        size = config.tensor_parallel_size
        timeout_s = COLLECTIVE_TIMEOUT_S if timeout_s is None else timeout_s
        for key, value in MULTICAST_OFF.items():  # the children inherit these
            os.environ.setdefault(key, value)
        device_type = config.resolved_device().type
        folder = tempfile.mkdtemp(prefix="mlaserve-tp-")
        rendezvous = Rendezvous.for_config(config, folder)
        ctx = mp.get_context("spawn")
        state = _State([], [], folder, nnodes=rendezvous.nnodes)
        try:
            for rank in rendezvous.ranks_of(0)[1:]:
                rx, tx = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=worker_main,
                    args=(config, rank, size, rendezvous, timeout_s, tx),
                    name=f"mlaserve-tp{rank}",
                    daemon=True,  # killed at the interpreter's exit if still alive
                )
                proc.start()
                tx.close()  # the child's end: its exit must read as EOF here
                state.procs.append(proc)
                state.conns.append(rx)
            logger.info("tensor parallel: %d ranks (%s), workers %s", size, device_type,
                        [p.pid for p in state.procs])  # fmt: skip
            if rendezvous.nnodes > 1:
                logger.info(
                    "tensor parallel over %d nodes of %d ranks: waiting up to %g s for them at "
                    "%s", rendezvous.nnodes, rendezvous.local_size, rendezvous.timeout_s,
                    rendezvous.where,
                )  # fmt: skip
            tp, control, store = init_groups(
                0, size, device_type=device_type, rendezvous=rendezvous,
                timeout_s=timeout_s, idle=False,
            )  # fmt: skip
            ring = open_step_ring(0, size, control, nnodes=rendezvous.nnodes,
                                  device_type=device_type)  # fmt: skip
            if store is not None:
                state.store = store  # the other nodes' ranks and launchers hold it open
                watch_heartbeats(
                    rendezvous.client(timeout_s), rendezvous, state.loss, state.released.is_set
                )
        except BaseException:
            _stop(state, graceful=False)
            raise
        loss = state.loss  # not `state`: the sender must not hold what holds it
        state.sender = StepSender(control, ring, lambda: not loss.is_set(), timeout_s)
        watch_workers(state.procs, state.watch, state.released.is_set, loss=state.loss)
        return cls(state, tp, control)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._state.procs]

    def failed(self, exc: BaseException) -> EngineDeadError:
        """A step (or start-up) raised `exc` with the group in use: the group is broken. Kill the
        workers, leave the group, and return the error to raise (also kept in `dead`)."""
        if self.dead is None:
            with self._state.watch.busy():  # killing and leaving may hang on a stuck device
                self.dead = self._fail(exc)
        return self.dead

    def _fail(self, exc: BaseException) -> EngineDeadError:
        state = self._state
        time.sleep(0.2)  # a worker that raised is exiting: let its report and code arrive
        _read_errors(state)
        codes = {r: p.exitcode for r, p in enumerate(state.procs, 1)}
        _stop(state, graceful=False)
        lines = [f"rank {r}: exited with code {c}" for r, c in codes.items() if c is not None]
        lines += [f"rank {r} raised:\n{tb}" for r, tb in state.errors.items()]
        if state.loss.why and state.loss.why.startswith("node"):
            lines.append(state.loss.why)
        if not lines and state.nnodes > 1:  # the peer that closed its sockets is elsewhere
            lines.append(
                f"no worker of this node exited: a rank on another of the {state.nnodes} nodes "
                f"failed or its node went away (see that node's log); rank 0's collective "
                f"failed: {exc}"
            )
        why = "\n".join(lines) or f"no worker exited; rank 0's collective failed: {exc}"
        return EngineDeadError(
            f"engine dead: tensor-parallel group of {self.tp.size} ranks failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            f"workers stopped.\n{why}"
        )

    def check(self) -> None:
        """Raise the engine's death if it is dead, or if a worker exited since the last step."""
        if self.dead is not None:
            raise self.dead
        if self._state.stopped:
            raise EngineDeadError("engine shut down: its tensor-parallel workers are stopped")
        gone = [p for p in self._state.procs if not p.is_alive()]
        if gone:
            raise self.failed(RuntimeError(f"worker pid {gone[0].pid} exited"))
        if self._state.loss.is_set():  # another node went silent (`engine/tp_heartbeat.py`)
            raise self.failed(RuntimeError(self._state.loss.why))

    def run_step(self, step: Callable[[], T]) -> T:
        """`step()` guarded: a step that raises once its batch went to the workers (or finds a
        worker gone) leaves the group out of step, so the workers are stopped and
        `EngineDeadError` is raised, now and on every later step. A step refused before any
        rank saw it leaves the group intact and re-raises as is."""
        self.check()
        sent = self.sender.num_sent
        try:
            with self._state.watch.busy():
                return step()
        except Exception as e:
            if self.sender.num_sent == sent:
                self.check()
                raise
            raise self.failed(e) from e

    def busy(self) -> StepWatch:
        """Mark rank 0 busy with work the workers share outside a step (loading, warm-up and
        capture): a worker that dies meanwhile and leaves it stuck ends the process
        (`engine/tp_watchdog.py`)."""
        return self._state.watch.busy()

    def stop(self) -> None:
        """Normal shutdown: the stop message, leave the group, join the workers (kill past
        JOIN_TIMEOUT_S). Idempotent."""
        self._finalizer()


def _read_errors(state: _State) -> None:
    for rank, conn in enumerate(state.conns, 1):
        try:
            while conn.poll():
                state.errors[rank] = conn.recv()
        except (EOFError, OSError):
            pass


def _stop(state: _State, graceful: bool = True) -> None:
    import torch.distributed as dist

    if state.stopped:
        return
    state.stopped = True
    alive = all(p.is_alive() for p in state.procs) and not state.loss.is_set()
    if graceful and alive and state.sender is not None:
        try:
            state.sender.stop()
        except Exception as e:  # a broken group: the workers are killed below
            logger.warning("tensor parallel: stop message failed (%s); killing the workers", e)
            graceful = False
    deadline = time.monotonic() + (JOIN_TIMEOUT_S if graceful and alive else 0.0)
    for p in state.procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(JOIN_TIMEOUT_S)
    _read_errors(state)
    for conn in state.conns:
        conn.close()
    if dist.is_initialized():
        try:
            leave_process_group()
        except Exception as e:
            logger.warning("tensor parallel: leaving the group failed: %s", e)
    state.store = None  # the TCP store closes: the other nodes' launchers see node 0's end
    state.sender = None  # the group's last reference here (see `released`)
    shutil.rmtree(state.rendezvous_dir, ignore_errors=True)
    state.released.set()


def start_runner(
    config: EngineConfig,
    model_config: ModelConfig,
    eos_token_ids: list[int],
    startup: StartupTimes | None = None,
) -> tuple[ModelRunner, TPWorkers | None]:
    """Rank 0's ModelRunner; with `tensor_parallel_size` N > 1 the workers (ranks 1..N-1) are
    started first, and each step's batch goes to them through the runner's `step_sender`.
    `startup`: gets tp_start and the runner's phases."""
    startup = StartupTimes() if startup is None else startup
    if config.resolved_tensor_parallel_size(model_config) == 1:
        return ModelRunner(config, model_config, eos_token_ids, startup=startup), None
    with startup.phase("tp_start"):
        workers = TPWorkers.start(config)
    try:
        with workers.busy():
            runner = ModelRunner(
                config, model_config, eos_token_ids, tp=workers.tp, control_group=workers.control,
                startup=startup,
            )  # fmt: skip
    except Exception as e:
        raise workers.failed(e) from e
    runner.step_sender = workers.sender
    return runner, workers
