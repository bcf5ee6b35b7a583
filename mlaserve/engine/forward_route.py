"""How one target forward runs: eagerly, padded into a captured batch size (a CUDA graph replay,
or the same padded batch eagerly), or through a piecewise prefill bucket.

The graph runner decides a route for each host batch on rank 0 (`CudaGraphRunner.route`) and
executes it; under tensor parallelism the route travels with the batch
(`engine/step_broadcast.py`) and every other rank executes that same route. So all ranks replay
the same graph (whose NCCL collectives meet each other's) or run the same eager forward, even
when rank 0 turned its graphs off for a comparison (`CudaGraphRunner.enabled`). A worker checks
that a graphed route names a graph it captured (`CudaGraphRunner.execute`); the captured sets
themselves were checked equal at capture (`engine/tp_worker.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["EAGER", "ForwardRoute", "RoutePath"]


class RoutePath(IntEnum):
    EAGER = 0  # the batch as it is, eagerly (EXTEND past the buckets, or a batch too large)
    UNIFORM = 1  # a uniform batch padded to `size` rows: the graph (mode, q_len, size)
    PIECEWISE = 2  # an EXTEND batch in token bucket `size`: its pieces, attention between
    ONE_GRAPH = 3  # one fresh prompt in token bucket `size`: the whole forward in one graph


@dataclass(frozen=True)
class ForwardRoute:
    path: RoutePath
    size: int = 0  # UNIFORM: the padded batch size; PIECEWISE / ONE_GRAPH: the token bucket
    graphed: bool = False  # replayed from CUDA graphs (False: the same path, eagerly)

    def __post_init__(self) -> None:
        if self.path is not RoutePath.EAGER and self.size < 1:
            raise ValueError(f"forward route {self.path.name}: size must be >= 1, got {self.size}")
        if self.path is RoutePath.EAGER and (self.size or self.graphed):
            raise ValueError("forward route EAGER: no size, not graphed")


EAGER = ForwardRoute(RoutePath.EAGER)  # the route of every batch the graphs do not take
