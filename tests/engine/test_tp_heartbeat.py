"""Heartbeats across nodes (`engine/tp_heartbeat.py`) on a real TCP store in this process: a
node that beats is never reported, a silent one is (naming its ranks), and a launcher's beat
reports node 0 gone once the store's host closes it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from mlaserve.engine.tp_heartbeat import beat, watch_heartbeats
from mlaserve.engine.tp_rendezvous import Rendezvous
from mlaserve.engine.tp_watchdog import GroupLoss
from tests.service.server_process import free_port

WAIT_S = 30.0  # bounds a hang, not a speed


def _master(rdv: Rendezvous):
    return dist.TCPStore(rdv.host, rdv.port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))  # fmt: skip


def test_a_silent_node_is_lost_and_a_beating_one_is_not() -> None:
    rdv = Rendezvous(size=6, nnodes=3, host="127.0.0.1", port=free_port(), timeout_s=10)
    store = _master(rdv)
    beat(rdv.client(10), 1, lambda why: None, period_s=0.1)  # node 1 beats; node 2 never does
    loss, stop = GroupLoss(), threading.Event()
    watch_heartbeats(rdv.client(10), rdv, loss, stop.is_set, lost_after_s=1.0)
    assert loss.wait(WAIT_S)
    stop.set()
    assert loss.why.startswith("node 2 (ranks [4, 5]) sent no heartbeat"), loss.why
    del store


def test_a_beat_reports_node_0_gone_when_its_store_closes() -> None:
    rdv = Rendezvous(size=2, nnodes=2, host="127.0.0.1", port=free_port(), timeout_s=10)
    store = _master(rdv)
    gone = threading.Event()
    reasons: list[str] = []
    beat(rdv.client(10), 1, lambda why: (reasons.append(why), gone.set()), period_s=0.1)
    time.sleep(0.5)
    assert not gone.is_set()
    del store  # node 0's process ends: its store server with it
    assert gone.wait(WAIT_S)
    assert reasons[0].startswith("node 0's store stopped answering"), reasons


def test_a_stopped_beat_ends_without_reporting_a_loss() -> None:
    rdv = Rendezvous(size=2, nnodes=2, host="127.0.0.1", port=free_port(), timeout_s=10)
    store = _master(rdv)
    stop, reasons = threading.Event(), []
    thread = beat(rdv.client(10), 1, reasons.append, period_s=60.0, stop=stop)
    deadline = time.monotonic() + WAIT_S
    while store.add("mlaserve/heartbeat/1", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.add("mlaserve/heartbeat/1", 0) == 1  # the first beat landed, the next is 60 s off
    stop.set()  # mid-period: the thread wakes from its wait and ends
    thread.join(WAIT_S)
    assert not thread.is_alive() and reasons == []
    del store
