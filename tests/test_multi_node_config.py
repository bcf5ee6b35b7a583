"""The multi-node options (`config/multi_node.py`): each wrong combination is a ConfigError
naming the option, and every option also comes from its MLASERVE_* variable."""

from __future__ import annotations

import pytest

from mlaserve.config import ConfigError, EngineConfig
from mlaserve.config.multi_node import parse_dist_init_addr
from mlaserve.service.settings import load_settings

TWO = dict(tensor_parallel_size=4, nnodes=2, dist_init_addr="10.0.0.1:29500")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dist_init_addr": None}, "dist_init_addr: --nnodes 2 needs --dist-init-addr"),
        ({"dist_init_addr": "10.0.0.1"}, "dist_init_addr: expected HOST:PORT"),
        ({"dist_init_addr": "10.0.0.1:70000"}, "dist_init_addr: expected HOST:PORT"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size 3 is not divisible by nnodes 2"),
        ({"tensor_parallel_size": 1}, "tensor_parallel_size 1 is not divisible by nnodes 2"),
        ({"node_rank": 2}, "node_rank: must be in [0, nnodes - 1] = [0, 1], got 2"),
        ({"node_rank": -1}, "node_rank: must be an integer >= 0"),
        ({"nnodes": 0}, "nnodes: must be an integer >= 1"),
        ({"dist_timeout": 0}, "dist_timeout: must be a number of seconds > 0"),
    ],
)
def test_bad_combinations_name_the_option(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{**TWO, **changes})
    assert message in str(e.value)


def test_valid_forms() -> None:
    assert EngineConfig(**TWO, node_rank=1).node_rank == 1
    assert parse_dist_init_addr("[::1]:29500") == ("::1", 29500)
    assert parse_dist_init_addr("leader.svc:1") == ("leader.svc", 1)
    assert EngineConfig().nnodes == 1  # one node needs none of them


def test_every_option_comes_from_its_variable() -> None:
    env = {"MLASERVE_TENSOR_PARALLEL_SIZE": "4", "MLASERVE_NNODES": "2",
           "MLASERVE_NODE_RANK": "1", "MLASERVE_DIST_INIT_ADDR": "10.0.0.1:29500",
           "MLASERVE_DIST_TIMEOUT": "5"}  # fmt: skip
    settings = load_settings({}, env)
    engine = settings.engine
    assert (engine.nnodes, engine.node_rank, engine.dist_init_addr, engine.dist_timeout) == (
        2, 1, "10.0.0.1:29500", 5.0,
    )  # fmt: skip
    assert settings.sources["node_rank"] == "env MLASERVE_NODE_RANK"
