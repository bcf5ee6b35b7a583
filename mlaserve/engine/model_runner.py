"""Owns the model, the KV pool, the attention backend and the input buffers; runs one forward.

A step is `build_host_batch` (the scheduler's decision, with its forward mode, as host lists),
`make_batch` (host lists -> the preallocated buffers, padded to a captured size when a CUDA graph
replays it), `forward` (eager; the graph runner captures exactly this) and `sample` (the next
token of every request whose chunk reached its last known token). The only device->host
transfer per step is the sampled tokens (and their logprobs when asked for), which the engine
needs to detokenize and stop; a step that scores prompt tokens for prompt logprobs (only when a
request asked) reads those back too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from mlaserve import switches, triton_key
from mlaserve.config import ConfigError, EngineConfig, ModelConfig
from mlaserve.engine.forward_batch import ForwardBatch
from mlaserve.engine.forward_route import ForwardRoute
from mlaserve.engine.grammar import GrammarBackend
from mlaserve.engine.input_buffers import HostBatch, InputBuffers
from mlaserve.engine.kv_budget import agree_min, decide_num_pages, free_device_memory
from mlaserve.engine.overlap import OverlapError, StepFence
from mlaserve.engine.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs, plan_spans
from mlaserve.engine.read_back import PendingSample, ReadBack, ReadBackRows, StepResult
from mlaserve.engine.request import Request
from mlaserve.engine.scheduler import SchedulerOutput
from mlaserve.engine.step_broadcast import StepSender
from mlaserve.engine.token_rows import TokenRows
from mlaserve.kernel_compile_pool import (
    KernelCompilePool,
    compile_processes_wanted,
    stop_compile_server,
)
from mlaserve.kernels_adapter import get_backend_class, resolve_backend_name
from mlaserve.kv_cache import MLAKVPool
from mlaserve.model import load_kv_scales, load_model
from mlaserve.model.checkpoint_tensor import log_rank_reads
from mlaserve.model.kernel_warm_up import KernelWarmUp
from mlaserve.sampling import GreedyRows, Sampler, SamplerOutput, SamplingBatch, SamplingSlots
from mlaserve.sampling.argmax_kernel import argmax_available, fused_argmax
from mlaserve.sampling.noise_kernel import fused_noise_available, gumbel_argmax_warm_up_tasks
from mlaserve.startup_times import StartupTimes
from mlaserve.tensor_parallel import NO_TP, TensorParallel

# PendingSample, ReadBack and StepResult live in engine/read_back.py (named here as before).
__all__ = ["ModelRunner", "PendingSample", "ReadBack", "StepResult"]

logger = logging.getLogger(__name__)

# The throwaway request's prompt length (`engine_warmup.warm_up`): the first token count the
# background kernel warm-up compiles the decoder layers at.
WARM_UP_PROMPT_LEN = 16


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        eos_token_ids: Sequence[int] = (),
        *,
        tp: TensorParallel = NO_TP,
        control_group: object = None,
        startup: StartupTimes | None = None,
    ) -> None:
        """`tp`: this process's rank of the tensor-parallel group (`engine/tp_workers.py`);
        `control_group`: that group's gloo side, where the ranks agree on the KV pool's size;
        `startup`: gets the loader's phases and kv_pool (all that follows the weights)."""
        self.config = config
        # `--enable-expert-parallel`: the MoE layers place whole experts per rank of this group.
        tp = dataclasses.replace(tp, expert_parallel=config.enable_expert_parallel)
        self.tp = tp
        # Rank 0 under TP > 1: each target forward's batch (`make_batch` with a route), and the
        # draft's and the capture's messages, go to the other ranks (`engine/step_broadcast.py`).
        self.step_sender: StepSender | None = None
        # Steps whose feed the workers took from their own graph's greedy rows / broadcast
        # (`feed_workers`): what the GPU tests read to know which path ran.
        self.num_greedy_feeds = 0
        self.num_broadcast_feeds = 0
        self.model_config = model_config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(model_config)
        self.kv_cache_dtype = config.resolved_kv_cache_dtype(model_config)
        self.max_model_len = config.resolved_max_model_len(model_config)
        self.page_size = config.page_size
        # Speculation writes KV up to `num_lookahead_tokens` past a decode's own token, so page
        # tables are that much wider than max_model_len needs.
        self.spec = config.speculative
        # The MTP draft reads the target's final hidden states of every prompt row; without
        # one, an EXTEND step's readers want its logits rows' alone (`ForwardBatch`).
        self.draft_reads_hidden = self.spec is not None
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.max_pages_per_seq = -(
            -(self.max_model_len + self.num_lookahead_tokens) // self.page_size
        )

        # The widest uniform step: a VERIFY / DRAFT_EXTEND of k+1 tokens per sequence.
        self.max_q_len = 1 if self.spec is None else self.spec.k + 1
        # The heads this rank attends (MLA's heads are split across tensor-parallel ranks).
        num_heads = model_config.num_attention_heads // tp.size
        # Chosen for q_len 1: a k past the chosen backend is the ConfigError below, naming k.
        backend_name = resolve_backend_name(
            config.resolved_attention_backend(), model_config, self.page_size,
            self.kv_cache_dtype, self.device, num_heads=num_heads,
        )  # fmt: skip
        backend_cls = get_backend_class(backend_name)
        if self.max_q_len > backend_cls.max_uniform_q_len:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens: {self.spec.k} + 1 exceeds attention "
                f"backend {backend_name!r}'s max_uniform_q_len {backend_cls.max_uniform_q_len}"
            )

        if self.device.type == "cuda":
            triton_key.start()  # hashed beside the load; the kernel warm-up waits for it
        # This process's device memory before its weights: what it allocates outside torch's
        # allocator (NCCL's buffers) counts against --gpu-memory-utilization too.
        free_at_start = free_device_memory(self.device)
        # One GPU: the kernel warm-up (decode kernels, decoder layers, the backend's) runs on
        # threads in the background from the KV pool's allocation until the first capture joins
        # it (`join_kernel_warm_up`). Under TP the loader runs the decode kernels' in order (the
        # MoE's warm-up forward all-reduces, in every rank's order).
        background_warm_up = (
            tp.size == 1 and self.device.type == "cuda" and switches.background_warm_up()
        )
        self.kernel_warm_up: KernelWarmUp | None = None
        self.process_compiles = 0  # Triton kernels the compile pool's workers compiled
        self._startup = startup
        logger.info(
            "loading weights from %s (%s on %s, load format %s)",
            config.model_path, self.dtype, self.device, config.load_format,
        )  # fmt: skip
        self.model = load_model(
            model_config,
            config.model_path,
            dtype=self.dtype,
            device=self.device,
            load_format=config.load_format,
            seed=config.seed,
            tp=tp,
            deterministic=config.deterministic_inference,
            startup=startup,
            warm_up_kernels=not background_warm_up,
        )
        loaded = time.perf_counter()

        if tp.size > 1:
            log_rank_reads(self.model.checkpoint_reads, tp, control_group)
        # With speculation the MTP layer(s) cache latents under layer ids N.. of the same pool.
        self.num_kv_layers = model_config.num_hidden_layers
        if self.spec is not None:
            if self.model.mtp is None:
                raise ConfigError(
                    f"speculative_config: method 'mtp' needs MTP weights (model.layers."
                    f"{model_config.num_hidden_layers}.*), and {config.model_path} has none"
                )
            self.num_kv_layers += model_config.num_nextn_predict_layers
        if tp.size > 1 and self.device.type == "cuda":
            # NCCL makes its communicator and buffers at the first collective: make them now, so
            # that the KV pool is sized from what is left after them.
            tp.all_reduce(torch.zeros(1, device=self.device))
        self.num_pages = decide_num_pages(
            config, model_config, device=self.device, num_kv_layers=self.num_kv_layers,
            page_size=self.page_size, kv_cache_dtype=self.kv_cache_dtype,
            max_pages_per_seq=self.max_pages_per_seq, free_at_start=free_at_start,
        )  # fmt: skip
        if tp.size > 1:  # every rank's pool holds the same pages: the smallest budget wins
            self.num_pages = agree_min(self.num_pages, control_group)
        # Dummy weights have no checkpoint to carry KV scales: an FP8 cache scales by 1.0.
        dummy = config.load_format == "dummy"
        k_scales = None if dummy else load_kv_scales(model_config, config.model_path)
        if k_scales is not None and self.kv_cache_dtype != torch.float8_e4m3fn:
            logger.warning(
                "checkpoint has KV-cache scales, unused with a %s cache", self.kv_cache_dtype
            )
        if k_scales is not None and len(k_scales) < self.num_kv_layers:
            k_scales = [*k_scales, *[1.0] * (self.num_kv_layers - len(k_scales))]
        self.kv_pool = MLAKVPool(
            num_layers=self.num_kv_layers,
            num_pages=self.num_pages,
            page_size=self.page_size,
            kv_lora_rank=model_config.kv_lora_rank,
            qk_rope_head_dim=model_config.qk_rope_head_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
            k_scale=k_scales or 1.0,
        )
        self.attn_backend = backend_cls(
            model_config,
            num_heads=num_heads,
            page_size=self.page_size,
            kv_cache_dtype=self.kv_cache_dtype,
            device=self.device,
            max_num_seqs=config.max_num_seqs,
            # Verify and draft forwards may write up to the lookahead past the context capacity.
            max_model_len=self.max_model_len + self.num_lookahead_tokens,
            max_q_len=self.max_q_len,
        )
        self.buffers = InputBuffers(
            max_num_seqs=config.max_num_seqs,
            # A verify step carries k+1 tokens per decoding sequence, beyond the token budget.
            max_num_tokens=max(
                config.max_num_batched_tokens,
                config.max_num_seqs * (self.spec.k + 1 if self.spec is not None else 1),
            ),
            max_pages_per_seq=self.max_pages_per_seq,
            device=self.device,
            num_pages=self.num_pages,
        )
        self.sampler = Sampler()
        self.sampling_slots = SamplingSlots(
            config.max_num_seqs, model_config.vocab_size, self.device, eos_token_ids
        )
        # The step's one device->host transfer: sampled ids into pinned memory, then one wait
        # (overlap rule 3, `engine/overlap.py`); room for several values per row (ids, flags,
        # k+1 tokens).
        self.read_backs = ReadBackRows(config.max_num_seqs * 32, self.device)
        if not background_warm_up:  # in order, here (else on the threads below); under TP
            # too, where the sampler's kernels otherwise compiled at the first sampled requests
            for task in self._attention_warm_up_tasks() + self._sampling_warm_up_tasks():
                task()
        if startup is not None:
            startup.add("kv_pool", time.perf_counter() - loaded)
        if background_warm_up:
            # An empty cache (a cold host, `mlaserve precompile`): the tasks' kernels compile on
            # worker processes first (`kernel_compile_pool.py`).
            pool = None
            if compile_processes_wanted(self.device.type, tp.size):
                pool = KernelCompilePool()
            else:
                stop_compile_server()  # one the engine process started early for nothing
            self.kernel_warm_up = KernelWarmUp.start(self._first_warm_up_tasks(), self.device, pool)
        logger.info(
            "KV cache: %d pages x %d tokens, %s, backend=%s",
            self.num_pages,
            self.page_size,
            self.kv_cache_dtype,
            backend_name,
        )

    def _first_warm_up_tasks(self) -> list[Callable[[], None]]:
        """The background warm-up's tasks known here: the attention backend's and the KV
        pool's, greedy sampling's argmax and sampled requests' draw, the decoder layers at
        WARM_UP_PROMPT_LEN tokens first (the kernels every token count shares: a later task at
        another count finds them compiled instead of compiling them again beside it), then the
        decode kernels' variants."""
        tasks = self._attention_warm_up_tasks() + self._sampling_warm_up_tasks()
        tasks += self.model.layer_warm_up_tasks([WARM_UP_PROMPT_LEN])
        return tasks + self.model.kernel_warm_up_tasks()

    def _sampling_warm_up_tasks(self) -> list[Callable[[], None]]:
        """Greedy sampling's argmax and sampled requests' draw (and the noise of speculation's
        rejection sampling), at this model's vocabulary: no collective, one rank's."""
        tasks: list[Callable[[], None]] = []
        if argmax_available(self.device):
            logits = (1, self.model_config.vocab_size)
            tasks.append(lambda: fused_argmax(torch.zeros(logits, device=self.device)))
        if fused_noise_available(self.device):  # sampled requests' draw
            tasks += gumbel_argmax_warm_up_tasks(self.model_config.vocab_size, self.device)
        return tasks

    def _attention_warm_up_tasks(self) -> list[Callable[[], None]]:
        """The attention backend's kernels and the KV pool's write, for this model's dtype."""
        return self.attn_backend.warm_up_tasks(self.dtype) + self.kv_pool.warm_up_tasks(self.dtype)

    def extend_kernel_warm_up(self, token_counts: Sequence[int]) -> None:
        """Queue the decoder layers' warm-up at `token_counts` too (the engine's: its captured
        batch sizes and prefill buckets), where the background warm-up runs (one GPU)."""
        if self.kernel_warm_up is not None:
            counts = sorted(set(token_counts) - {WARM_UP_PROMPT_LEN})
            self.kernel_warm_up.add(self.model.layer_warm_up_tasks(counts))

    def wait_kernel_compiles(self) -> None:
        """Before start-up's own forwards: wait for the kernel compiles queued on worker
        processes (none without a compile pool), which those forwards would otherwise repeat
        on this thread. The wait is part of start-up's `kernel_warmup` phase."""
        warm_up = self.kernel_warm_up
        if warm_up is None or warm_up.compile_pool is None:
            return
        waited = warm_up.wait_compiled()
        if self._startup is not None:
            self._startup.add("kernel_warmup", waited)
        pool = warm_up.compile_pool
        logger.info(
            "kernel compiles on %d processes: %d variants (%d compiled, %d failed); waited %.2f s",
            pool.workers, pool.num_variants, pool.num_compiled(), len(pool.failures()), waited,
        )  # fmt: skip
        for variant, error in pool.failures()[:3]:
            logger.warning(
                "compile of %s.%s on a worker failed: %s", variant.module, variant.name, error
            )

    def join_kernel_warm_up(self) -> float:
        """Wait for the background kernel warm-up (`model/kernel_warm_up.py`) and re-raise its
        first failure; the seconds waited (0 once joined, or with none). Every CUDA graph
        capture calls it first: no other thread may launch while one records. The wait is
        start-up's `kernel_warmup` phase."""
        warm_up, self.kernel_warm_up = self.kernel_warm_up, None
        if warm_up is None:
            return 0.0
        t0 = time.perf_counter()
        warm_up.join()
        if warm_up.compile_pool is not None:
            self.process_compiles = warm_up.compile_pool.num_compiled()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        waited = time.perf_counter() - t0
        if self._startup is not None:
            self._startup.add("kernel_warmup", waited)
        logger.info(
            "kernel warm-up: %d tasks on %d threads in %.2f s, beside start-up; waited %.2f s",
            warm_up.num_tasks, warm_up.workers, warm_up.busy_s, waited,
        )  # fmt: skip
        return waited

    # ----- one step -----
    def build_host_batch(
        self,
        sched: SchedulerOutput,
        future_ids: torch.Tensor | None = None,
        future_step: int | None = None,
    ) -> HostBatch:
        """The scheduler's decision as host rows; the forward mode is the scheduler's.
        `future_ids`: the previous step's sampled tokens on the device (`PendingSample.feed`),
        read by the rows of requests whose last token is still pending there; `future_step`:
        that step's id, which every pending row must name (overlap rule 4)."""
        ps = self.page_size
        tokens = TokenRows()
        seq_lens: list[int] = []
        q_lens: list[int] = []
        tables: list[list[int]] = []
        rows: list[int] = []
        logits_indices: list[int] = []
        future: list[tuple[int, int]] = []  # (row, its token's row in the previous step)
        for s in sched.scheduled:
            r, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            end = start + n
            if n == 1:  # a decode: one token, no ranges to build
                if r.num_pending_tokens and start == r.num_tokens - 1:
                    # Overlap scheduling: the token is still on the device; `fill` reads it there.
                    if future_ids is None or r.pending_step != future_step:
                        raise OverlapError(
                            f"request {r.request_id}: its pending token was sampled by step "
                            f"{r.pending_step}, but the step in flight is {future_step} "
                            "(overlap rule 4)"
                        )
                    future.append((tokens.count, r.pending_row))
                    token = -1 - r.pending_row
                else:
                    token = r.token_at(start)
                tokens.add_one(token, start, r.pages[start // ps] * ps + start % ps)
            else:
                tokens.add_range(r.tokens(start, end), start, r.pages, ps)
            seq_lens.append(end)
            q_lens.append(n)
            tables.append(r.pages)
            rows.append(r.slot)
            if s.samples:
                logits_indices.append(tokens.count - 1)
        ids, positions, slot_mapping = tokens.rows()
        host = HostBatch(
            sched.mode, ids, positions, slot_mapping, seq_lens, q_lens, tables, logits_indices,
            table_rows=rows,
            logits_hidden_only=not sched.mode.is_uniform and not self.draft_reads_hidden,
            scheduled=sched.scheduled,
        )  # fmt: skip
        if future:
            steady = all(row == j == i for i, (row, j) in enumerate(future))
            top = len(future) - 1 if steady else max(j for _, j in future)
            if top >= future_ids.shape[0]:
                row = next(row for row, j in future if j == top)
                raise OverlapError(
                    f"request {host.owner_of(row)}: pending row {top} is outside the "
                    f"{future_ids.shape[0]} tokens of step {future_step} (overlap rule 4)"
                )
            host.future_ids = future_ids
            host.future_identity = len(future) if steady else 0
        if not sched.mode.is_uniform and any(
            s.request.prompt_logprobs is not None for s in sched.scheduled
        ):
            host.prompt_spans = plan_spans(sched)
            for span in host.prompt_spans:
                first = span.first_row
                host.logits_indices.extend(range(first, first + len(span.targets)))
        return host

    def make_batch(
        self,
        host: HostBatch,
        pad_to: int | None = None,
        max_seq_len: int | None = None,
        q_len: int | None = None,
        split: bool = True,
        pad_tokens_to: int | None = None,
        *,
        route: ForwardRoute | None = None,
        feed: int = 0,
        greedy_feed: bool = False,
    ) -> ForwardBatch:
        """`max_seq_len`: the bound on seq_lens the backend may use; eager steps pass the exact
        host-side maximum, a CUDA graph its fixed capture bound (max_model_len). `pad_to`: the
        captured batch size a uniform batch replays in (`q_len` states its width when the host
        batch is padding alone). `split=False`: for a graph that replays the inputs' device-side
        split itself (`InputBuffers.split`), over `pad_tokens_to` token rows if given.
        `route`: given for a target forward (the graph runner's): under TP, rank 0 sends the
        batch with it, `feed` (the ids the next step may read) and `greedy_feed` (whether they
        are the graph's own greedy rows rather than `feed_workers`' broadcast) to the workers."""
        max_seq_len = max_seq_len or max(host.seq_lens)
        batch = self.buffers.fill(
            host,
            pad_to=pad_to,
            q_len=q_len,
            split=split,
            pad_tokens_to=pad_tokens_to,
            max_seq_len=max_seq_len,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        # Under TP, rank 0 sends the batch once its own staging accepted it (a batch refused
        # here never reaches the workers); the forward that follows meets theirs.
        if self.step_sender is not None and route is not None:
            self.step_sender.send_step(host, route, feed, greedy_feed)
        return batch

    def takes_graph_greedy(self, sched: SchedulerOutput, grammar: GrammarBackend | None) -> bool:
        """Whether `sample_async` takes a DECODE graph's greedy rows as this step's tokens, as
        they are: every sampled request greedy with nothing adjusting its logits (no penalty,
        no min_tokens ban, no grammar). Decided from the requests alone, before the forward
        (its STEP message says where the workers' feed comes from); `feed_workers` checks it.
        False without workers (one rank: nobody to feed, so nothing to decide)."""
        if self.step_sender is None:
            return False
        sampled = sched.sampled_requests
        if _grammar_masks(grammar, sampled):
            return False
        return all(self.sampling_slots.keeps_logits_greedy(r.params) for r in sampled)

    def feed_workers(
        self, ids: torch.Tensor | None, n: int, greedy: GreedyRows | None = None
    ) -> None:
        """Rank 0 under TP: the `n` sampled ids [n] int64 on the device, broadcast on the model
        group to the workers (the `feed` its STEP message announced); nothing else. `greedy`:
        the STEP said greedy_feed, so the workers read these rows of their own graph and
        nothing is sent; `ids` must then be those very rows (else the ranks' next inputs
        would differ: an engine bug, raised)."""
        if self.step_sender is None or n == 0:
            return
        if ids is None or ids.shape != (n,) or ids.dtype != torch.int64:
            raise ValueError(f"feed_workers: expected [{n}] int64 ids, got {ids!r}")
        if greedy is not None:
            if ids.data_ptr() != greedy.token_ids.data_ptr():
                raise OverlapError(
                    "feed_workers: the STEP told the workers to read the graph's greedy rows, "
                    "but the sampler chose other tokens (ModelRunner.takes_graph_greedy is wrong)"
                )
            self.num_greedy_feeds += 1
            return
        self.tp.broadcast(ids.contiguous(), src=0)
        self.num_broadcast_feeds += 1

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states -> logits of the rows in batch.logits_indices. [num_logits, vocab] fp32.
        Uniform batches may be captured into a CUDA graph as they are (no host reads)."""
        return self.forward_with_hidden(batch)[0]

    @torch.inference_mode()
    def forward_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [num_logits, vocab] fp32, final-normed hidden states of every token row
        [num_tokens, hidden] in the model dtype; of the logits rows alone, [num_logits, hidden],
        when `batch.logits_hidden_only`). The draft model reads the latter."""
        if batch.mode.is_uniform and batch.q_len > self.attn_backend.max_uniform_q_len:
            raise ValueError(
                f"{batch.mode.value} batch with q_len {batch.q_len}: attention backend "
                f"{self.attn_backend.name!r} takes at most {self.attn_backend.max_uniform_q_len}"
            )
        self.attn_backend.prepare(batch)
        hidden = self.model(batch)
        if not batch.logits_hidden_only:
            return self.model.compute_logits(hidden[batch.logits_indices]), hidden
        return self.model.compute_logits(hidden), hidden  # the rows are the logits rows

    def prompt_logprobs(self, logits: torch.Tensor, host: HostBatch) -> list[PromptLogprobs]:
        """Prompt logprobs of the step's prompt spans, from the rows after the sampling rows."""
        num_prompt_rows = sum(len(span.targets) for span in host.prompt_spans)
        first = len(host.logits_indices) - num_prompt_rows
        return compute_prompt_logprobs(logits[first:], host.prompt_spans)

    def read_back(self, values: torch.Tensor) -> list:
        """One pinned non-blocking copy and one wait on its event: the accounted sync.
        values: int64 [n] or [r, n] (several per-row results read back together; a
        speculative step packs its tokens, accept lengths, flags and next drafts in it)."""
        return self.start_read_back(values).wait()

    def start_read_back(self, values: torch.Tensor) -> ReadBack:
        """Start the copy of `values` into pinned memory; `.wait()` later returns them as
        lists. Two pinned rows are used in turn, so one read back may still be pending while
        the next step starts its own (overlap scheduling)."""
        return self.read_backs.start(values)

    @property
    def num_host_waits(self) -> int:
        """How often a step waited on the device (tests count it)."""
        return self.read_backs.num_host_waits

    def fence(self) -> StepFence:
        """A fence after the work queued so far: what the host waits on for a step that reads
        nothing back (overlap rule 1)."""
        return StepFence.record(self.device)

    def admit(self, sched: SchedulerOutput) -> None:
        """Write the per-slot sampling state of the requests admitted this step."""
        for r in sched.admitted:
            self.sampling_slots.admit(
                r.slot, r.params, r.seed, r.prompt_token_ids, r.output_token_ids
            )

    def sample(
        self,
        logits: torch.Tensor,
        sched: SchedulerOutput,
        grammar: GrammarBackend | None = None,
        greedy: GreedyRows | None = None,
    ) -> StepResult:
        """`sample_async`, then its result (the step's one host sync)."""
        return self.sample_async(logits, sched, grammar, greedy).result()

    @torch.inference_mode()
    def sample_async(
        self,
        logits: torch.Tensor,
        sched: SchedulerOutput,
        grammar: GrammarBackend | None = None,
        greedy: GreedyRows | None = None,
    ) -> PendingSample:
        """One token per request that reached its last known token (rows of `logits`, in
        scheduling order). Per-request sampling state lives in device slots, written once when
        the scheduler admits a request; a step uploads only slot indices and steps. Returns
        before the tokens reach the host: `.result()` waits for them, and `.feed` is what a
        next forward may read on the device meanwhile (overlap scheduling). `greedy`: the
        graph's argmax of the logits rows (`TargetOutput.greedy`), from row 0."""
        self.admit(sched)
        sampling = sched.sampled_requests
        if not sampling:  # nothing to read back: the host waits on a fence instead (rule 1)
            return PendingSample(None, None, self.fence())
        mask = None
        if _grammar_masks(grammar, sampling):
            matchers = [r.grammar for r in sampling]  # structured output

            def mask(x: torch.Tensor) -> None:
                grammar.apply(x, matchers)

        n = len(sampling)
        greedy = greedy.head(n) if greedy is not None else None
        # prompt-logprob rows come after the sampling rows
        _, out = self.sample_requests(logits[:n], sampling, mask, greedy)
        # The sampled ids, -1 on rows whose logits were not finite (one device op and one [n]
        # copy carry both; the graph made them when its argmax was taken). A next forward
        # reads the sampler's ids themselves: argmaxes, so in the vocabulary even on a
        # non-finite row (whose request then ends with its error).
        if greedy is not None and out.token_ids is greedy.token_ids:
            ids = greedy.read
        else:
            ids = torch.where(out.finite, out.token_ids, -1)
        return PendingSample(self.start_read_back(ids), out)

    def sample_requests(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        mask: Callable[[torch.Tensor], None] | None = None,
        greedy: GreedyRows | None = None,
    ) -> tuple[SamplingBatch, SamplerOutput]:
        """One token per request from its row of `logits` [n, V] (row i: requests[i]), counted
        in the slots' output counts on the device. -> (the step's sampling batch, the sampler's
        output). The batch's staging copy records its row fence itself (overlap rule 2)."""
        slots = self.sampling_slots
        sb = slots.batch([r.slot for r in requests], [r.num_output_tokens for r in requests])
        out = self.sampler(logits, sb, mask, greedy)
        slots.record(sb.slots, out.token_ids)
        return sb, out


def _grammar_masks(grammar: GrammarBackend | None, requests: Sequence[Request]) -> bool:
    """Whether the sampler masks these requests' logits by their grammars (structured output)."""
    return grammar is not None and any(r.grammar is not None for r in requests)
