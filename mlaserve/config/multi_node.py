"""The multi-node options of `EngineConfig` checked together (SGLang's names): `--nnodes K`,
`--node-rank R`, `--dist-init-addr HOST:PORT`, `--dist-timeout S`.

    check_multi_node(config)                 # ConfigError naming the option, else None
    host, port = parse_dist_init_addr("10.0.0.1:29500")

The tensor-parallel group of N ranks is split into K nodes of N / K ranks each: node R holds the
global ranks R * N/K .. (R + 1) * N/K - 1, on its GPUs cuda:0 .. N/K - 1. One node (K = 1) needs
none of these options.
"""

from __future__ import annotations

from typing import Any

from mlaserve.config.error import ConfigError

__all__ = ["check_multi_node", "parse_dist_init_addr"]


def parse_dist_init_addr(addr: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets: `[::1]:29500`) -> (host, port)."""
    host, sep, port = addr.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"dist_init_addr: expected HOST:PORT (node 0's address and a free port in "
            f"[1, 65535]), got {addr!r}"
        )
    return host, int(port)


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def check_multi_node(config: Any) -> None:
    """`config` is an `EngineConfig` (not imported: it imports this module)."""
    nnodes = _int("nnodes", config.nnodes, 1)
    rank = _int("node_rank", config.node_rank, 0)
    timeout = config.dist_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"dist_timeout: must be a number of seconds > 0, got {timeout!r}")
    if rank >= nnodes:
        raise ConfigError(f"node_rank: must be in [0, nnodes - 1] = [0, {nnodes - 1}], got {rank}")
    if config.dist_init_addr is not None:
        parse_dist_init_addr(config.dist_init_addr)
    if nnodes == 1:
        return
    if config.dist_init_addr is None:
        raise ConfigError(
            f"dist_init_addr: --nnodes {nnodes} needs --dist-init-addr HOST:PORT, node 0's "
            "address and a free port there, the same on every node"
        )
    n = config.tensor_parallel_size
    if n % nnodes:
        raise ConfigError(
            f"nnodes: tensor_parallel_size {n} is not divisible by nnodes {nnodes} (every node "
            "runs tensor_parallel_size / nnodes ranks)"
        )
