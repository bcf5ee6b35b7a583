"""EXTEND (prefill) forwards replayed from piecewise CUDA graphs: per token bucket, the model is
captured as num_layers + 1 pieces split at each layer's attention, which runs eagerly between
them (SGLang's piecewise CUDA graph, vLLM's piecewise compilation).

Why: an eager prefill forward is ~45 launches per layer (norms, projections, RoPE, router,
sort, grouped GEMMs, combine), each Python and launch work on the host, so an eager prefill
takes many times its compute floor in host time (bench/RESULTS.md). Everything but attention has shapes fixed by the token
count, so it can be replayed; attention cannot: its work depends on the batch's ragged lengths
and cached prefixes (context gather, varlen kernel sized on the host).

Buckets: token counts from a fixed ladder up to `max_tokens` (`token_buckets`). A batch of T
tokens replays in the smallest bucket >= T; its rows T.. are padding, filled on purpose (token 0,
position 0, KV write slot 0, the dummy page). Padded rows go through the pieces like real ones
(per-row math: nothing mixes rows outside attention) and never reach attention or the logits.

Pieces and the attention between them: at the attention call of layer i, the model calls its
backend, which while a bucket is captured is `_AttentionBreak`. It copies the call's activation
inputs into static buffers (inside piece i), ends piece i, begins piece i + 1 and returns a
static output buffer that piece i + 1 reads. On replay the runner replays piece i, calls the
real backend on the first T rows of those static inputs with the real batch (its host lengths,
its `prepare`d metadata), copies the result into the static output, and replays piece i + 1.
The static buffers are shared by every layer and bucket (one call's inputs are dead once its
output is copied), sized by the largest bucket. The final piece's output, the final-normed
hidden states [bucket, hidden], stays valid until the next prefill replay; the LM head runs
eagerly on the rows the step samples from.

One fresh prompt in one graph: a batch of a single prompt with no cached prefix (the TTFT case
of a lightly loaded server) has a fixed attention shape once padded to its bucket: causal over
the bucket's rows, its context the rows it writes (`mha_extend.fresh_layout` over the static
write-slot buffer; padded rows write and read the dummy slot, and sit after every real row, so
the causal mask keeps them out of real rows). Where the backend says its MHA-form prefill
captures so (`captures_fresh_extend`), each bucket also captures the whole forward, attention
included, as one graph: no host work between layers, so the GPU never waits for the host's
eager attention (that host time can exceed a layer's GPU time).
`MLASERVE_ONE_GRAPH_PREFILL=0` turns it off (README, "Switches"). Without a draft model (which reads every
row's final hidden states), the one graph runs the last layer's o_proj and FFN on one row, the
step's logits row (`ForwardBatch.logits_hidden_only`); a step with more logits rows (prompt
logprobs) takes the pieces, which compute every row. The one graph starts with the inputs'
device-side split (`InputBuffers.split`, as the decode graphs do), so the host only uploads them:
each launch before the graph's is host time the GPU waits for.

Memory: the pieces of every bucket capture into one pool of their own (not the decode graphs'),
largest bucket first; prefill forwards run one at a time, so later buckets reuse earlier ones'
blocks, and a piece may free what an earlier piece of its forward allocated (they replay in
capture order). Before capture every bucket runs once eagerly (the same pieces, attention
skipped), so every lazily compiled kernel compiles at start-up.

With `use_graphs=False` the same path runs eagerly (same buckets, padding and static buffers; the
real attention runs at each break): how the CPU tests prove the padding and buffer logic.
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mlaserve import switches
from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.model_runner import ModelRunner
from mlaserve.kernels_adapter.mha_extend import ExtendLayout, fresh_layout

__all__ = ["PiecewiseGraphRunner", "PiecewiseReport", "token_buckets"]

logger = logging.getLogger(__name__)

# Bucket ladder: steps of at most 1.5x, so padding costs at most a third of a bucket's work.
_LADDER = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """The captured token counts: the ladder below `max_tokens`, then `max_tokens` itself."""
    if max_tokens < 1:
        return ()
    return (*(t for t in _LADDER if t < max_tokens), max_tokens)


@dataclass(frozen=True)
class PiecewiseReport:
    buckets: tuple[int, ...]
    num_graphs: int  # pieces
    one_graph_buckets: tuple[int, ...]  # buckets with a one-graph forward for a fresh prompt
    warmup_s: float
    capture_s: float
    pool_bytes: int  # reserved-memory growth during capture (after the eager warm-up)


@dataclass(frozen=True)
class _Call:
    """One attention call between two pieces: the backend method, its layer, the static
    buffers its activation inputs were copied to (None where the model passed None), the
    weights it takes as they are, and the static buffer its output goes to."""

    method: str  # "forward_extend_mha" (MHA form) or "forward" (latent form)
    layer_id: int
    inputs: tuple[torch.Tensor | None, ...]  # [max bucket, ...] each
    weights: tuple[torch.Tensor, ...]
    out: torch.Tensor  # [max bucket, H, d]


@dataclass
class _Bucket:
    pieces: list[torch.cuda.CUDAGraph]  # num_layers + 1; empty when replays run eagerly
    calls: list[_Call]
    hidden: torch.Tensor | None  # the last piece's output, [bucket, hidden]
    # one fresh prompt: the whole forward, attention included, and its output [bucket, hidden]
    whole: torch.cuda.CUDAGraph | None = None
    whole_hidden: torch.Tensor | None = None


class _AttentionBreak:
    """The attention backend as the model sees it while a bucket is warmed up or captured, or
    (eager mode) run. It has the real backend's form flags, so the model takes the same path,
    and turns each attention call into a break between pieces (`PiecewiseGraphRunner`)."""

    def __init__(
        self,
        runner: PiecewiseGraphRunner,
        num_tokens: int,
        on_break: Callable[[], None] | None,
        real: tuple[ForwardBatch, int] | None = None,
    ) -> None:
        backend = runner.backend
        self.name = backend.name
        self.mha_extend = backend.mha_extend
        self.accepts_written_kv = backend.accepts_written_kv
        self._runner = runner
        self._num_tokens = num_tokens
        self._on_break = on_break  # capture: end this piece, begin the next
        self._real = real  # eager mode: (the real batch, its token count): attend at the break
        self.calls: list[_Call] = []

    def forward_extend_mha(self, layer_id, q, kv_c, k_pe, w_uk, w_uv, batch) -> torch.Tensor:
        heads, d_v = q.shape[1], self._runner.v_head_dim
        return self._break(
            "forward_extend_mha", layer_id, (q, kv_c, k_pe), (w_uk, w_uv), d_v, heads
        )

    def forward(self, layer_id, q_nope, q_pe, kv_c, k_pe, batch) -> torch.Tensor:
        heads, rank = q_nope.shape[1], q_nope.shape[2]
        return self._break("forward", layer_id, (q_nope, q_pe, kv_c, k_pe), (), rank, heads)

    def _break(self, method, layer_id, inputs, weights, width, heads) -> torch.Tensor:
        runner, n = self._runner, self._num_tokens
        statics = tuple(
            None if x is None else runner.static(f"{method}.{i}", x.shape[1:], x.dtype)
            for i, x in enumerate(inputs)
        )
        for x, s in zip(inputs, statics):
            if x is not None:
                s[:n].copy_(x)
        out = runner.static(f"{method}.out", (heads, width), inputs[0].dtype)
        call = _Call(method, layer_id, statics, weights, out)
        self.calls.append(call)
        if self._on_break is not None:
            self._on_break()
        if self._real is not None:
            runner.attend(call, *self._real)
        return out[:n]


class PiecewiseGraphRunner:
    def __init__(self, runner: ModelRunner, max_tokens: int, *, use_graphs: bool) -> None:
        if use_graphs and runner.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {runner.device}")
        if max_tokens > runner.buffers.max_num_tokens:
            raise ValueError(
                f"piecewise_cuda_graph_max_tokens {max_tokens} exceeds the input buffers' "
                f"{runner.buffers.max_num_tokens} tokens"
            )
        self.runner = runner
        self.backend = runner.attn_backend
        self.v_head_dim = runner.model_config.v_head_dim
        self.buckets = token_buckets(max_tokens)
        self.use_graphs = use_graphs
        self.pool: tuple | None = None
        self._stream: torch.cuda.Stream | None = None  # the capture stream
        self._buckets: dict[int, _Bucket] = {}
        self._statics: dict[str, torch.Tensor] = {}
        self.num_replays = 0
        self.num_one_graph_replays = 0  # of num_replays: one fresh prompt in one graph
        self._warmup_s: float | None = None  # `warm_up`'s seconds, until `capture` takes them
        self.enabled = True  # off: EXTEND runs eagerly (benchmarks compare both in one run)
        self.one_graph = (
            self.backend.mha_extend
            and self.backend.captures_fresh_extend
            and switches.one_graph_prefill()
        )
        self._layouts: dict[int, ExtendLayout] = {}
        # Without a draft model reading every row's hidden states, the one graph computes the
        # last layer's o_proj and FFN for one row: the step's logits row (`ForwardBatch.
        # logits_hidden_only`). A step scoring prompt logprobs (more rows) takes the pieces.
        self.whole_logits_only = not runner.draft_reads_hidden
        # that row, as the one graph reads it: the staged logits row, clamped into the bucket
        # (a chunk that samples nothing stages none; any row is then computed and not read)
        self._one_row = torch.zeros(1, dtype=torch.int64, device=runner.device)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1] if self.buckets else 0

    def static(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The static buffer `key`: [max bucket, *shape], made on first use (the largest
        bucket's warm-up, outside any capture)."""
        buf = self._statics.get(key)
        if buf is None or tuple(buf.shape[1:]) != tuple(shape) or buf.dtype != dtype:
            if self.use_graphs and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"piecewise graphs: static buffer {key!r} first seen in capture")
            buf = torch.zeros(self.max_tokens, *shape, dtype=dtype, device=self.runner.device)
            self._statics[key] = buf
        return buf

    # ----- start-up -----
    def release(self) -> None:
        """Destroy the captured pieces (`CudaGraphRunner.release`)."""
        for bucket in self._buckets.values():
            for graph in [*bucket.pieces, bucket.whole]:
                if graph is not None:
                    graph.reset()
        self._buckets.clear()
        self.pool = None

    def warm_up(self) -> None:
        """Run every bucket eagerly (what compiles, compiles here), largest first; `capture`
        does it first where it has not run."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for n in reversed(self.buckets):
                self.runner.buffers.pad_tokens(0, n)
                self.runner.model(self._batch(n, _AttentionBreak(self, n, None)))
                if self.one_graph:  # every row padding: only the dummy slot is written
                    self._whole_forward(n, split=False)
            if self.use_graphs:
                torch.cuda.synchronize(self.runner.device)
        self._warmup_s = time.perf_counter() - t0

    def capture(self) -> PiecewiseReport:
        """Warm up every bucket eagerly (unless `warm_up` ran), then capture each, largest
        first, once the background kernel warm-up is joined (no other thread may launch during
        a capture)."""
        if self._warmup_s is None:
            self.warm_up()
        warmup_s, self._warmup_s = self._warmup_s or 0.0, None
        self.runner.join_kernel_warm_up()
        t1 = time.perf_counter()
        reserved = self._reserved()
        if self.use_graphs:
            gc.collect()  # see CudaGraphRunner.capture
            self.pool = torch.cuda.graph_pool_handle()
            for n in reversed(self.buckets):
                self._buckets[n] = self._capture_one(n)
        t2 = time.perf_counter()
        report = PiecewiseReport(
            buckets=self.buckets,
            num_graphs=sum(len(b.pieces) for b in self._buckets.values()),
            one_graph_buckets=tuple(
                n for n in self.buckets if n in self._buckets and self._buckets[n].whole is not None
            ),
            warmup_s=warmup_s,
            capture_s=t2 - t1,
            pool_bytes=max(self._reserved() - reserved, 0),
        )
        logger.info(
            "piecewise CUDA graphs (EXTEND): %d pieces for %d token buckets up to %d (%d with "
            "a one-graph fresh prompt) in %.2f s after %.2f s of eager warm-up; graph pool "
            "%.1f MiB",
            report.num_graphs, len(self.buckets), self.max_tokens,
            len(report.one_graph_buckets), report.capture_s, report.warmup_s,
            report.pool_bytes / 2**20,
        )  # fmt: skip
        return report

    def _reserved(self) -> int:
        if self.runner.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.runner.device)
        return torch.cuda.memory_reserved(self.runner.device)

    def _batch(self, num_tokens: int, backend: _AttentionBreak) -> ForwardBatch:
        """The batch the pieces see: one sequence of `num_tokens` rows, views of the runner's
        input buffers (which a replay's batch has filled, padding included). Only the model's
        own reads matter (ids, positions, KV write slots): attention goes to `backend`."""
        buffers = self.runner.buffers
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            bs=1,
            num_tokens=num_tokens,
            q_len=num_tokens,
            max_seq_len=num_tokens,
            input_ids=buffers.input_ids[:num_tokens],
            positions=buffers.positions[:num_tokens],
            seq_lens=buffers.seq_lens[:1],
            cu_q_lens=buffers.cu_q_lens[:2],
            block_tables=buffers.block_tables[:1],
            slot_mapping=buffers.slot_mapping[:num_tokens],
            logits_indices=buffers.logits_indices[:0],
            kv_pool=self.runner.kv_pool,
            attn_backend=backend,  # type: ignore[arg-type]  # the backend's stand-in
            seq_lens_host=[num_tokens],
            q_lens_host=[num_tokens],
        )

    def _fresh_batch(self, num_tokens: int) -> ForwardBatch:
        """The batch a one-graph forward sees: `_batch`'s rows with the real backend, and as its
        metadata the bucket's fixed layout of one fresh prompt (no `prepare`)."""
        layout = self._layouts.get(num_tokens)
        if layout is None:  # made at warm-up, outside any capture
            layout = fresh_layout(self.runner.buffers.slot_mapping[:num_tokens])
            self._layouts[num_tokens] = layout
        batch = self._batch(num_tokens, self.backend)  # type: ignore[arg-type]
        batch.seq_lens, batch.cu_q_lens = layout.kv_lens_dev, layout.cu_q
        batch.attn_metadata = layout
        if self.whole_logits_only:  # one logits row (`_whole_forward`)
            batch.logits_indices = self._one_row
            batch.logits_hidden_only = True
        return batch

    def _whole_forward(self, num_tokens: int, *, split: bool) -> torch.Tensor:
        """One fresh prompt's forward in bucket `num_tokens`, attention included: what the
        one graph captures (`split`: starting with the inputs' device-side split, so a replay
        only uploads them), or runs eagerly."""
        buffers = self.runner.buffers
        batch = self._fresh_batch(num_tokens)
        if split:
            buffers.split(batch)
        if self.whole_logits_only:
            torch.clamp(buffers.logits_indices[:1], max=num_tokens - 1, out=self._one_row)
        return self.runner.model(batch)

    def _capture_one(self, num_tokens: int) -> _Bucket:
        pieces: list[torch.cuda.CUDAGraph] = []
        current = [torch.cuda.CUDAGraph()]

        def next_piece() -> None:
            current[0].capture_end()
            pieces.append(current[0])
            current[0] = torch.cuda.CUDAGraph()
            current[0].capture_begin(pool=self.pool)

        stand_in = _AttentionBreak(self, num_tokens, next_piece)
        self.runner.buffers.pad_tokens(0, num_tokens)
        batch = self._batch(num_tokens, stand_in)
        torch.cuda.synchronize(self.runner.device)
        # One capture stream for every bucket: the allocator reuses a freed block only on the
        # stream it was allocated on, so a stream per bucket would keep every bucket's blocks
        # (4.2 GB instead of the largest bucket's ~1 GB for the V2-Lite shape up to 8192).
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.runner.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            current[0].capture_begin(pool=self.pool)
            try:
                hidden = self.runner.model(batch)
            finally:  # never leave the stream capturing
                current[0].capture_end()
            pieces.append(current[0])
            whole = whole_hidden = None
            if self.one_graph:
                whole = torch.cuda.CUDAGraph()
                whole.capture_begin(pool=self.pool)
                try:
                    whole_hidden = self._whole_forward(num_tokens, split=True)
                finally:
                    whole.capture_end()
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        if len(pieces) != len(stand_in.calls) + 1:
            raise RuntimeError(
                f"piecewise capture: {len(pieces)} pieces, {len(stand_in.calls)} breaks"
            )
        return _Bucket(pieces, stand_in.calls, hidden, whole, whole_hidden)

    # ----- serving -----
    def bucket_for(self, host: HostBatch) -> int | None:
        """The bucket an EXTEND batch replays in, or None (eager)."""
        if not self.enabled or host.mode.is_uniform:
            return None
        i = bisect.bisect_left(self.buckets, len(host.input_ids))
        if i == len(self.buckets) or (self.use_graphs and self.buckets[i] not in self._buckets):
            return None
        return self.buckets[i]

    def has_bucket(self, bucket: int, graphed: bool) -> bool:
        """Whether this runner replays `bucket` (`graphed`: from captured pieces)."""
        if graphed != self.use_graphs:
            return False
        return bucket in self._buckets if graphed else bucket in self.buckets

    @torch.inference_mode()
    def run(
        self, host: HostBatch, bucket: int, one: bool | None = None, **send: Any
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        """-> (logits of batch.logits_indices [n, vocab] fp32, final-normed hidden states of the
        real rows [T, hidden] (a view of a static buffer; the logits rows' alone, [n, hidden],
        when `batch.logits_hidden_only`), the real batch). `one`: whether the one graph runs it
        (None: `takes_one_graph`); `send`: `make_batch`'s route and feed (TP)."""
        runner = self.runner
        one = self.takes_one_graph(host) if one is None else one
        if one and not self.one_graph:
            raise RuntimeError(f"bucket {bucket}: this rank has no one-graph prefill")
        if one and self.use_graphs:  # the graph splits the upload over the whole bucket
            batch = runner.make_batch(host, split=False, pad_tokens_to=bucket, **send)
        else:
            batch = runner.make_batch(host, **send)
            runner.buffers.pad_tokens(batch.num_tokens, bucket)
        num_tokens, num_logits = batch.num_tokens, batch.logits_indices.shape[0]
        hidden = self._replay_one_graph(bucket) if one else self._replay(batch, bucket)
        self.num_replays += 1
        if one and self.whole_logits_only:  # [1, hidden]: the logits row's
            hidden = hidden[:num_logits]
        elif batch.logits_hidden_only:  # the rows its readers want, as an eager forward's
            hidden = hidden[batch.logits_indices]
        else:
            hidden = hidden[:num_tokens]
            return runner.model.compute_logits(hidden[batch.logits_indices]), hidden, batch
        return runner.model.compute_logits(hidden), hidden, batch

    def _replay_one_graph(self, bucket: int) -> torch.Tensor:
        """One fresh prompt: attention is inside the graph."""
        self.num_one_graph_replays += 1
        if not self.use_graphs:
            return self._whole_forward(bucket, split=False)  # `fill` split the inputs
        entry = self._buckets[bucket]
        entry.whole.replay()  # type: ignore[union-attr]
        return entry.whole_hidden  # type: ignore[return-value]

    def _replay(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """The pieces, with the real backend's attention between them."""
        self.backend.prepare(batch)
        num_tokens = batch.num_tokens
        if not self.use_graphs:
            stand_in = _AttentionBreak(self, bucket, None, real=(batch, num_tokens))
            return self.runner.model(self._batch(bucket, stand_in))
        entry = self._buckets[bucket]
        for piece, call in zip(entry.pieces, entry.calls):
            piece.replay()
            self.attend(call, batch, num_tokens)
        entry.pieces[-1].replay()
        return entry.hidden  # type: ignore[return-value]

    def takes_one_graph(self, host: HostBatch) -> bool:
        """One fresh prompt whose readers want what the one graph computes: every row's hidden
        states, or (`whole_logits_only`) at most one logits row's."""
        if not (self.one_graph and host.num_seqs == 1 and host.seq_lens == host.q_lens):
            return False
        if not self.whole_logits_only:
            return True
        return host.logits_hidden_only and len(host.logits_indices) <= 1

    def attend(self, call: _Call, batch: ForwardBatch, num_tokens: int) -> None:
        """One layer's attention on the real rows of the static inputs, into its static output."""
        inputs = [None if s is None else s[:num_tokens] for s in call.inputs]
        out = getattr(self.backend, call.method)(call.layer_id, *inputs, *call.weights, batch)
        call.out[:num_tokens].copy_(out)
