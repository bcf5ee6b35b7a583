"""What the operator chooses: the engine's knobs, validated when built.

`EngineConfig` is a frozen dataclass; a bad value raises `ConfigError` naming the field. What
follows from its own fields alone (the speculative settings, the paths, the graph batch sizes)
is derived once in `__post_init__`; the `resolved_*` methods answer against the machine (is CUDA
there?) or the model, so they run where the engine runs, not where the config was built.

torch is imported inside the methods that need it, never at module level: building and validating
a config (`mlaserve serve --help`, a bad option) must not pay for torch's import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlaserve.backend_names import ATTENTION_BACKENDS
from mlaserve.config.error import ConfigError
from mlaserve.config.multi_node import check_multi_node
from mlaserve.config.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from mlaserve.config.model_config import ModelConfig

__all__ = [
    "KV_CACHE_DTYPES",
    "LOAD_FORMATS",
    "MODEL_DTYPES",
    "EngineConfig",
    "default_model_path",
    "resolve_torch_dtype",
]

KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8")
MODEL_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
# "auto": the folder's safetensors; "dummy" (vLLM's name): random weights made on the device from
# config.json alone, for benchmarks at full width without a checkpoint (`model/dummy_weights.py`).
LOAD_FORMATS = ("auto", "dummy")


def default_model_path() -> Path:
    """The small DeepSeek-V3-architecture model shipped inside the package."""
    return Path(__file__).parent.parent / "assets" / "default-model"


def resolve_torch_dtype(name: str) -> torch.dtype:
    import torch

    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ConfigError(f"dtype: unknown dtype {name!r}; expected one of {sorted(table)}")
    return table[name]


@dataclass(frozen=True)
class EngineConfig:
    """What the operator chooses. Every field can also come from the CLI / `MLASERVE_*` env."""

    model: str | None = None  # checkpoint folder; None = the default model shipped in the package
    tokenizer: str | None = None  # defaults to `model`
    # vLLM's flag: run the tokenizer class a checkpoint ships as Python (its tokenizer_config.json
    # `auto_map`), as Kimi-K2's and Moonlight's tiktoken tokenizers are. Off: such a folder is a
    # clear error naming the flag. The model itself is always mlaserve's own code.
    trust_remote_code: bool = False
    load_format: str = "auto"  # one of LOAD_FORMATS
    device: str = "auto"  # "auto" = cuda if available else cpu
    dtype: str = "auto"  # "auto" = the checkpoint's dtype on cuda, float32 on cpu
    kv_cache_dtype: str | None = None  # None = fp8_e4m3 on cuda, "auto" (= dtype) on cpu
    page_size: int = 64
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None = min(model max_position_embeddings, 8192)
    max_num_batched_tokens: int = 2048
    kv_cache_memory_fraction: float = 0.85  # of free GPU memory after the weights are loaded
    # vLLM's meaning: the share of the GPU's total memory for weights + KV cache + graphs. When
    # set, the KV cache gets kv_cache_memory_fraction of (this share - what the weights took).
    gpu_memory_utilization: float | None = None
    num_pages: int | None = None  # explicit KV pool size; overrides the fraction
    attention_backend: str = "auto"
    # CUDA graphs for decode steps: None = on when the device is CUDA.
    cuda_graph: bool | None = None
    # Captured batch sizes; None = 1 2 4 8 12 16 24 32, then steps of 16 up to max_num_seqs.
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    # Piecewise CUDA graphs for EXTEND (prefill) batches: everything but attention replayed per
    # token bucket. None = on with CUDA graphs.
    piecewise_cuda_graph: bool | None = None
    # The largest captured token bucket; None = min(max_num_batched_tokens, 4096).
    piecewise_cuda_graph_max_tokens: int | None = None
    # Overlap scheduling (SGLang's overlap scheduler, vLLM's async scheduling): the next step is
    # scheduled and launched before the previous one's tokens are read back, so the host's
    # per-step work runs while the GPU computes. None = on when the device is CUDA. Steps that
    # need the previous tokens on the host first (speculation, structured output, logprobs)
    # run synchronously either way.
    overlap_schedule: bool | None = None
    seed: int = 0
    served_model_name: str | None = None
    # Speculative decoding, vLLM's shape: {"method": "mtp", "num_speculative_tokens": k}.
    speculative_config: dict | None = field(default=None, hash=False)
    # Shorthand for {"method": "mtp", "num_speculative_tokens": k}.
    num_speculative_tokens: int | None = None
    # Hard cap: decode steps with more requests than this never speculate (the cost policy
    # decides below it).
    speculative_disable_batch_size: int | None = None
    # Tensor parallelism (vLLM's name, CLI -tp): the model sharded over this many processes, one
    # per GPU (cuda:0..N-1; all on the CPU with device "cpu", over gloo), started by the engine;
    # rank 0 is the engine's own process (`engine/tp_workers.py`). N must divide the heads.
    # CUDA graphs, overlap scheduling and MTP speculation run under TP as on one rank: rank 0
    # schedules, samples and accepts; every rank replays the same graphs (`engine/tp_worker.py`).
    tensor_parallel_size: int = 1
    # Batch-invariant ("deterministic") inference, SGLang's --enable-deterministic-inference: a
    # token's logits are bitwise independent of the batch it runs in (other requests, batch
    # size, graph padding, prefill chunking, decode / verify / draft / recompute), through
    # fixed-order kernels (`ops/invariant_*.py`) and the `invariant` attention backend, which it
    # selects; and of the tensor-parallel size (1, 2, 4 or 8: every split sum in one fixed tree,
    # `ops/invariant_rowwise.py`). Slower (README, "Deterministic inference"); no expert
    # parallelism.
    deterministic_inference: bool = False
    # vLLM's --enable-expert-parallel: with tensor_parallel_size N > 1 each rank holds whole
    # routed experts (n_routed_experts / N of them, which must divide) instead of a 1/N slice of
    # every expert; the router, attention and shared experts stay as under TP, and the MoE's
    # all-reduce is the same (model/layers/moe.py). No effect with N = 1.
    enable_expert_parallel: bool = False
    # Tensor parallelism over several nodes (SGLang's names; `config/multi_node.py`): node
    # `node_rank` of `nnodes` runs tensor_parallel_size / nnodes ranks; node 0 also the server.
    # The ranks meet at `dist_init_addr` (node 0's HOST:PORT) within `dist_timeout` seconds.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 300.0
    # One folder for every JIT artefact (Triton, Inductor, flashinfer, CuTe DSL, CUDA's PTX
    # cache): each library's variable is pointed under it unless set (`mlaserve/jit_cache.py`).
    # None: each library's own default.
    cache_dir: str | None = None
    # vLLM's --enable-prefix-caching / --no-enable-prefix-caching: full KV pages of earlier
    # requests are found again by their tokens (a hash chain, `kv_cache/prefix_cache.py`) and
    # not recomputed. On by default, as in vLLM and SGLang (issue 43: cache on == off, token for
    # token, on the CPU and an H200). With speculative decoding the MTP layer's KV is cached too.
    enable_prefix_caching: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ----- derived from the fields above, once, in __post_init__ (not arguments, compared or
    # shown; `dataclasses.replace` builds anew, so they follow) -----
    # The speculative decoding settings, or None when speculation is off.
    speculative: SpeculativeConfig | None = field(init=False, repr=False, compare=False)
    # KV slots past a decode's own token that one speculative step may write (verify writes k
    # more, the draft chain up to k - 1 beyond the accepted ones): 2k; 0 when off.
    num_lookahead_tokens: int = field(init=False, repr=False, compare=False)
    model_path: Path = field(init=False, repr=False, compare=False)
    tokenizer_path: Path = field(init=False, repr=False, compare=False)
    _graph_batch_sizes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ConfigError("cache_dir: must not be empty (leave it unset for the defaults)")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: expected 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format: expected one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype: expected one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size: must be a power of two >= 1, got {self.page_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError(
                f"kv_cache_memory_fraction: must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in ("auto", *ATTENTION_BACKENDS):
            raise ConfigError(
                f"attention_backend: unknown backend {self.attention_backend!r}; expected 'auto' "
                f"or one of {sorted(ATTENTION_BACKENDS)}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"num_pages: must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.cuda_graph_batch_sizes is not None:
            sizes = self.cuda_graph_batch_sizes
            if isinstance(sizes, str):  # "1,2,4" from a flag or an environment variable
                sizes = [s for s in sizes.replace(" ", ",").split(",") if s]
            try:
                sizes = tuple(sorted({int(s) for s in sizes}))
            except (TypeError, ValueError):
                raise ConfigError(
                    f"cuda_graph_batch_sizes: expected integers, got {self.cuda_graph_batch_sizes!r}"
                ) from None
            if not sizes or sizes[0] < 1 or sizes[-1] > self.max_num_seqs:
                raise ConfigError(
                    f"cuda_graph_batch_sizes: need sizes in [1, max_num_seqs={self.max_num_seqs}], "
                    f"got {list(sizes)}"
                )
            object.__setattr__(self, "cuda_graph_batch_sizes", sizes)
        pw = self.piecewise_cuda_graph_max_tokens
        if pw is not None and (
            isinstance(pw, bool)
            or not isinstance(pw, int)
            or not 1 <= pw <= self.max_num_batched_tokens
        ):
            raise ConfigError(
                "piecewise_cuda_graph_max_tokens: need an integer in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {pw!r}"
            )
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"num_speculative_tokens: must be an integer >= 1, got {k!r}")
        cap = self.speculative_disable_batch_size
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(
                f"speculative_disable_batch_size: must be an integer >= 1, got {cap!r}"
            )
        spec = self._parse_speculative()
        self._check_tensor_parallel()
        self._check_deterministic()
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching: expected a bool, got {self.enable_prefix_caching!r}"
            )
        if k is not None and spec is not None and spec.num_speculative_tokens != k:
            raise ConfigError(
                f"num_speculative_tokens: {k} contradicts speculative_config."
                f"num_speculative_tokens {spec.num_speculative_tokens}"
            )
        self._derive(spec)

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {n!r}")
        check_multi_node(self)

    def _check_deterministic(self) -> None:
        if not isinstance(self.deterministic_inference, bool):
            raise ConfigError(
                f"deterministic_inference: expected a bool, got {self.deterministic_inference!r}"
            )
        if not self.deterministic_inference:
            return
        from mlaserve.ops.invariant_rowwise import TREE_LEAVES  # torch: this mode only

        if TREE_LEAVES % self.tensor_parallel_size:
            raise ConfigError(
                f"deterministic_inference: tensor_parallel_size must divide {TREE_LEAVES} (the "
                f"summation tree's leaves: 1, 2, 4 or 8), got {self.tensor_parallel_size}"
            )
        if self.enable_expert_parallel and self.tensor_parallel_size > 1:
            raise ConfigError(
                "deterministic_inference with enable_expert_parallel: whole experts per rank sum "
                "the MoE over the ranks outside the summation tree (use tensor parallelism)"
            )
        if self.attention_backend not in ("auto", "invariant"):
            raise ConfigError(
                f"attention_backend: {self.attention_backend!r} with deterministic_inference: the "
                "mode needs its own 'invariant' backend (leave attention_backend 'auto')"
            )

    def resolved_attention_backend(self) -> str:
        """The backend name to resolve: 'invariant' in the deterministic mode, else the field."""
        return "invariant" if self.deterministic_inference else self.attention_backend

    def _parse_speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            if self.num_speculative_tokens is None:
                return None
            return SpeculativeConfig(num_speculative_tokens=self.num_speculative_tokens)
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.num_speculative_tokens is None and self.num_speculative_tokens is not None:
            spec = dataclasses.replace(spec, num_speculative_tokens=self.num_speculative_tokens)
        return spec

    def _derive(self, spec: SpeculativeConfig | None) -> None:
        """Sets the non-init fields (frozen, hence `object.__setattr__`)."""
        model_path = Path(self.model) if self.model else default_model_path()
        sizes = self.cuda_graph_batch_sizes
        if sizes is None:
            n = self.max_num_seqs
            default = {1, 2, 4, 8, 12, 16, 24, 32, *range(48, n + 1, 16)}
            sizes = tuple(sorted(s for s in default | {n} if s <= n))
        for name, value in (
            ("speculative", spec),
            ("num_lookahead_tokens", 0 if spec is None else 2 * spec.k),
            ("model_path", model_path),
            ("tokenizer_path", Path(self.tokenizer) if self.tokenizer else model_path),
            ("_graph_batch_sizes", sizes),
        ):
            object.__setattr__(self, name, value)

    @classmethod
    def field_names(cls) -> list[str]:
        """The settable fields (what the CLI, the environment and `LLM(**kwargs)` may name)."""
        return [f.name for f in dataclasses.fields(cls) if f.init and f.name != "extra"]

    def resolved_cuda_graph_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes to capture, ascending (capture itself goes largest first); as given, else
        1 2 4 8 12 16 24 32, then steps of 16 up to max_num_seqs."""
        return self._graph_batch_sizes

    # ----- resolution against the machine (asked where the engine runs) and the model -----
    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' was asked for but no CUDA device is available")
        return dev

    def resolved_cuda_graph(self) -> bool:
        """CUDA graphs for decode: as asked, else on with CUDA (under tensor parallelism too:
        every rank captures the same graphs, the collectives inside them)."""
        device = self.resolved_device()
        if self.cuda_graph and device.type != "cuda":
            raise ConfigError(f"cuda_graph: CUDA graphs need a CUDA device, got {device}")
        return device.type == "cuda" if self.cuda_graph is None else self.cuda_graph

    def resolved_piecewise_cuda_graph_max_tokens(self) -> int:
        """The largest token bucket of EXTEND's piecewise CUDA graphs; 0 when they are off
        (asked off, or CUDA graphs off). Above 4096 tokens a prefill's GPU work already hides
        its host work, so the default stops there."""
        graphs = self.resolved_cuda_graph()
        if self.piecewise_cuda_graph and not graphs:
            raise ConfigError("piecewise_cuda_graph: needs CUDA graphs (cuda_graph is off)")
        if not (graphs if self.piecewise_cuda_graph is None else self.piecewise_cuda_graph):
            return 0
        if self.piecewise_cuda_graph_max_tokens is not None:
            return self.piecewise_cuda_graph_max_tokens
        return min(self.max_num_batched_tokens, 4096)

    def resolved_overlap_schedule(self) -> bool:
        """Overlap scheduling: as asked, else on with CUDA. With speculation it applies to the
        plain steps the policy chooses (no draft work) only: a speculative step reads the
        accepted tokens back before the next one can be scheduled. Under tensor parallelism
        rank 0's loop keeps its rules (at most one step in flight, `engine/overlap.py`); the
        workers run each step as it comes, reading the sampled ids rank 0 broadcasts on the
        device as their next step's future ids."""
        if self.overlap_schedule is None:
            return self.resolved_device().type == "cuda"
        return self.overlap_schedule

    def resolved_dtype(self, model_config: ModelConfig) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return resolve_torch_dtype(self.dtype)
        if self.resolved_device().type == "cpu":
            return torch.float32
        name = model_config.torch_dtype
        if model_config.quantization is not None and name not in MODEL_DTYPES:
            name = "bfloat16"  # e.g. "float8_e4m3fn": FP8 block checkpoints compute in bf16
        dtype = resolve_torch_dtype(name)
        return torch.bfloat16 if dtype == torch.float32 else dtype

    def resolved_kv_cache_dtype(self, model_config: ModelConfig) -> torch.dtype:
        import torch

        kind = self.kv_cache_dtype
        if kind is None:
            kind = "fp8_e4m3" if self.resolved_device().type == "cuda" else "auto"
        if kind in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        if kind in ("bf16", "bfloat16"):
            return torch.bfloat16
        return self.resolved_dtype(model_config)

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return min(limit, 8192)
        if self.max_model_len > limit and model_config.rope_scaling is None:
            raise ConfigError(
                f"max_model_len: {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        return self.max_model_len

    def resolved_tensor_parallel_size(self, model_config: ModelConfig) -> int:
        """N, checked against the model (N divides the attention heads) and the machine (on
        CUDA, N / nnodes GPUs visible)."""
        n, heads = self.tensor_parallel_size, model_config.num_attention_heads
        if heads % n:
            raise ConfigError(
                f"tensor_parallel_size: {n} does not divide the model's {heads} attention heads "
                f"(each rank holds heads / N of them; try a divisor of {heads})"
            )
        experts = model_config.n_routed_experts or 0
        if self.enable_expert_parallel and n > 1 and experts % n:
            raise ConfigError(
                f"enable_expert_parallel: tensor_parallel_size {n} does not divide the model's "
                f"{experts} routed experts (each rank holds whole experts, {experts} / N of them)"
            )
        if n > 1 and self.resolved_device().type == "cuda":
            import torch

            visible, local = torch.cuda.device_count(), n // self.nnodes
            if local > visible:
                per_node = f" on each of {self.nnodes} nodes" if self.nnodes > 1 else ""
                raise ConfigError(
                    f"tensor_parallel_size: {n} needs {local} GPUs (one per rank){per_node}, but "
                    f"only {visible} are visible (CUDA_VISIBLE_DEVICES)"
                )
            if self.device not in ("auto", "cuda", "cuda:0"):
                raise ConfigError(
                    f"device: tensor_parallel_size {n} places rank r on cuda:r; rank 0 must be "
                    f"on cuda:0, got {self.device!r}"
                )
        return n

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
