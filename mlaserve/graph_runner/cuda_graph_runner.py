"""Uniform forwards (DECODE now; VERIFY / DRAFT_EXTEND with speculation) replayed from CUDA
graphs, one graph per (mode, q_len, captured batch size).

Static inputs are the model runner's preallocated `InputBuffers`: token ids, positions,
`seq_lens`, full-width page-table rows, KV write slots. Every graph is captured against views of
those buffers with `max_seq_len = max_model_len` (the context capacity), so no graph ever reads a
length back from the GPU, and a sequence that grows after capture is still covered.

A step is replayed in the smallest captured size >= its batch size: `InputBuffers.fill` writes
the real rows and pads the rest explicitly (dummy page 0, slot 0), the graph replays, and the
logits of the real rows are returned. EXTEND steps (anything with prompt tokens) replay from
piecewise graphs up to their largest token bucket (`piecewise_graph_runner.py`); longer ones and
batches larger than the largest captured size run eagerly, each counted by reason.

Capture runs largest first into one shared memory pool (later, smaller graphs reuse the larger
ones' blocks; the forwards run one at a time, so sharing is safe). Before capture every shape
runs once eagerly, so every JIT compilation (Triton autotuning, lazily built kernels) happens at
start-up.

With `use_graphs=False` the same path runs eagerly: same padding, same buffers, an eager forward
instead of a replay. That is how the CPU tests prove the buffer and padding logic.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.model_runner import ModelRunner
from mlaserve.graph_runner.piecewise_graph_runner import PiecewiseGraphRunner, PiecewiseReport
from mlaserve.sampling import GreedyRows, greedy_rows

__all__ = ["CaptureReport", "CudaGraphRunner", "TargetOutput"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureReport:
    num_graphs: int
    warmup_s: float
    capture_s: float
    pool_bytes: int  # device memory the decode graphs' shared pool holds after capture
    piecewise: PiecewiseReport | None = None  # EXTEND's piecewise graphs, when on


@dataclass(frozen=True)
class TargetOutput:
    """One target forward. Uniform batches may be padded to a captured size: `logits` and
    `hidden` then hold every padded row (a graph's static outputs: valid until the next replay
    of a graph captured before any reader), and the real rows are the first `num_rows`."""

    logits: torch.Tensor  # [rows, vocab] fp32 (all bs*q_len rows for uniform modes)
    # [tokens, hidden] final-normed, every token row of the batch; [num_rows, hidden], the
    # logits rows', for an EXTEND batch with `logits_hidden_only` (nothing reads the others)
    hidden: torch.Tensor
    batch: ForwardBatch  # the forward's inputs (views of the runner's input buffers)
    num_rows: int  # real logits rows: num_seqs * q_len (uniform) or len(logits_indices)
    graphed: bool  # replayed from a CUDA graph (a draft graph may read `hidden` in place)
    # A DECODE graph's argmax of its logits rows (every padded row), taken inside the graph:
    # the sampler's whole work for an all-greedy batch (`Sampler`); None elsewhere.
    greedy: GreedyRows | None = None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None when replays run eagerly (use_graphs=False)
    logits: torch.Tensor | None  # the graph's static output, [bs * q_len, vocab] fp32
    hidden: torch.Tensor | None = None  # [bs * q_len, hidden]: what a draft model reads
    greedy: GreedyRows | None = None  # DECODE: the argmax of `logits`, in the graph
    # DECODE: the graph starts with the inputs' device-side split (`InputBuffers.split`), so a
    # replay's `fill` only uploads. Not VERIFY: the start-up cost measurement writes a VERIFY
    # graph's input ids in place before replaying it (`spec/step_timer.py`).
    splits_inputs: bool = False


class CudaGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: Sequence[int],
        *,
        use_graphs: bool,
        shapes: Sequence[tuple[ForwardMode, int]] = ((ForwardMode.DECODE, 1),),
        piecewise_max_tokens: int = 0,
    ) -> None:
        """`shapes`: the (uniform mode, q_len) pairs to capture, each at every batch size.
        `piecewise_max_tokens` > 0: EXTEND batches up to that many tokens replay from piecewise
        graphs (`PiecewiseGraphRunner`), eagerly when `use_graphs` is off."""
        if use_graphs and not runner.attn_backend.supports_cuda_graph:
            raise ValueError(f"attention backend {runner.attn_backend.name!r} cannot be graphed")
        if use_graphs and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {runner.device}")
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.use_graphs = use_graphs
        self.shapes = list(shapes)
        self.graphs: dict[tuple[ForwardMode, int, int], _Graph] = {}
        self.pool: tuple | None = None
        self.num_replays = 0
        self.num_eager_steps: Counter[str] = Counter()
        # Off: every step runs eagerly (reason "graphs_off"); benchmarks compare both in one run.
        self.enabled = True
        self.piecewise: PiecewiseGraphRunner | None = None
        if piecewise_max_tokens > 0:
            self.piecewise = PiecewiseGraphRunner(
                runner, piecewise_max_tokens, use_graphs=use_graphs
            )

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1] if self.batch_sizes else 0

    # ----- start-up -----
    def capture(self) -> CaptureReport:
        """Warm up every shape eagerly, then capture, largest batch first."""
        t0 = time.perf_counter()
        for mode, q_len in self.shapes:
            for bs in reversed(self.batch_sizes):
                self.runner.forward_with_hidden(self.dummy_batch(mode, q_len, bs))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        t1 = time.perf_counter()
        # Objects waiting for the collector may hold CUDA resources (pinned buffers, events) of
        # an engine that is gone; freeing them inside a capture would invalidate it.
        gc.collect()
        free_before = self._free_memory()
        for mode, q_len in self.shapes:
            for bs in reversed(self.batch_sizes):
                self.graphs[(mode, q_len, bs)] = self._capture_one(mode, q_len, bs)
        t2 = time.perf_counter()
        pool_bytes = max(free_before - self._free_memory(), 0)
        piecewise = self.piecewise.capture() if self.piecewise is not None else None
        report = CaptureReport(
            num_graphs=len(self.graphs),
            warmup_s=t1 - t0,
            capture_s=t2 - t1,
            pool_bytes=pool_bytes,
            piecewise=piecewise,
        )
        logger.info(
            "CUDA graphs: %d captured (%s at batch sizes %s) in %.2f s after %.2f s of eager "
            "warm-up; graph pool %.1f MiB",
            report.num_graphs,
            ", ".join(f"{m.value} q_len {q}" for m, q in self.shapes),
            self.batch_sizes,
            report.capture_s,
            report.warmup_s,
            report.pool_bytes / 2**20,
        )
        return report

    def dummy_batch(self, mode: ForwardMode, q_len: int, bs: int):
        """A batch of `bs` padding rows: the buffers' contents at capture do not matter (the
        graph re-reads them on replay), they only must be valid, and padding rows are."""
        host = HostBatch(mode, [], [], [], [], [], [], [])
        return self.runner.make_batch(host, pad_to=bs, max_seq_len=self.bound, q_len=q_len)

    @property
    def bound(self) -> int:
        # Speculative windows may run up to num_lookahead_tokens past the context capacity.
        return self.runner.max_model_len + self.runner.num_lookahead_tokens

    def _capture_one(self, mode: ForwardMode, q_len: int, bs: int) -> _Graph:
        if not self.use_graphs:
            return _Graph(graph=None, logits=None)
        batch = self.dummy_batch(mode, q_len, bs)
        graph = torch.cuda.CUDAGraph()
        greedy = None
        decode = mode is ForwardMode.DECODE
        with torch.cuda.graph(graph, pool=self.pool):
            if decode:  # three launches of host time less per step (`input_buffers.py`)
                self.runner.buffers.split(batch)
            logits, hidden = self.runner.forward_with_hidden(batch)
            if decode:
                # A little GPU time every step, greedy batch or not; it saves an
                # all-greedy batch the sampler's launches, the step's largest host cost on a
                # small model (`sampler.py`)
                greedy = greedy_rows(logits)
        if self.pool is None:
            self.pool = graph.pool()
        return _Graph(graph, logits, hidden, greedy, splits_inputs=decode)

    def _free_memory(self) -> int:
        """Device memory not yet reserved by this process's caching allocator (graph pools are
        private pools of that allocator, so their growth shows here at segment granularity)."""
        if self.runner.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.runner.device)
        return -torch.cuda.memory_reserved(self.runner.device)

    # ----- serving -----
    def padded_size(self, host: HostBatch) -> int | None:
        """The captured size this batch replays in, or None if it runs eagerly."""
        if not self.enabled or not host.mode.is_uniform:
            return None
        if (host.mode, host.q_lens[0]) not in self.shapes:
            return None
        i = bisect.bisect_left(self.batch_sizes, host.num_seqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def run(self, host: HostBatch) -> torch.Tensor:
        """Forward one step. Returns the logits of the rows the step samples from:
        [num_seqs * q_len, vocab] for uniform modes, [len(logits_indices), vocab] for EXTEND."""
        out = self.run_with_hidden(host)
        return out.logits[: out.num_rows]

    @torch.inference_mode()
    def run_with_hidden(self, host: HostBatch) -> TargetOutput:
        """`run`, keeping what a draft model reads: the final-normed hidden states of every row
        of the (padded) batch, and the batch itself (views of the input buffers)."""
        size = self.padded_size(host)
        bucket = self.piecewise.bucket_for(host) if self.piecewise and self.enabled else None
        if bucket is not None:
            logits, hidden, batch = self.piecewise.run(host, bucket)
            return TargetOutput(logits, hidden, batch, logits.shape[0], graphed=False)
        if size is None:
            if not host.mode.is_uniform:
                reason = "extend"
            elif not self.batch_sizes or not self.enabled:
                reason = "graphs_off"
            else:
                reason = "batch_too_large"
            self.num_eager_steps[reason] += 1
            batch = self.runner.make_batch(host)
            logits, hidden = self.runner.forward_with_hidden(batch)
            rows = logits.shape[0]
            return TargetOutput(logits, hidden, batch, rows, graphed=False)
        q_len = host.q_lens[0]
        entry = self.graphs.get((host.mode, q_len, size))
        split = entry is None or entry.graph is None or not entry.splits_inputs
        batch = self.runner.make_batch(host, pad_to=size, max_seq_len=self.bound, split=split)
        rows = host.num_seqs * q_len
        if entry is None or entry.graph is None:
            # Not captured (yet), or use_graphs=False: the same padded batch, run eagerly.
            self.num_eager_steps["no_graphs"] += 1
            logits, hidden = self.runner.forward_with_hidden(batch)
            return TargetOutput(logits, hidden, batch, rows, graphed=False)
        entry.graph.replay()
        self.num_replays += 1
        return TargetOutput(entry.logits, entry.hidden, batch, rows, True, entry.greedy)
