"""vLLM's `serve` flags (and `LLM(...)` keywords) that DeepSeek users pass, and what mlaserve does
with each: the same option under the same name, mapped to an option of ours, accepted with no
effect because the behaviour is already ours, or refused with the reason and what to use instead.

One table for both doors: `mlaserve serve` registers every row that is not already one of its
options (service/cli.py), and `LLM(**kwargs)` translates vLLM keywords through the same rows
(`engine_options`), so a keyword means what its flag means. docs/vllm_flags.md is this table,
checked against it by tests/config/test_vllm_flags.py. Here in config/ (not service/) because
the offline API sits below the service and must not import it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from mlaserve.config.error import ConfigError
from mlaserve.config.speculative_config import SPECULATIVE_METHODS

__all__ = [
    "VLLM_FLAGS",
    "VllmFlag",
    "engine_options",
    "find_flag",
    "normalize_engine_values",
    "translate",
]

Kind = Literal["same", "mapped", "noop", "refused"]
Convert = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag. `example` is a command-line fragment using it and `expect` the options it
    yields (the test walks them; the docs show them)."""

    flag: str  # "--block-size"
    kind: Kind
    why: str  # the log note (mapped, noop), the refusal's reason and remedy, or the meaning
    aliases: tuple[str, ...] = ()  # "-dp"
    nargs: int | str | None = None  # argparse's: 0 a switch, None one value, "+" a list
    convert: Convert | None = None  # mapped: the value -> {option: value}
    noop_values: tuple[str, ...] = ()  # refused rows: values that change nothing (-dp 1)
    example: tuple[str, ...] = ()
    expect: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The keyword form: `--block-size` -> `block_size`."""
        return self.flag.removeprefix("--").replace("-", "_")


def _int(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected an integer, got {value!r}") from None


def _sizes(value: Any) -> str:
    """vLLM's --cuda-graph-sizes: several values are the sizes; one value N is vLLM's pattern
    1, 2, 4, then steps of 8 up to N. As "1,2,4" for cuda_graph_batch_sizes."""
    items = value if isinstance(value, (list, tuple)) else [value]
    sizes = [_int("cuda_graph_sizes", v) for v in items]
    if len(sizes) == 1:
        sizes = [s for s in (1, 2, 4, *range(8, sizes[0] + 1, 8)) if s <= sizes[0]]
    return ",".join(map(str, sizes))


def _compilation_config(value: Any) -> dict[str, Any]:
    """vLLM's --compilation-config: its capture sizes and a "NONE" graph mode mean ours; the
    rest (compile level, fusion passes) configures vLLM's torch.compile, which mlaserve has
    not: ignored, and the note names the keys."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"compilation_config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"compilation_config: expected a JSON object, got {value!r}")
    out: dict[str, Any] = {}
    if "cudagraph_capture_sizes" in value:
        out["cuda_graph_batch_sizes"] = _sizes(list(value["cudagraph_capture_sizes"]))
    if str(value.get("cudagraph_mode", "")).upper() == "NONE":
        out["cuda_graph"] = False
    return out


def _switch(**options: Any) -> Convert:
    """A switch setting `options` when on; off (`LLM(enforce_eager=False)`) changes nothing."""
    return lambda on: dict(options) if on else {}


def _one(option: str, read: Callable[[str, Any], Any] = lambda _, v: v) -> Convert:
    return lambda value: {option: read(option, value)}


VLLM_FLAGS: tuple[VllmFlag, ...] = (
    # ----- the same option, same name, same meaning (mlaserve's own flags) -----
    VllmFlag("--tensor-parallel-size", "same", "shard the model over N GPUs", ("-tp",),
             example=("-tp", "2"), expect={"tensor_parallel_size": 2}),
    VllmFlag("--enable-expert-parallel", "same", "with -tp N, each rank holds whole experts",
             nargs=0, example=("--enable-expert-parallel",),
             expect={"enable_expert_parallel": True}),
    VllmFlag("--trust-remote-code", "same", "run the tokenizer class the checkpoint ships as "
             "code (Kimi-K2, Moonlight); the model is always mlaserve's", nargs=0,
             example=("--trust-remote-code",), expect={"trust_remote_code": True}),
    VllmFlag("--max-model-len", "same", "prompt + output tokens per request",
             example=("--max-model-len", "4096"), expect={"max_model_len": 4096}),
    VllmFlag("--gpu-memory-utilization", "same", "share of the GPU's memory this server uses",
             example=("--gpu-memory-utilization", "0.9"), expect={"gpu_memory_utilization": 0.9}),
    VllmFlag("--max-num-seqs", "same", "most requests in one batch",
             example=("--max-num-seqs", "32"), expect={"max_num_seqs": 32}),
    VllmFlag("--max-num-batched-tokens", "same", "token budget of one step",
             example=("--max-num-batched-tokens", "4096"), expect={"max_num_batched_tokens": 4096}),
    VllmFlag("--kv-cache-dtype", "same", "KV-cache dtype (auto, fp8, fp8_e4m3, bfloat16)",
             example=("--kv-cache-dtype", "fp8"), expect={"kv_cache_dtype": "fp8"}),
    VllmFlag("--enable-prefix-caching", "same", "reuse KV pages of identical prompt prefixes "
             "(on by default; --no-enable-prefix-caching turns it off)",
             nargs=0, example=("--enable-prefix-caching",), expect={"enable_prefix_caching": True}),
    VllmFlag("--speculative-config", "same", "MTP speculation: method deepseek_mtp (or mtp) is "
             "this engine's MTP; other methods are refused",
             example=("--speculative-config", '{"method": "deepseek_mtp", '
                      '"num_speculative_tokens": 3}'),
             expect={"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}),
    VllmFlag("--dtype", "same", "weights dtype; vLLM's half and float mean float16 and float32",
             example=("--dtype", "half"), expect={"dtype": "float16"}),
    VllmFlag("--seed", "same", "seed of requests that give none",
             example=("--seed", "7"), expect={"seed": 7}),
    VllmFlag("--load-format", "same", "auto or dummy; vLLM's safetensors means auto",
             example=("--load-format", "safetensors"), expect={"load_format": "auto"}),
    VllmFlag("--tokenizer", "same", "tokenizer folder",
             example=("--tokenizer", "/tok"), expect={"tokenizer": "/tok"}),
    VllmFlag("--served-model-name", "same", "the model's name in the API (one name)",
             example=("--served-model-name", "ds"), expect={"served_model_name": "ds"}),
    VllmFlag("--chat-template", "same", "a Jinja file or the template itself",
             example=("--chat-template", "{{ messages }}"),
             expect={"chat_template": "{{ messages }}"}),
    VllmFlag("--tool-call-parser", "same", "how the model writes tool calls",
             example=("--tool-call-parser", "deepseek_v3"),
             expect={"tool_call_parser": "deepseek_v3"}),
    VllmFlag("--enable-auto-tool-choice", "same", "let the model decide to call tools", nargs=0,
             example=("--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"),
             expect={"enable_auto_tool_choice": True, "tool_call_parser": "deepseek_v3"}),
    VllmFlag("--reasoning-parser", "same", "split the `<think>` block into reasoning_content",
             example=("--reasoning-parser", "deepseek_r1"),
             expect={"reasoning_parser": "deepseek_r1"}),
    VllmFlag("--max-logprobs", "same", "most logprobs a request may ask for",
             example=("--max-logprobs", "5"), expect={"max_logprobs": 5}),
    VllmFlag("--disable-log-requests", "same", "no log line per request", nargs=0,
             example=("--disable-log-requests",), expect={"disable_log_requests": True}),
    VllmFlag("--disable-uvicorn-access-log", "same", "no access-log line per HTTP request",
             nargs=0, example=("--disable-uvicorn-access-log",),
             expect={"disable_uvicorn_access_log": True}),
    VllmFlag("--api-key", "same", "require this bearer token",
             example=("--api-key", "k"), expect={"api_key": "k"}),
    VllmFlag("--host", "same", "address to listen on",
             example=("--host", "0.0.0.0"), expect={"host": "0.0.0.0"}),
    VllmFlag("--port", "same", "port to listen on", example=("--port", "9000"),
             expect={"port": 9000}),
    # ----- mapped: the same behaviour under an option of ours -----
    VllmFlag("--enforce-eager", "mapped", "--enforce-eager: CUDA graphs off (--no-cuda-graph)",
             nargs=0, convert=_switch(cuda_graph=False), example=("--enforce-eager",),
             expect={"cuda_graph": False}),
    VllmFlag("--block-size", "mapped", "--block-size: tokens per KV page (--page-size)",
             convert=_one("page_size", _int), example=("--block-size", "32"),
             expect={"page_size": 32}),
    VllmFlag("--cuda-graph-sizes", "mapped", "--cuda-graph-sizes: the decode batch sizes "
             "captured (--cuda-graph-batch-sizes); one value N is vLLM's 1, 2, 4, 8, 16, ..., N",
             nargs="+", convert=_one("cuda_graph_batch_sizes", lambda _, v: _sizes(v)),
             example=("--cuda-graph-sizes", "16"), expect={"cuda_graph_batch_sizes": (1, 2, 4, 8, 16)}),
    VllmFlag("--compilation-config", "mapped", "--compilation-config: cudagraph_capture_sizes "
             "is --cuda-graph-batch-sizes, cudagraph_mode NONE is --no-cuda-graph; other keys "
             "configure vLLM's torch.compile, which mlaserve has not, and are ignored",
             convert=_compilation_config,
             example=("--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4], "level": 3}'),
             expect={"cuda_graph_batch_sizes": (1, 2, 4)}),
    VllmFlag("--async-scheduling", "mapped", "--async-scheduling: overlap scheduling "
             "(--overlap-schedule; already on with CUDA)", nargs=0,
             convert=_switch(overlap_schedule=True), example=("--async-scheduling",),
             expect={"overlap_schedule": True}),
    VllmFlag("--uvicorn-log-level", "mapped", "--uvicorn-log-level: the server's log level "
             "(--log-level), uvicorn's included", convert=_one("log_level"),
             example=("--uvicorn-log-level", "warning"), expect={"log_level": "warning"}),
    VllmFlag("--enable-log-requests", "mapped", "--enable-log-requests: one log line per "
             "request, already the default (--disable-log-requests turns it off)", nargs=0,
             convert=_switch(disable_log_requests=False), example=("--enable-log-requests",),
             expect={"disable_log_requests": False}),
    # ----- accepted with no effect: the behaviour is already mlaserve's -----
    VllmFlag("--disable-log-stats", "noop", "--disable-log-stats: accepted; mlaserve logs no "
             "periodic statistics (they are on GET /metrics)", nargs=0,
             example=("--disable-log-stats",)),
    VllmFlag("--enable-chunked-prefill", "noop", "--enable-chunked-prefill: accepted; prefill "
             "is always chunked, by --max-num-batched-tokens", nargs=0,
             example=("--enable-chunked-prefill",)),
    VllmFlag("--swap-space", "noop", "--swap-space: accepted; a preempted request is "
             "recomputed, KV is never swapped to the CPU", example=("--swap-space", "4")),
    VllmFlag("--max-seq-len-to-capture", "noop", "--max-seq-len-to-capture: accepted; the "
             "decode CUDA graphs serve every context length (paged KV)",
             example=("--max-seq-len-to-capture", "8192")),
    VllmFlag("--num-scheduler-steps", "noop", "--num-scheduler-steps: accepted; one step per "
             "schedule, and overlap scheduling (--overlap-schedule) hides the host's work",
             example=("--num-scheduler-steps", "8")),
    # ----- refused: the reason, and what to use instead -----
    VllmFlag("--data-parallel-size", "refused", "one engine per server: run N servers (one "
             "per GPU group) behind a load balancer, or shard one model with -tp N",
             ("-dp",), noop_values=("1",), example=("--data-parallel-size", "8")),
    VllmFlag("--pipeline-parallel-size", "refused", "no pipeline parallelism: shard the "
             "model with -tp N (tensor parallelism)", ("-pp",), noop_values=("1",),
             example=("--pipeline-parallel-size", "2")),
    VllmFlag("--distributed-executor-backend", "refused", "mlaserve starts its own worker "
             "processes (mp); Ray and external launchers are not supported",
             noop_values=("mp", "uni"), example=("--distributed-executor-backend", "ray")),
    VllmFlag("--quantization", "refused", "the quantization is read from the checkpoint's "
             "config.json (FP8 block checkpoints load as they are) and nothing is quantized "
             "online: drop the flag", ("-q",), example=("--quantization", "fp8")),
    VllmFlag("--download-dir", "refused", "mlaserve downloads nothing: fetch the checkpoint "
             "with `hf download REPO --local-dir DIR` and give DIR as the model",
             example=("--download-dir", "/models")),
    VllmFlag("--hf-overrides", "refused", "config.json is read as it is: edit a copy of the "
             "checkpoint's config.json instead", example=("--hf-overrides", "{}")),
    VllmFlag("--enable-eplb", "refused", "no expert-load balancing: experts stay where "
             "--enable-expert-parallel puts them", nargs=0, example=("--enable-eplb",)),
)  # fmt: skip

_BY_NAME = {spelling: row for row in VLLM_FLAGS for spelling in (row.flag, *row.aliases)}
_BY_NAME.update({row.name: row for row in VLLM_FLAGS})


def find_flag(name: str) -> VllmFlag | None:
    """The row for `--block-size`, `-dp` or the keyword `block_size`; None if not in the table."""
    return _BY_NAME.get(name)


def translate(row: VllmFlag, value: Any) -> tuple[dict[str, Any], str | None]:
    """What `row` given `value` (a command-line string, True for a switch, or a Python value
    from `LLM(...)`) sets: ({option: value}, the log note or None). Raises `ConfigError` for a
    refused row, naming the flag, why, and what to use instead."""
    if row.kind == "same":
        return {row.name: value}, None
    if row.kind == "mapped" and row.convert is not None:
        return row.convert(value), row.why
    if row.kind == "noop":
        return {}, row.why
    if row.noop_values and str(value) in row.noop_values:
        return {}, f"{row.flag} {value}: accepted; the only setting mlaserve has"
    raise ConfigError(f"{row.flag} is not supported: {row.why}")


def normalize_engine_values(values: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spellings of engine values, from any source, as this engine's: dtype half/float,
    load_format safetensors, speculative_config method deepseek_mtp (a method other than MTP is
    refused here, naming what works)."""
    out = dict(values)
    dtype = {"half": "float16", "float": "float32"}.get(str(out.get("dtype")))
    if dtype:
        out["dtype"] = dtype
    if out.get("load_format") == "safetensors":
        out["load_format"] = "auto"
    spec = out.get("speculative_config")
    if isinstance(spec, dict) and "method" in spec:
        method = spec["method"]
        if method == "deepseek_mtp":
            out["speculative_config"] = {**spec, "method": "mtp"}
        elif method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config: method {method!r} is not supported: mlaserve speculates "
                "with the checkpoint's own MTP layers only; use "
                '{"method": "deepseek_mtp", "num_speculative_tokens": k} (or "mtp")'
            )
    return out


def engine_options(
    kwargs: Mapping[str, Any], engine_fields: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """`LLM(**kwargs)`: engine fields as they are, vLLM keywords through the table (the CLI's
    meaning), then `normalize_engine_values`. Returns the EngineConfig arguments and the notes
    to log. TypeError for a name that is neither (or a server-only flag); ConfigError for a
    refused one or two keywords that set one field differently."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    for name, value in kwargs.items():
        if name in engine_fields:
            options, note = {name: value}, None
        else:
            row = find_flag(name)
            if row is None:
                valid = sorted({*engine_fields, *_offline_keywords(engine_fields)})
                raise TypeError(f"LLM: unknown engine option(s) [{name!r}]; valid: {valid}")
            options, note = translate(row, value)
            if not options.keys() <= set(engine_fields):
                raise TypeError(
                    f"LLM: {name!r} is a server option ({row.flag} of `mlaserve serve`), "
                    "not an engine option"
                )
        for key, val in options.items():
            if key in out and out[key] != val:
                raise ConfigError(f"{key}: set to {out[key]!r} and, through {name}, to {val!r}")
            out[key] = val
        if note:
            notes.append(note)
    return normalize_engine_values(out), notes


def _offline_keywords(engine_fields: list[str]) -> list[str]:
    """The vLLM keywords `LLM(...)` takes besides the engine fields: the mapped rows that set
    engine options only, and the no-op ones."""
    names = []
    for row in VLLM_FLAGS:
        if row.kind in ("same", "refused") or row.name in engine_fields:
            continue
        if row.kind != "mapped" or set(row.expect) <= set(engine_fields):
            names.append(row.name)
    return names
