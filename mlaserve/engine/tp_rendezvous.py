"""Where the ranks of a tensor-parallel group meet before they form it.

    rdv = Rendezvous.for_config(config, folder)   # picklable: a spawn argument
    joined = rdv.join(rank)                        # blocks until every rank is there
    dist.init_process_group(..., **joined.init_kwargs)

One node (`nnodes` 1): a FileStore in rank 0's fresh temporary folder, as before (no port to
race for). Several nodes: a TCP store (torch.distributed's TCPStore) at `--dist-init-addr`,
hosted by rank 0's process (the engine's, on node 0). Each rank registers a key
`mlaserve/joined/<rank>`; rank 0 waits until all N are there, at most `--dist-timeout` seconds,
then marks the store ready; past that it fails naming the ranks (and nodes) that never came, and
leaves that message in the store for the ranks that did. A rank > 0 waits for the ready mark
with the same bound; node 0's store going away meanwhile fails it at once. The process group
itself is formed on the same store under the prefix `mlaserve/pg/`, and the store outlives the
rendezvous: the nodes' heartbeats use it (`engine/tp_heartbeat.py`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from mlaserve.config import EngineConfig
from mlaserve.config.multi_node import parse_dist_init_addr

__all__ = ["Joined", "Rendezvous", "RendezvousError"]

JOINED_KEY = "mlaserve/joined/{}"
READY_KEY = "mlaserve/ready"
ABORT_KEY = "mlaserve/abort"
_POLL_S = 0.1
# A rank > 0 waits this much past `timeout_s` for rank 0's verdict (rank 0's own bound runs from
# when it started, which may be after the rank's).
_VERDICT_GRACE_S = 30.0


class RendezvousError(RuntimeError):
    """The ranks did not all meet: who is missing, or which store could not be reached."""


@dataclass
class Joined:
    """A rank's way into the group: `init_process_group`'s store or init_method keywords, and
    the raw TCP store (None with one node)."""

    init_kwargs: dict[str, Any]
    store: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class Rendezvous:
    size: int  # N, every node's ranks
    nnodes: int = 1
    file: str | None = None  # one node: the FileStore's path
    host: str | None = None  # several: node 0's store
    port: int = 0
    timeout_s: float = 300.0

    @classmethod
    def for_config(cls, config: EngineConfig, folder: str | None = None) -> Rendezvous:
        """Several nodes: the TCP store at `config.dist_init_addr`; one: a FileStore in `folder`
        (rank 0's temporary folder)."""
        size, nnodes = config.tensor_parallel_size, config.nnodes
        if nnodes == 1:
            if folder is None:
                raise ValueError("rendezvous: one node needs rank 0's folder for its FileStore")
            return cls(size, 1, file=os.path.join(folder, "store"), timeout_s=config.dist_timeout)
        host, port = parse_dist_init_addr(config.dist_init_addr or "")
        return cls(size, nnodes, host=host, port=port, timeout_s=config.dist_timeout)

    @property
    def local_size(self) -> int:
        return self.size // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.local_size

    def local_rank(self, rank: int) -> int:
        """The rank's index on its node: its GPU there (cuda:local_rank)."""
        return rank % self.local_size

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.local_size, (node + 1) * self.local_size))

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def client(self, timeout_s: float) -> Any:
        """A fresh connection to node 0's TCP store (retried until `timeout_s`); for a node's
        launcher and rank 0's heartbeat watcher."""
        import torch.distributed as dist

        try:
            return dist.TCPStore(
                self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout_s),
            )  # fmt: skip
        except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
            raise RendezvousError(
                f"rendezvous: could not reach node 0's store at {self.where} (--dist-init-addr) "
                f"within {timeout_s:g} s: {e}"
            ) from None

    def join(self, rank: int) -> Joined:
        """Meet every other rank (module doc); RendezvousError names what went wrong."""
        if self.nnodes == 1:
            return Joined({"init_method": f"file://{self.file}"})
        import torch.distributed as dist

        if rank == 0:
            try:
                store = dist.TCPStore(
                    self.host, self.port, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=self.timeout_s),
                )  # fmt: skip
            except (RuntimeError, OSError) as e:
                raise RendezvousError(
                    f"rendezvous: rank 0 cannot host the store at {self.where} (--dist-init-addr;"
                    f" a free port on this node): {e}"
                ) from None
        else:
            store = self.client(self.timeout_s)
        store.set(JOINED_KEY.format(rank), str(self.node_of(rank)))
        if rank == 0:
            self._await_all(store)
        else:
            self._await_verdict(store, rank)
        return Joined({"store": dist.PrefixStore("mlaserve/pg", store)}, store)

    def _await_all(self, store: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [r for r in range(self.size) if not store.check([JOINED_KEY.format(r)])]
            if not missing:
                store.set(READY_KEY, "1")
                return
            if time.monotonic() > deadline:
                nodes = sorted({self.node_of(r) for r in missing})
                message = (
                    f"rendezvous at {self.where}: rank(s) {missing} of {self.size} (node(s) "
                    f"{nodes}) did not join within {self.timeout_s:g} s (--dist-timeout): start "
                    f"`mlaserve serve` there with --nnodes {self.nnodes} --node-rank <node> "
                    f"--dist-init-addr {self.where}, and check that they reach this address"
                )
                store.set(ABORT_KEY, message)
                raise RendezvousError(message)
            time.sleep(_POLL_S)

    def _await_verdict(self, store: Any, rank: int) -> None:
        deadline = time.monotonic() + self.timeout_s + _VERDICT_GRACE_S
        while True:
            try:
                if store.check([READY_KEY]):
                    return
                if store.check([ABORT_KEY]):
                    raise RendezvousError(store.get(ABORT_KEY).decode())
            except (RuntimeError, OSError) as e:
                if isinstance(e, RendezvousError):
                    raise
                raise RendezvousError(
                    f"rendezvous: node 0's store at {self.where} went away while rank {rank} "
                    f"waited for the other ranks: {e}"
                ) from None
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rendezvous at {self.where}: rank {rank} saw no verdict from rank 0 within "
                    f"{self.timeout_s + _VERDICT_GRACE_S:g} s"
                )
            time.sleep(_POLL_S)
