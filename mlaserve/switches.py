"""The `MLASERVE_*` switches: environment variables for A/B runs and debugging, one typed reader
each, all declared in `SWITCHES` and documented in README.md's "Switches" table.

They are not configuration: the engine and service options (`MLASERVE_<OPTION>`) come
from `mlaserve/service/settings.py`. Each reader looks at the environment when called; the call
site decides when that is (per construction, per call, or once per device where it caches), so
tests and benchmarks can set a switch between reads. A bool switch is off only for "0"; an int
switch set to something that is not an integer raises `SwitchError` naming the variable.

This module imports nothing from mlaserve, so every layer may read it (ops/ does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "SWITCHES",
    "Switch",
    "SwitchError",
    "absorbed_hit",
    "all_reduce_norm",
    "all_reduce_one_shot_max_bytes",
    "all_reduce_two_shot_max_bytes",
    "background_warm_up",
    "compile_processes",
    "decode_prologue",
    "fused_ops",
    "fused_routing",
    "gemv_max_m",
    "joined_q",
    "mla_decode_rows",
    "moe_decode_max_tokens",
    "moe_grouped_max_tokens",
    "one_graph_prefill",
    "pdl",
    "prefix_split",
    "shared_overlap",
    "step_ring",
    "tp_fp32_reduce",
]


class SwitchError(ValueError):
    """A switch set to a value its type cannot take (a ValueError, as `int()` raised before)."""


@dataclass(frozen=True)
class Switch:
    """One switch as README.md's table states it (tests/test_switches.py compares the two)."""

    name: str  # the environment variable
    type: str  # "bool" (off only for "0"), "int", or "0/1" (unset: automatic)
    default: str  # the behaviour when unset, as the table writes it
    meaning: str
    read_in: str  # the module that reads it, under mlaserve/


SWITCHES: tuple[Switch, ...] = (
    Switch(
        "MLASERVE_FUSED_OPS",
        "0/1",
        "unset: CUDA with Triton",
        "0: the unfused torch path (the reference) everywhere; 1: the fused kernels also off "
        "CUDA (CPU tests under `TRITON_INTERPRET=1`)",
        "ops/__init__.py",
    ),
    Switch(
        "MLASERVE_PDL",
        "bool",
        "on (SM90+)",
        "programmatic dependent launch of the Triton kernels; read once per device "
        "(`pdl_launch.cache_clear()` to switch in one process)",
        "ops/pdl.py",
    ),
    Switch(
        "MLASERVE_GEMV_MAX_M",
        "int",
        "measured, per weight shape (`gemv_max_m`)",
        "tokens up to which a bf16/fp16 linear takes `ops.gemv` (0: never)",
        "model/layers/linear.py",
    ),
    Switch(
        "MLASERVE_GEMV_MAX_M_FP8",
        "int",
        "measured, per weight shape (`gemv_max_m`)",
        "the same for FP8 weights",
        "model/layers/linear.py",
    ),
    Switch(
        "MLASERVE_DECODE_PROLOGUE",
        "bool",
        "on",
        "MLA's decode prologue as one kernel; 0: its two kernels apart",
        "model/layers/mla.py",
    ),
    Switch(
        "MLASERVE_HEAD_GEMV_MAX_M",
        "int",
        "by the rank's heads (`ops.head_gemv.head_gemv_max_m`: 8 to 32 heads, 4 at 64)",
        "tokens up to which MLA's W_UK / W_UV products take `ops/head_gemv.py` (and the decode "
        "prologue its W_UK), at most 8 (`ops.head_gemv.HEAD_GEMV_MAX_M`); past it, and at 0, cuBLAS's bmm",
        "model/layers/mla.py",
    ),
    Switch(
        "MLASERVE_MOE_DECODE_MAX_TOKENS",
        "int",
        "`DECODE_MAX_TOKENS` = 8 (`DECODE_MAX_TOKENS_BYTES_BOUND` = 3: byte-bound 16-bit experts;"
        " `WIDE_FP8_DECODE_MAX_TOKENS` = 2, 4 for a rank's expert of <= `WIDE_NARROW_INTER` = 512:"
        " FP8 experts wider than `moe_decode.FP8_RUN` = 2048, as V3's and K2's)",
        "tokens up to which a MoE layer runs `ops/moe_decode.py` (0: never)",
        "model/layers/moe.py",
    ),
    Switch(
        "MLASERVE_MOE_GROUPED_MAX_TOKENS",
        "int",
        "`GROUPED_MAX_TOKENS` = 256, FP8 `GROUPED_MAX_TOKENS_FP8` = 256",
        "tokens up to which a MoE layer runs `ops/moe_grouped.py` (0: never)",
        "model/layers/moe.py",
    ),
    Switch(
        "MLASERVE_FUSED_ROUTING",
        "bool",
        "on",
        "`ops/moe_decode.py` selects the experts inside its first kernel up to "
        "`SELECT_IN_KERNEL_MAX_TOKENS` = 2 tokens; 0: the router runs first",
        "model/layers/moe.py",
    ),
    Switch(
        "MLASERVE_SHARED_OVERLAP",
        "bool",
        "on (CUDA)",
        "prefill MoE runs the shared experts on a side stream beside the routed ones; 0: in line "
        "(read once per device)",
        "model/layers/moe.py",
    ),
    Switch(
        "MLASERVE_TP_FP32_REDUCE",
        "bool",
        "on",
        "under tensor parallelism the row-parallel and MoE partial sums are all-reduced in fp32 "
        "and rounded once; 0: each rank rounds its partial to the model dtype first",
        "tensor_parallel.py",
    ),
    Switch(
        "MLASERVE_STEP_RING",
        "bool",
        "on (one node)",
        "rank 0's step messages reach its node's tensor-parallel ranks through a shared-memory "
        "ring (`engine/host_ring.py`); 0: broadcasts on the gloo control group (read on rank 0 "
        "when the group starts)",
        "engine/tp_worker.py",
    ),
    Switch(
        "MLASERVE_MLA_DECODE_ROWS",
        "int",
        "`small_batch_max_rows(heads)`: 4 tokens, fewer past 64 query rows (1 from 64 heads)",
        "uniform batches of up to this many tokens (bs x q_len) take `ops/mla_decode.py` instead "
        "of FlashMLA (0: FlashMLA always)",
        "kernels_adapter/flashmla.py",
    ),
    Switch(
        "MLASERVE_JOINED_Q",
        "bool",
        "on",
        "W_UK's GEMV writes FlashMLA's query whole; 0: `ops/q_prep.py` prepares it",
        "kernels_adapter/flashmla.py",
    ),
    Switch(
        "MLASERVE_ONE_GRAPH_PREFILL",
        "bool",
        "on",
        "one fresh prompt's prefill replays as one CUDA graph, attention included; 0: the pieces",
        "graph_runner/piecewise_graph_runner.py",
    ),
    Switch(
        "MLASERVE_PREFIX_SPLIT",
        "bool",
        "on",
        "a prefix-cache hit of one sequence splits FA2 over its cached prefix "
        "(`prefix_split.py`); 0: one launch (read when the attention backend is built)",
        "kernels_adapter/flash_varlen.py",
    ),
    Switch(
        "MLASERVE_ABSORBED_HIT",
        "bool",
        "on",
        "FlashMLA attends a one-sequence prefix-cache hit of <= 128 new tokens over >= 1024 "
        "cached ones in the absorbed form, as a decode of its new tokens (`absorbed_hit.py`); "
        "0: the MHA form (read when the attention backend is built)",
        "kernels_adapter/flashmla.py",
    ),
    Switch(
        "MLASERVE_BACKGROUND_WARM_UP",
        "bool",
        "on",
        "one GPU: the kernel warm-up runs on threads beside the KV pool, the warm-up request and "
        "the graphs' eager runs, joined before the first capture (`model/kernel_warm_up.py`); "
        "0: the decode kernels' before the KV pool, waited for, the rest compiled by the "
        "warm-up's forwards (read when the model runner is built)",
        "engine/model_runner.py",
    ),
    Switch(
        "MLASERVE_COMPILE_PROCESSES",
        "bool",
        "on",
        "one GPU, background warm-up on, Triton's cache empty at start-up: the warm-up's kernel "
        "variants compile on worker processes before the tasks load them "
        "(`kernel_compile_pool.py`); 0: on the warm-up's threads (read by the engine "
        "process's start and when the model runner is built)",
        "kernel_compile_pool.py",
    ),
    Switch(
        "MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES",
        "int",
        "measured, per GPU count (`MEASURED_PLANS`)",
        "bytes up to which a tensor-parallel all-reduce of a CUDA tensor takes symmetric "
        "memory's one-shot kernel (0: never); read when the group starts",
        "custom_all_reduce.py",
    ),
    Switch(
        "MLASERVE_ALL_REDUCE_TWO_SHOT_MAX_BYTES",
        "int",
        "measured, per GPU count (`MEASURED_PLANS`)",
        "then up to this many bytes its two-shot kernel (0: never); past both NCCL (both 0: "
        "NCCL only)",
        "custom_all_reduce.py",
    ),
    Switch(
        "MLASERVE_ALL_REDUCE_NORM",
        "bool",
        "on",
        "where the one-shot takes a partial sum of at most 32 rows that a residual-add + RMSNorm "
        "follows, one kernel does both; 0: the one-shot, then the norm; read when the group "
        "starts",
        "custom_all_reduce.py",
    ),
)


def _bool(name: str) -> bool:
    """On unless the variable is "0" (unset and any other value: on)."""
    return os.environ.get(name, "1") != "0"


def _int(name: str, default: int) -> int:
    """The variable as an int, `default` when unset; an empty or non-integer value raises."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise SwitchError(f"{name}={value!r}: not an integer") from None


def fused_ops() -> bool | None:
    """`MLASERVE_FUSED_OPS`: False for "0", True for "1", None (automatic) otherwise."""
    flag = os.environ.get("MLASERVE_FUSED_OPS", "")
    return False if flag == "0" else True if flag == "1" else None


def pdl() -> bool:
    """`MLASERVE_PDL`: whether programmatic dependent launch may be used."""
    return _bool("MLASERVE_PDL")


def gemv_max_m(fp8: bool) -> int | None:
    """`MLASERVE_GEMV_MAX_M_FP8` (FP8 weights) or `MLASERVE_GEMV_MAX_M`; None when unset or
    empty (the measured limits apply)."""
    name = "MLASERVE_GEMV_MAX_M_FP8" if fp8 else "MLASERVE_GEMV_MAX_M"
    if not os.environ.get(name, ""):
        return None
    return _int(name, 0)


def decode_prologue() -> bool:
    """`MLASERVE_DECODE_PROLOGUE`: MLA's decode prologue as one kernel."""
    return _bool("MLASERVE_DECODE_PROLOGUE")


def head_gemv_max_m(default: int) -> int:
    """`MLASERVE_HEAD_GEMV_MAX_M`, else `default`."""
    return _int("MLASERVE_HEAD_GEMV_MAX_M", default)


def moe_decode_max_tokens(default: int) -> int:
    """`MLASERVE_MOE_DECODE_MAX_TOKENS`, else the layer's `default`."""
    return _int("MLASERVE_MOE_DECODE_MAX_TOKENS", default)


def moe_grouped_max_tokens(default: int) -> int:
    """`MLASERVE_MOE_GROUPED_MAX_TOKENS`, else the layer's `default`."""
    return _int("MLASERVE_MOE_GROUPED_MAX_TOKENS", default)


def fused_routing() -> bool:
    """`MLASERVE_FUSED_ROUTING`: moe_decode may select the experts inside its first kernel."""
    return _bool("MLASERVE_FUSED_ROUTING")


def shared_overlap() -> bool:
    """`MLASERVE_SHARED_OVERLAP`: prefill MoE's shared experts on a side stream."""
    return _bool("MLASERVE_SHARED_OVERLAP")


def tp_fp32_reduce() -> bool:
    """`MLASERVE_TP_FP32_REDUCE`: tensor-parallel partial sums all-reduced in fp32."""
    return _bool("MLASERVE_TP_FP32_REDUCE")


def step_ring() -> bool:
    """`MLASERVE_STEP_RING`: one node's step messages through a shared-memory ring."""
    return _bool("MLASERVE_STEP_RING")


def mla_decode_rows(default: int) -> int:
    """`MLASERVE_MLA_DECODE_ROWS`, else `default` (the measured crossover)."""
    return _int("MLASERVE_MLA_DECODE_ROWS", default)


def joined_q() -> bool:
    """`MLASERVE_JOINED_Q`: FlashMLA takes the query W_UK's GEMV wrote whole."""
    return _bool("MLASERVE_JOINED_Q")


def one_graph_prefill() -> bool:
    """`MLASERVE_ONE_GRAPH_PREFILL`: one fresh prompt's prefill as one CUDA graph."""
    return _bool("MLASERVE_ONE_GRAPH_PREFILL")


def prefix_split() -> bool:
    """`MLASERVE_PREFIX_SPLIT`: a one-sequence prefix-cache hit splits FA2 over its prefix."""
    return _bool("MLASERVE_PREFIX_SPLIT")


def absorbed_hit() -> bool:
    """`MLASERVE_ABSORBED_HIT`: a one-sequence prefix-cache hit in the absorbed form."""
    return _bool("MLASERVE_ABSORBED_HIT")


def background_warm_up() -> bool:
    """`MLASERVE_BACKGROUND_WARM_UP`: the kernel warm-up beside start-up, on one GPU."""
    return _bool("MLASERVE_BACKGROUND_WARM_UP")


def compile_processes() -> bool:
    """`MLASERVE_COMPILE_PROCESSES`: start-up's kernel compiles on worker processes."""
    return _bool("MLASERVE_COMPILE_PROCESSES")


def all_reduce_one_shot_max_bytes(default: int) -> int:
    """`MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES`, else the measured `default`."""
    return _int("MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES", default)


def all_reduce_norm() -> bool:
    """`MLASERVE_ALL_REDUCE_NORM`: the all-reduce fused with the next residual-add + RMSNorm."""
    return _bool("MLASERVE_ALL_REDUCE_NORM")


def all_reduce_two_shot_max_bytes(default: int) -> int:
    """`MLASERVE_ALL_REDUCE_TWO_SHOT_MAX_BYTES`, else the measured `default`."""
    return _int("MLASERVE_ALL_REDUCE_TWO_SHOT_MAX_BYTES", default)
