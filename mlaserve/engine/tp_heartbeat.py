"""Liveness across nodes: each node > 0's launcher beats a counter in node 0's TCP store, rank 0
watches the counters, and the launcher learns of node 0's end when the store stops answering.

    beat(store, node, on_lost)                       # a node's launcher (`engine/tp_node.py`)
    watch_heartbeats(store, rdv, loss, stopped)      # rank 0 (`engine/tp_workers.py`)

Why a heartbeat in the store, not only the collectives' sockets: a dead process closes its
sockets and the next gloo / eager NCCL collective fails at once, but a machine that vanishes
(power, kernel panic, a partition) sends nothing, and a collective replayed from a CUDA graph
waits forever. The store is already there (the rendezvous, `engine/tp_rendezvous.py`), reachable
from every node, and costs no extra port. The counter (`store.add`) needs no clock agreement
between nodes: rank 0 only asks whether it moved.

- A launcher adds 1 to `mlaserve/heartbeat/<node>` every `BEAT_S`. Its store client times out
  after `LOST_AFTER_S`, so an unreachable node 0 fails the add within that; a dead node 0 (its
  store's socket closed) fails it at once. Either way `on_lost` runs once and the thread ends.
- Rank 0 reads every node's counter every `BEAT_S` on its own store connection; a counter that
  has not moved for `LOST_AFTER_S` reports the node lost (`GroupLoss`): the next step raises the
  engine dead, and a step stuck on the device meanwhile is ended by the watchdog
  (`engine/tp_watchdog.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["BEAT_S", "LOST_AFTER_S", "beat", "watch_heartbeats"]

logger = logging.getLogger(__name__)

BEAT_S = 1.0
# Silence this long means the node or its launcher is gone (a beat is a few hundred bytes; a
# healthy launcher thread is never this late, even on a loaded host).
LOST_AFTER_S = 10.0
HEARTBEAT_KEY = "mlaserve/heartbeat/{}"


def beat(
    store: Any,
    node: int,
    on_lost: Callable[[str], None],
    period_s: float = BEAT_S,
    stop: threading.Event | None = None,
) -> threading.Thread:
    """Start node `node`'s heartbeat on `store` (a TCPStore client of node 0's store), until
    `stop` is set. A launcher sets it and joins the thread before its interpreter exits: a
    daemon thread that comes back from `store.add` (which releases the GIL) while the
    interpreter finalizes aborts the process."""
    store.set_timeout(timedelta(seconds=LOST_AFTER_S))
    key = HEARTBEAT_KEY.format(node)
    stop = threading.Event() if stop is None else stop

    def run() -> None:
        while not stop.is_set():
            try:
                store.add(key, 1)
            except Exception as e:  # the store is gone or unreachable: so is node 0
                if not stop.is_set():
                    on_lost(f"node 0's store stopped answering ({type(e).__name__}: {e})")
                return
            stop.wait(period_s)

    thread = threading.Thread(target=run, name="mlaserve-heartbeat", daemon=True)
    thread.start()
    return thread


def watch_heartbeats(
    store: Any,
    rendezvous: Any,
    loss: Any,
    stopped: Callable[[], bool],
    lost_after_s: float = LOST_AFTER_S,
) -> threading.Thread:
    """Start rank 0's watch over nodes 1..K-1 of `rendezvous` (an `engine/tp_rendezvous.
    Rendezvous`) on `store`; a silent node is reported to `loss` (a `GroupLoss`)."""
    nodes = range(1, rendezvous.nnodes)

    def run() -> None:
        seen = {n: (-1, time.monotonic()) for n in nodes}
        while not stopped() and not loss.is_set():
            now = time.monotonic()
            for n in nodes:
                try:
                    count = store.add(HEARTBEAT_KEY.format(n), 0)
                except Exception as e:  # our own store: only at shutdown
                    if not stopped():
                        logger.warning("tensor parallel: heartbeat watch ended: %s", e)
                    return
                last, since = seen[n]
                if count != last:
                    seen[n] = (count, now)
                elif now - since > lost_after_s:
                    loss.report(
                        f"node {n} (ranks {rendezvous.ranks_of(n)}) sent no heartbeat for "
                        f"{now - since:.0f} s: its launcher or its machine is gone"
                    )
                    return
            time.sleep(BEAT_S)

    thread = threading.Thread(target=run, name="mlaserve-heartbeat-watch", daemon=True)
    thread.start()
    return thread
