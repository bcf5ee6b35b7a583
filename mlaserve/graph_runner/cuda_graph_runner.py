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

from mlaserve.config import EngineConfig
from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.engine.forward_route import EAGER, ForwardRoute, RoutePath
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.model_runner import ModelRunner
from mlaserve.engine.step_broadcast import CaptureMsg, GraphsMsg
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
    kernel_warm_up_wait_s: float = 0.0  # waited for the background kernel warm-up, before capture


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
    # Under TP: the forward's STEP told the workers that `greedy`'s rows are the feed (no
    # broadcast follows; `ModelRunner.feed_workers`).
    greedy_feed: bool = False


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
        self.shapes = [(mode, q) for mode, q in shapes]
        # Under TP rank 0 decides the graphs: every worker builds this same runner
        # (`engine/tp_worker.py`), which the capture plan then checks (`capture`).
        if runner.step_sender is not None:
            runner.step_sender.send(
                GraphsMsg(tuple(self.batch_sizes), tuple(self.shapes), use_graphs,
                          piecewise_max_tokens)
            )  # fmt: skip
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

    @classmethod
    def for_engine(cls, runner: ModelRunner, config: EngineConfig) -> CudaGraphRunner:
        """The engine's graph runner for `config` (under TP, rank 0's; the workers build its
        twin from the message the constructor sends):
        DECODE at q_len 1, and with speculation VERIFY at k+1, at the configured batch sizes
        when graphs are on; the piecewise prefill buckets when those are."""
        use_graphs = config.resolved_cuda_graph()
        # With speculation a decode step is a VERIFY of k+1 tokens per request, or a plain
        # DECODE when the policy says speculation does not pay; both graphed.
        shapes = [(ForwardMode.DECODE, 1)]
        if config.speculative is not None:
            shapes.append((ForwardMode.VERIFY, config.speculative.k + 1))
        return cls(
            runner,
            config.resolved_cuda_graph_batch_sizes() if use_graphs else (),
            use_graphs=use_graphs,
            shapes=shapes,
            piecewise_max_tokens=config.resolved_piecewise_cuda_graph_max_tokens(),
        )

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1] if self.batch_sizes else 0

    # ----- start-up -----
    def capture_plan(self) -> CaptureMsg:
        """What `capture` captures, in this order: every shape at every batch size (largest
        first), then the piecewise buckets (largest first)."""
        buckets = self.piecewise.buckets if self.piecewise is not None else ()
        return CaptureMsg(tuple(self.batch_sizes), tuple(self.shapes), tuple(buckets))

    def token_counts(self) -> tuple[int, ...]:
        """The token counts the captured forwards take: every shape's rows at every batch size,
        and the piecewise buckets."""
        counts = {bs * q_len for _, q_len in self.shapes for bs in self.batch_sizes}
        counts.update(self.piecewise.buckets if self.piecewise is not None else ())
        return tuple(sorted(counts))

    def release(self) -> None:
        """Destroy every captured graph (and the piecewise runner's): the engine's shutdown,
        before a tensor-parallel group is left. A graph that captured NCCL collectives keeps the
        communicator busy, and destroying or aborting it then hangs (pytorch/pytorch#115388).
        Steps after this run eagerly. Waits for the device first: no replay may be in flight."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        for entry in self.graphs.values():
            if entry.graph is not None:
                entry.graph.reset()
        self.graphs.clear()
        if self.piecewise is not None:
            self.piecewise.release()
        self.pool = None

    def capture(self) -> CaptureReport:
        """Warm up every shape eagerly, then capture, largest batch first.

        Under tensor parallelism every rank captures the same graphs in the same order, with
        the same shapes: their collectives are recorded in the graphs, and a replay meets the
        other ranks' replays of the same graph. Rank 0 decides (its plan goes to the workers
        first, `engine/step_broadcast.py` CAPTURE); a worker refuses to capture a plan that is
        not its own (`engine/tp_worker.py`). The eager warm-up runs the same forwards on every
        rank in the same order, so its collectives meet too."""
        if self.runner.step_sender is not None:
            self.runner.step_sender.send(self.capture_plan())
        t0 = time.perf_counter()
        for mode, q_len in self.shapes:
            for bs in reversed(self.batch_sizes):
                self.runner.forward_with_hidden(self.dummy_batch(mode, q_len, bs))
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        t1 = time.perf_counter()
        if self.piecewise is not None:  # its eager runs too, before any capture
            self.piecewise.warm_up()
        # No other thread may launch while a graph records: the background kernel warm-up
        # (`ModelRunner.join_kernel_warm_up`) ends here, after every eager run it overlaps.
        kernel_warm_up_wait_s = self.runner.join_kernel_warm_up()
        t_join = time.perf_counter()
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
            capture_s=t2 - t_join,
            pool_bytes=pool_bytes,
            piecewise=piecewise,
            kernel_warm_up_wait_s=kernel_warm_up_wait_s,
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

    def route(self, host: HostBatch) -> ForwardRoute:
        """How `host` runs here (counted by reason when eagerly): rank 0's decision, which the
        other tensor-parallel ranks follow (`engine/forward_route.py`)."""
        bucket = self.piecewise.bucket_for(host) if self.piecewise and self.enabled else None
        if bucket is not None:
            pw = self.piecewise
            path = RoutePath.ONE_GRAPH if pw.takes_one_graph(host) else RoutePath.PIECEWISE
            return ForwardRoute(path, bucket, pw.use_graphs)
        size = self.padded_size(host)
        if size is None:
            if not host.mode.is_uniform:
                reason = "extend"
            elif not self.batch_sizes or not self.enabled:
                reason = "graphs_off"
            else:
                reason = "batch_too_large"
            self.num_eager_steps[reason] += 1
            return EAGER
        entry = self.graphs.get((host.mode, host.q_lens[0], size))
        graphed = entry is not None and entry.graph is not None
        if not graphed:  # not captured (yet), or use_graphs=False: the padded batch, eagerly
            self.num_eager_steps["no_graphs"] += 1
        return ForwardRoute(RoutePath.UNIFORM, size, graphed)

    @torch.inference_mode()
    def run_with_hidden(
        self, host: HostBatch, feed: int = 0, greedy_feed: bool = False
    ) -> TargetOutput:
        """`run`, keeping what a draft model reads: the final-normed hidden states of every row
        of the (padded) batch, and the batch itself (views of the input buffers). `feed`: under
        TP, the number of sampled ids the workers' next step may read (`ModelRunner.
        feed_workers`); `greedy_feed`: rank 0's sampler will take a DECODE graph's greedy rows
        as they are (`ModelRunner.takes_graph_greedy`), so where this forward replays one, the
        workers read their own graph's rows instead of a broadcast (`TargetOutput.greedy_feed`)."""
        return self.execute(host, self.route(host), feed, greedy_feed)

    @torch.inference_mode()
    def execute(
        self, host: HostBatch, route: ForwardRoute, feed: int = 0, greedy_feed: bool = False
    ) -> TargetOutput:
        """Run `host` by `route` (this rank's own, or rank 0's under TP). Under TP rank 0's
        `make_batch` sends the batch with its route to the workers; a worker refuses a graphed
        route naming a graph it did not capture (a group that captured differently)."""
        path, size = route.path, route.size
        if path in (RoutePath.PIECEWISE, RoutePath.ONE_GRAPH):
            if self.piecewise is None or not self.piecewise.has_bucket(size, route.graphed):
                raise RuntimeError(f"route {route}: this rank has no such prefill bucket")
            logits, hidden, batch = self.piecewise.run(
                host, size, path is RoutePath.ONE_GRAPH, route=route, feed=feed
            )
            return TargetOutput(logits, hidden, batch, logits.shape[0], graphed=False)
        if path is RoutePath.EAGER:
            batch = self.runner.make_batch(host, route=route, feed=feed)
            logits, hidden = self.runner.forward_with_hidden(batch)
            rows = logits.shape[0]
            return TargetOutput(logits, hidden, batch, rows, graphed=False)
        q_len = host.q_lens[0] if host.q_lens else 1
        entry = self.graphs.get((host.mode, q_len, size))
        if route.graphed and (entry is None or entry.graph is None):
            raise RuntimeError(
                f"route {route}: no captured {host.mode.value} graph of q_len {q_len} and batch "
                f"size {size} on this rank (the ranks captured different graphs)"
            )
        split = not route.graphed or not entry.splits_inputs
        greedy_feed = greedy_feed and feed > 0 and route.graphed and entry.greedy is not None
        batch = self.runner.make_batch(
            host, pad_to=size, max_seq_len=self.bound, q_len=q_len, split=split,
            route=route, feed=feed, greedy_feed=greedy_feed,
        )  # fmt: skip
        rows = host.num_seqs * q_len
        if not route.graphed:
            logits, hidden = self.runner.forward_with_hidden(batch)
            return TargetOutput(logits, hidden, batch, rows, graphed=False)
        entry.graph.replay()
        self.num_replays += 1
        return TargetOutput(
            entry.logits, entry.hidden, batch, rows, True, entry.greedy, greedy_feed
        )
