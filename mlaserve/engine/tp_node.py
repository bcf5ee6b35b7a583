"""A node > 0 of a multi-node tensor-parallel group: `mlaserve serve --nnodes K --node-rank R`
with R > 0 runs this launcher instead of the HTTP server.

    code = run_node(config)     # the process's exit code

It spawns the node's N/K ranks (global ranks R * N/K + l on cuda:l, `engine/tp_worker.py`), beats
its heartbeat in node 0's store (`engine/tp_heartbeat.py`) and waits. Exit codes:

- 0: every rank exited 0 (rank 0 sent the stop message: node 0 shut down normally);
- 1: a rank failed (its traceback is logged), the rendezvous failed, or node 0 went away (its
  store closed or stopped answering) and the ranks did not stop by themselves within
  `JOIN_TIMEOUT_S`: they are killed, so nothing is left on this node's GPUs.

The ranks are this process's children and exit with it (`exit_with_parent`), so a SIGTERM or
SIGKILL of the launcher (a pod's deletion) takes them down too, which node 0 sees as a failed
collective or a silent heartbeat.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from mlaserve.config import EngineConfig, ModelConfig
from mlaserve.engine.tp_heartbeat import BEAT_S, beat
from mlaserve.engine.tp_rendezvous import Rendezvous, RendezvousError
from mlaserve.engine.tp_worker import MULTICAST_OFF, worker_main
from mlaserve.engine.tp_workers import COLLECTIVE_TIMEOUT_S, JOIN_TIMEOUT_S

__all__ = ["run_node"]

logger = logging.getLogger(__name__)


def run_node(config: EngineConfig) -> int:
    """Run node `config.node_rank` (> 0) until its ranks end or node 0 goes away (module doc)."""
    config.resolved_tensor_parallel_size(ModelConfig.from_pretrained(config.model_path))
    for key, value in MULTICAST_OFF.items():  # the children inherit these
        os.environ.setdefault(key, value)
    rendezvous = Rendezvous.for_config(config)
    node = config.node_rank
    ranks = rendezvous.ranks_of(node)
    logger.info(
        "node %d of %d: ranks %s of %d, node 0's store at %s", node, config.nnodes, ranks,
        rendezvous.size, rendezvous.where,
    )  # fmt: skip
    try:
        store = rendezvous.client(rendezvous.timeout_s)
    except RendezvousError as e:
        logger.error("%s", e)
        return 1
    lost, stop_beating = threading.Event(), threading.Event()
    why: list[str] = []
    beating = beat(store, node, lambda reason: (why.append(reason), lost.set()), stop=stop_beating)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in ranks:
        rx, tx = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=worker_main,
            args=(config, rank, rendezvous.size, rendezvous, COLLECTIVE_TIMEOUT_S, tx),
            name=f"mlaserve-tp{rank}",
            daemon=True,
        )
        proc.start()
        tx.close()  # the child's end: its exit must read as EOF here
        procs.append(proc)
        conns.append(rx)
    logger.info("node %d: ranks %s started (pids %s)", node, ranks, [p.pid for p in procs])
    try:
        return _wait(procs, conns, ranks, lost, why)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(JOIN_TIMEOUT_S)
        stop_beating.set()  # ended before the interpreter's exit (`beat`)
        beating.join(BEAT_S)


def _wait(
    procs: list[Any], conns: list[Connection], ranks: list[int], lost: threading.Event,
    why: list[str],
) -> int:  # fmt: skip
    while True:
        wait([p.sentinel for p in procs if p.is_alive()], timeout=0.5)
        failed = [(r, p.exitcode) for r, p in zip(ranks, procs) if p.exitcode not in (None, 0)]
        if failed:
            _log_errors(conns, ranks)
            logger.error("rank(s) %s exited (codes %s): stopping this node",
                         [r for r, _ in failed], [c for _, c in failed])  # fmt: skip
            return 1
        if all(p.exitcode == 0 for p in procs):
            logger.info("node 0 stopped the group: every rank of this node exited 0")
            return 0
        if lost.is_set():
            logger.error("node 0 is gone: %s; waiting %g s for the ranks to stop", why[0],
                         JOIN_TIMEOUT_S)  # fmt: skip
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if all(p.exitcode == 0 for p in procs):
                logger.info("every rank of this node exited 0 (node 0 stopped the group)")
                return 0
            _log_errors(conns, ranks)
            return 1


def _log_errors(conns: list[Connection], ranks: list[int]) -> None:
    for rank, conn in zip(ranks, conns):
        try:
            while conn.poll():
                logger.error("rank %d raised:\n%s", rank, conn.recv())
        except (EOFError, OSError):
            pass
