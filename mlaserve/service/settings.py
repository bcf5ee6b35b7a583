"""Options of `mlaserve serve`, from four sources: CLI > `MLASERVE_*` env > config file > defaults.

Every `EngineConfig` field (via `EngineConfig.field_names()`, so fields added there show up
here) and every `ServerConfig` field is one option, spelled `--max-num-seqs` on the command
line, `MLASERVE_MAX_NUM_SEQS` in the environment and `max_num_seqs` (or `max-num-seqs`) in a
YAML or JSON config file. Values are parsed from the field's type; an optional field takes
`none`/`null` for None. A bad value raises `ConfigError` naming the option and its source.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlaserve.backend_names import ATTENTION_BACKENDS
from mlaserve.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MODEL_DTYPES,
    ConfigError,
    EngineConfig,
)
from mlaserve.config.vllm_flags import normalize_engine_values
from mlaserve.service.parsers import REASONING_PARSERS, TOOL_PARSERS
from mlaserve.service.request_limits import MAX_LOGPROBS, MAX_PROMPT_TOKENS, MAX_PROMPTS

__all__ = ["ENV_PREFIX", "Option", "ServerConfig", "Settings", "load_settings", "options"]

ENV_PREFIX = "MLASERVE_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side: where to listen, who may call, how much to admit, how to stop."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # require `Authorization: Bearer <key>` (not on probes/metrics)
    max_queue: int = 256  # requests that may wait beyond max_num_seqs running; then 503
    max_request_bytes: int = 8 * 1024 * 1024  # larger bodies get 413
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests, then aborts
    log_level: str = "info"
    # Checked before any prompt is tokenized (see docs/api.md, "Limits").
    max_prompts_per_request: int = MAX_PROMPTS
    max_prompt_tokens_per_request: int = 131072
    # Requests waiting for the tokenizer thread; more get 503. None: max_num_seqs + max_queue
    # (AsyncEngine derives it), so that the tokenizer never refuses what admission takes.
    tokenizer_queue: int | None = None
    torch_threads: int | None = None  # None: CPUs available minus the service's own threads
    # vLLM's names, so that `vllm serve` command lines work unchanged (tensor_parallel_size,
    # -tp, is an engine option: EngineConfig).
    max_logprobs: int = MAX_LOGPROBS  # most logprobs / top_logprobs a request may ask for
    chat_template: str | None = None  # a Jinja file or inline template; default: the tokenizer's
    disable_log_requests: bool = False
    disable_uvicorn_access_log: bool = False
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key: must not be empty")
        for name in ("max_queue", "max_request_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"shutdown_timeout: must be >= 0, got {self.shutdown_timeout}")
        _check_range("max_prompts_per_request", self.max_prompts_per_request, 1, MAX_PROMPTS)
        _check_range(
            "max_prompt_tokens_per_request", self.max_prompt_tokens_per_request, 1,
            MAX_PROMPT_TOKENS,
        )  # fmt: skip
        if self.tokenizer_queue is not None:
            _check_range("tokenizer_queue", self.tokenizer_queue, 1, None)
        if self.torch_threads is not None:
            _check_range("torch_threads", self.torch_threads, 1, None)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: expected one of {LOG_LEVELS}, got {self.log_level!r}")
        _check_range("max_logprobs", self.max_logprobs, 0, MAX_LOGPROBS)
        _check_choice("tool_call_parser", self.tool_call_parser, TOOL_PARSERS)
        _check_choice("reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError(
                "enable_auto_tool_choice: needs --tool-call-parser (e.g. deepseek_v3) to read the "
                "model's tool calls"
            )


def _check_choice(name: str, value: str | None, allowed: Mapping[str, object]) -> None:
    if value is not None and value not in allowed:
        raise ConfigError(f"{name}: expected one of {sorted(allowed)}, got {value!r}")


def _check_range(name: str, value: int, low: int, high: int | None) -> None:
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"{name}: must be {bound}, got {value}")


_HELP = {
    "model": "checkpoint folder (config.json, *.safetensors, tokenizer); "
    "default: the small model shipped in the package",
    "tokenizer": "tokenizer folder; default: the model folder",
    "load_format": "'auto': the checkpoint's safetensors; 'dummy' (vLLM's name): random weights "
    "made on the device from config.json alone (benchmarks at full width, no checkpoint; the "
    "folder still needs a tokenizer)",
    "device": "'auto' (cuda if available, else cpu), 'cpu', 'cuda' or 'cuda:N'",
    "trust_remote_code": "run the tokenizer class the checkpoint ships as Python code (its "
    "tokenizer_config.json auto_map: Kimi-K2's and Moonlight's tiktoken tokenizers need it); the "
    "model always runs mlaserve's own code (vLLM's flag)",
    "dtype": "weights/activations dtype; 'auto' = the checkpoint's on cuda, float32 on cpu",
    "kv_cache_dtype": "KV-cache dtype; default fp8_e4m3 on cuda, the model dtype on cpu",
    "page_size": "tokens per KV-cache page (a power of two)",
    "max_num_seqs": "most requests running in one batch",
    "max_model_len": "context length (prompt + output); default min(model limit, 8192)",
    "max_num_batched_tokens": "token budget of one engine step (prefill chunks + decodes)",
    "kv_cache_memory_fraction": "share of free GPU memory given to the KV cache (of the memory "
    "--gpu-memory-utilization leaves after the weights, when that is set)",
    "gpu_memory_utilization": "vLLM's meaning: fraction of the GPU's total memory this server may "
    "use for weights, KV cache and CUDA graphs; the KV cache gets kv_cache_memory_fraction of "
    "what is left after the weights (default: unset, the KV cache is sized from free memory)",
    "num_pages": "explicit KV-cache size in pages; overrides the memory fraction",
    "attention_backend": "MLA kernel backend ('auto' picks the best for the GPU)",
    "cuda_graph": "capture decode steps in CUDA graphs (default: on with CUDA; "
    "--enforce-eager = --no-cuda-graph)",
    "cuda_graph_batch_sizes": "batch sizes to capture, e.g. '1,2,4,8' (default: 1 2 4 8 12 16 "
    "24 32, then steps of 16 up to max_num_seqs)",
    "piecewise_cuda_graph": "replay prefill (EXTEND) forwards from piecewise CUDA graphs: "
    "everything but attention, per token bucket (default: on with CUDA graphs)",
    "piecewise_cuda_graph_max_tokens": "largest captured prefill token bucket (default: "
    "min(max_num_batched_tokens, 4096)); longer batches run eagerly",
    "overlap_schedule": "schedule and launch each step before the previous step's tokens "
    "reach the host, hiding the host's per-step work (default: on with CUDA; off with "
    "speculation)",
    "seed": "engine seed for requests that give none",
    "served_model_name": "model name in the API; default: derived from the model folder",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "mtp", '
    '"num_speculative_tokens": 3}\' (vLLM\'s "deepseek_mtp" is the same method; needs a '
    "checkpoint with MTP weights)",
    "num_speculative_tokens": "shorthand for speculative_config with method 'mtp' and k tokens",
    "speculative_disable_batch_size": "never speculate in decode steps of more requests than "
    "this (below it, the measured cost policy decides)",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer KEY' (not on /health, /ready, /metrics)",
    "max_queue": "requests that may wait beyond max_num_seqs; more get 503 + Retry-After",
    "max_request_bytes": "largest accepted request body; larger ones get 413",
    "shutdown_timeout": "seconds SIGTERM lets in-flight requests finish before aborting them",
    "log_level": f"one of {', '.join(LOG_LEVELS)}",
    "max_prompts_per_request": f"most prompts in one /v1/completions request (at most {MAX_PROMPTS})",
    "max_prompt_tokens_per_request": "most prompt tokens in one request, all prompts together; "
    "also bounds the JSON values (commas) a body may hold",
    "tokenizer_queue": "requests that may wait for the tokenizer thread; more get 503 "
    "tokenizer_busy (default: max_num_seqs + max_queue, the admission bound, so that a burst "
    "the server admits is never refused by the tokenizer)",
    "torch_threads": "torch intra-op threads; default: the CPUs available to the process minus "
    "the server's own threads (event loop, tokenizer), at least 1",
    "tensor_parallel_size": "-tp N: shard the model over N processes, one per GPU (cuda:0..N-1; "
    "on cpu, all on the CPU over gloo), started by the engine; N divides the attention heads. "
    "CUDA graphs, overlap scheduling and MTP speculation run on every rank as with N = 1",
    "deterministic_inference": "batch-invariant inference (also --enable-deterministic-inference, "
    "SGLang's name): a request's tokens and logprobs are bitwise the same whatever else runs "
    "with it and at -tp 1, 2, 4 or 8, through fixed-order kernels, one summation tree for "
    "every split sum and the 'invariant' attention backend; slower (README, 'Deterministic "
    "inference'); no expert parallelism",
    "enable_expert_parallel": "with -tp N > 1: each rank holds whole routed experts (N must "
    "divide them) instead of a slice of every expert; attention, the router and the shared "
    "experts stay tensor-parallel, one all-reduce per MoE layer as under TP (vLLM's flag)",
    "nnodes": "tensor parallelism over this many nodes (SGLang's name): each runs "
    "tensor_parallel_size / nnodes ranks on its GPUs cuda:0..; node 0 also runs the HTTP server "
    "and the scheduler (README, 'Two nodes')",
    "node_rank": "this node's index in [0, nnodes): 0 serves HTTP; a node > 0 runs only its ranks "
    "(global ranks node_rank * tensor_parallel_size / nnodes on) and exits when node 0 goes away",
    "dist_init_addr": "HOST:PORT where the nodes' ranks meet (node 0's address and a free port "
    "there; a TCP store rank 0 hosts); needed with nnodes > 1",
    "dist_timeout": "seconds the multi-node rendezvous waits for every rank; past it the start "
    "fails naming the ranks that did not join",
    "cache_dir": "one folder for every JIT artefact (Triton, torch Inductor, flashinfer, CuTe "
    "DSL, the CUDA driver's PTX cache): their cache variables point under it, in the engine and "
    "every tensor-parallel worker, unless set; a second start with it compiles nothing "
    "(default: unset, each library's own folder)",
    "enable_prefix_caching": "reuse the KV pages of earlier requests' identical prompt prefixes "
    "(full pages, keyed by a hash chain of their tokens; vLLM's flag, on by default as in vLLM; "
    "--no-enable-prefix-caching turns it off); with speculative decoding the MTP layer's KV is "
    "cached too",
    "max_logprobs": f"most logprobs (completions) / top_logprobs (chat) a request may ask for "
    f"(at most {MAX_LOGPROBS})",
    "chat_template": "chat template: a Jinja file, or the template itself; default: the "
    "tokenizer's",
    "disable_log_requests": "do not log one line per request (id, prompts, tokens, sampling)",
    "disable_uvicorn_access_log": "do not log one uvicorn access line per HTTP request",
    "tool_call_parser": "how the model writes tool calls, for tools/tool_choice on chat "
    "completions: deepseek_v3 (DeepSeek-V3/R1), kimi_k2 (Kimi-K2)",
    "enable_auto_tool_choice": "let the model decide to call tools (tool_choice 'auto', the "
    "default when tools are given); needs --tool-call-parser",
    "reasoning_parser": "split the model's reasoning (<think>...</think>) into reasoning_content",
}

#: Allowed values shown in --help (the configs validate them).
CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": MODEL_DTYPES,
    "load_format": LOAD_FORMATS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "attention_backend": ("auto", *sorted(ATTENTION_BACKENDS)),
    "device": ("auto", "cpu", "cuda", "cuda:N"),
    "log_level": LOG_LEVELS,
    "tool_call_parser": tuple(sorted(TOOL_PARSERS)),
    "reasoning_parser": tuple(sorted(REASONING_PARSERS)),
}


@dataclass(frozen=True)
class Option:
    name: str
    target: type  # EngineConfig or ServerConfig
    type: Any  # the field's resolved type hint
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def base_type(self) -> Any:
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        is_union = typing.get_origin(self.type) in (typing.Union, types.UnionType)
        return args[0] if is_union and len(args) == 1 else self.type

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    def parse(self, raw: Any, source: str) -> Any:
        """Convert a raw value (a string from the CLI or env, anything from a file)."""
        if raw is None or (
            self.optional and isinstance(raw, str) and raw.strip().lower() in ("none", "null")
        ):
            if self.optional:
                return None
            raise ConfigError(f"{self.name}: a value is required ({source})")
        kind = self.base_type
        try:
            if kind is bool:
                return _parse_bool(raw)
            if kind in (int, float):
                if isinstance(raw, bool):
                    raise ValueError("not a number")
                value = kind(raw)
                if kind is int and isinstance(raw, float) and raw != value:
                    raise ValueError("not an integer")
                return value
            if kind is str:
                if isinstance(raw, (dict, list)):
                    raise ValueError("expected a string")
                return str(raw)
            if typing.get_origin(kind) is tuple and isinstance(raw, str):
                return raw  # "1,2,4": the config dataclass parses and validates lists
            return json.loads(raw) if isinstance(raw, str) else raw
        except (TypeError, ValueError) as e:
            type_name = getattr(kind, "__name__", str(kind))
            message = f"{self.name}: cannot read {raw!r} as {type_name} ({source}): {e}"
            raise ConfigError(message) from None


def _parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true/false")


def _options_of(cls: type, names: list[str]) -> list[Option]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    result = []
    for name in names:
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f.metadata.get("help") or _HELP.get(name) or f"{cls.__name__}.{name}"
        result.append(Option(name, cls, hints[name], default, text))
    return result


def options() -> list[Option]:
    """Every option: the server's, then the engine's."""
    server = _options_of(ServerConfig, [f.name for f in dataclasses.fields(ServerConfig)])
    return server + _options_of(EngineConfig, EngineConfig.field_names())


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig
    server: ServerConfig
    sources: dict[str, str]  # option -> "cli" | "env MLASERVE_X" | "file PATH" | "default"
    warnings: list[str] = dataclasses.field(default_factory=list)
    # What vLLM flags were taken as (mapped or accepted with no effect), logged at start-up.
    notes: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> list[str]:
        """One `name = value  (source)` line per option, the API key masked."""
        lines = []
        for opt in options():
            value = getattr(self.server if opt.target is ServerConfig else self.engine, opt.name)
            if opt.name == "api_key" and value is not None:
                value = "***"
            lines.append(f"{opt.name} = {value!r}  ({self.sources[opt.name]})")
        return lines


def load_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}  # YAML is a superset of JSON
    except OSError as e:
        raise ConfigError(f"config: cannot read {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {str(path)!r} is not valid YAML/JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {str(path)!r} must hold a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_settings(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Settings:
    """Resolve every option. `cli` holds only the options given on the command line; the
    config file defaults to `$MLASERVE_CONFIG`."""
    cli = dict(cli or {})
    env = dict(env or {})
    config_file = config_file or env.get(CONFIG_ENV) or None
    file_values = load_config_file(config_file) if config_file else {}
    opts = options()
    known = {o.name for o in opts}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"config: unknown options {unknown} in {str(config_file)!r}")
    # Other tools may use the prefix too: unknown variables are reported, not refused.
    warnings = [
        f"ignoring {k}: not an mlaserve option"
        for k in sorted(env)
        if k.startswith(ENV_PREFIX)
        and k != CONFIG_ENV
        and k[len(ENV_PREFIX) :].lower() not in known
    ]

    values: dict[type, dict[str, Any]] = {EngineConfig: {}, ServerConfig: {}}
    sources: dict[str, str] = {}
    for opt in opts:
        if opt.name in cli:
            raw, source = cli[opt.name], "cli"
        elif opt.env in env:
            raw, source = env[opt.env], f"env {opt.env}"
        elif opt.name in file_values:
            raw, source = file_values[opt.name], f"file {config_file}"
        else:
            sources[opt.name] = "default"
            continue
        values[opt.target][opt.name] = opt.parse(raw, source)
        sources[opt.name] = source
    try:
        # vLLM's spellings (dtype half, speculative method deepseek_mtp) from any source.
        engine = EngineConfig(**normalize_engine_values(values[EngineConfig]))
        server = ServerConfig(**values[ServerConfig])
    except ConfigError as e:  # name where the bad value came from
        source = sources.get(str(e).split(":", 1)[0], "default")
        raise ConfigError(f"{e} ({source})") from None
    return Settings(engine=engine, server=server, sources=sources, warnings=warnings)
