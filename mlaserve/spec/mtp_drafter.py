"""The draft model: DeepSeek's MTP module run as a top-1 chain of k steps (EAGLE-style).

The MTP row at position p reads (the target's final-normed hidden state at p, the embedding of
the token at p+1) and predicts the token at p+2; its attention caches latents under layer id
`num_hidden_layers` of the shared KV pool (same pages and page tables as the target).

Two forwards per step, each a CUDA graph per captured batch size:

  * DRAFT_EXTEND, fixed stride (SGLang's v2 draft-extend, seed PR #25002): the MTP over the
    target's own verify batch, q rows per request (q = k+1 after a verify, 1 after a plain
    decode step), inputs = the tokens the step emitted (padded past the accept length with the
    last one). Same positions, slots, lengths and page tables as the target's forward: the
    batch is the target's input buffers with the ids overwritten on the device. Rows past the
    accepted ones write MTP KV that the next step overwrites in place. The graph selects row
    b*q + accept_len[b] - 1 on the device and writes its hidden state and position into
    static buffers; that is all it outputs.
  * DRAFT (only when the next step speculates): the top-1 of the selected rows (MTP head +
    argmax), then k-1 DECODE-shaped MTP steps on the MTP's own hidden state. The positions,
    KV slots and lengths of all k-1 steps are computed once, in one batch of index kernels,
    before the first step (no per-step index work; seed PR #26241), from the selected rows'
    positions and the page tables already in the input buffers.

The top-1 is outside the DRAFT_EXTEND graph because a step that will not speculate next still
needs the MTP KV of its new tokens (so later drafts see an exact cache) but not the MTP's head,
whose vocab x hidden GEMM is most of one MTP row's cost.

After an EXTEND step (prefill chunks, possibly with decodes) the MTP runs eagerly over the same
rows, ids shifted left by one (a chunk that samples takes its sampled token as its last input),
and the DRAFT graph runs on the rows that sampled.

Graph memory: every draft graph is captured into the target graphs' pool after all target
graphs, so a draft replay never writes a block holding a target graph's live output (the
target logits are read again after the draft, for logprobs); `tests/spec/test_spec_gpu.py`
checks it. The draft's inputs and outputs live in static buffers outside the pool.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import numpy as np
import torch

from mlaserve.engine.forward_batch import ForwardBatch, ForwardMode
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.model_runner import ModelRunner
from mlaserve.engine.request import Request
from mlaserve.engine.scheduler import SchedulerOutput
from mlaserve.engine.step_broadcast import CaptureDraftMsg, DraftDecodeMsg, DraftExtendMsg
from mlaserve.graph_runner import CudaGraphRunner, TargetOutput
from mlaserve.sampling.argmax_kernel import row_argmax

__all__ = ["Drafter", "MTPDrafter", "target_mode"]

logger = logging.getLogger(__name__)


def target_mode(q_len: int) -> ForwardMode:
    """The target's forward mode for q_len tokens per request in a decode step."""
    return ForwardMode.DECODE if q_len == 1 else ForwardMode.VERIFY


class Drafter(Protocol):
    """What the speculative decoder needs from a draft. `draft`: whether the next step
    speculates (k draft tokens per request are wanted); else only the draft's own cache is kept
    up to date and None is returned. Draft tensors are [n, k] int64 on the device."""

    k: int

    def after_extend(
        self,
        sched: SchedulerOutput,
        target: TargetOutput,
        sampled: torch.Tensor,
        requests: list[Request],
        draft: bool,
    ) -> torch.Tensor | None:
        """Called before the step is accounted (num_computed_tokens as scheduled). target: the
        EXTEND forward; sampled [n]: the tokens sampled for `requests` (the chunks that reached
        their last token, in scheduling order)."""
        ...

    def after_decode(
        self,
        target: TargetOutput,
        out_tokens: torch.Tensor,
        accept_len: torch.Tensor,
        requests: list[Request],
        draft: bool,
    ) -> torch.Tensor | None:
        """target: the DECODE (q = 1) or VERIFY (q = k+1) forward, maybe padded; out_tokens
        [bs, q]: the emitted tokens, padded past accept_len [bs] (1..q) with the last one."""
        ...


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph


class MTPDrafter:
    def __init__(self, runner: ModelRunner, k: int) -> None:
        if runner.model.mtp is None:
            raise ValueError("MTPDrafter: the model has no MTP module")
        self.runner = runner
        self.mtp = runner.model.mtp
        self.k = k
        n, dev = runner.buffers.max_num_seqs, runner.device
        hidden = runner.model_config.hidden_size

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=dev)

        # Static inputs/outputs of the draft graphs (outside any graph pool).
        self.accept = torch.ones(n, dtype=torch.int64, device=dev)  # selected row + 1; pad: 1
        self.sel_hidden = zeros(n, hidden, dtype=runner.dtype)  # MTP state of the selected row
        self.sel_pos = zeros(n)  # its position: chain step i writes position sel_pos + i
        self.drafts_t = zeros(k, n)  # [k, n]: draft j of request b at [j, b] (rows contiguous)
        steps = max(k - 1, 1)
        self.chain_pos = zeros(steps, n)
        self.chain_slots = zeros(steps, n)
        self.chain_seq = zeros(steps, n, dtype=torch.int32)
        self.chain_offsets = torch.arange(1, k, dtype=torch.int64, device=dev)  # [k-1]
        self.cu_q1 = torch.arange(n + 1, dtype=torch.int32, device=dev)  # q_len 1 cu_q_lens
        self.arange = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[str, int, int], _Graph] = {}
        self.num_replays = 0
        self.num_eager = 0

    # ----- the two forwards (eager; a graph captures exactly these) -----
    def _draft_extend(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """batch: the target's uniform batch as DRAFT_EXTEND (ids = emitted tokens);
        hidden [bs*q, H]: the target's hidden states. Writes sel_hidden, sel_pos [:bs]."""
        bs, q = batch.bs, batch.q_len
        self.runner.attn_backend.prepare(batch)
        h = self.mtp(batch.input_ids, batch.positions, hidden[: bs * q], batch)
        rows = self.arange[:bs] * q + self.accept[:bs] - 1
        self.sel_hidden[:bs].copy_(h.index_select(0, rows))
        self.sel_pos[:bs].copy_(batch.positions.index_select(0, rows))

    def _draft(self, bs: int, max_seq_len: int) -> None:
        """Top-1 of the selected rows, then k-1 chain steps. Reads sel_hidden, sel_pos and the
        input buffers' page tables [:bs]; writes drafts_t[:, :bs]."""
        k, ps = self.k, self.runner.page_size
        token = row_argmax(self.mtp.compute_logits(self.sel_hidden[:bs]))
        self.drafts_t[0, :bs].copy_(token)
        if k == 1:
            return
        # Every chain step's index work at once: [bs, k-1] positions, slots and lengths.
        tables = self.runner.buffers.block_tables[:bs]
        pos = self.sel_pos[:bs, None] + self.chain_offsets[None, :]
        page_col = torch.clamp(pos // ps, max=tables.shape[1] - 1)  # never read past a row
        pages = tables.gather(1, page_col).to(torch.int64)
        self.chain_pos[:, :bs].copy_(pos.T)
        self.chain_slots[:, :bs].copy_((pages * ps + pos % ps).T)
        self.chain_seq[:, :bs].copy_((pos + 1).T)
        hidden = self.sel_hidden[:bs]
        for i in range(k - 1):
            batch = ForwardBatch(
                mode=ForwardMode.DECODE,
                bs=bs,
                num_tokens=bs,
                q_len=1,
                max_seq_len=max_seq_len,
                input_ids=self.drafts_t[i, :bs],
                positions=self.chain_pos[i, :bs],
                seq_lens=self.chain_seq[i, :bs],
                cu_q_lens=self.cu_q1[: bs + 1],
                block_tables=tables,
                slot_mapping=self.chain_slots[i, :bs],
                logits_indices=self.arange[:bs],
                kv_pool=self.runner.kv_pool,
                attn_backend=self.runner.attn_backend,
            )
            self.runner.attn_backend.prepare(batch)
            hidden = self.mtp(batch.input_ids, batch.positions, hidden, batch)
            self.drafts_t[i + 1, :bs].copy_(row_argmax(self.mtp.compute_logits(hidden)))

    # ----- a step -----
    # Under tensor parallelism rank 0 (which accepted and sampled) announces each of these
    # (`engine/step_broadcast.py` DRAFT_DECODE / DRAFT_EXTEND) and broadcasts the device values
    # they read; every worker then runs `draft_after_decode` / `draft_after_extend` on its last
    # target forward, so the MTP's collectives meet rank 0's (`engine/tp_worker.py`).
    @torch.inference_mode()
    def after_decode(
        self,
        target: TargetOutput,
        out_tokens: torch.Tensor,
        accept_len: torch.Tensor,
        requests: list[Request],
        draft: bool,
    ) -> torch.Tensor | None:
        bs, q = len(requests), target.batch.q_len
        sender = self.runner.step_sender
        if sender is not None:
            sender.send(DraftDecodeMsg(bs, q, draft))
            packed = torch.cat([out_tokens.reshape(bs, q), accept_len.reshape(bs, 1)], dim=1)
            self.runner.tp.broadcast(packed.to(torch.int64), src=0)
        return self.draft_after_decode(target, out_tokens, accept_len, bs, draft)

    def draft_after_decode(
        self,
        target: TargetOutput,
        out_tokens: torch.Tensor,
        accept_len: torch.Tensor,
        bs: int,
        draft: bool,
    ) -> torch.Tensor | None:
        """`after_decode` for `bs` real rows, on any rank."""
        batch = target.batch
        size, q = batch.bs, batch.q_len
        # The emitted tokens become the draft's inputs (the target's ids are consumed).
        batch.input_ids.view(size, q)[:bs].copy_(out_tokens)
        self.accept[:bs].copy_(accept_len)
        self.accept[bs:size].fill_(1)
        graphed = target.graphed and ("extend", q, size) in self.graphs
        if graphed:
            self.graphs[("extend", q, size)].graph.replay()
            self.num_replays += 1
        else:
            self.num_eager += 1
            de = dataclasses.replace(batch, mode=ForwardMode.DRAFT_EXTEND, attn_metadata=None)
            self._draft_extend(de, target.hidden)
        if not draft:
            return None
        return self._run_draft(size, graphed, batch.max_seq_len)[:bs]

    @torch.inference_mode()
    def after_extend(
        self,
        sched: SchedulerOutput,
        target: TargetOutput,
        sampled: torch.Tensor,
        requests: list[Request],
        draft: bool,
    ) -> torch.Tensor | None:
        # Row i's input is token i+1. The host knows it except where a chunk sampled: its last
        # row takes the sampled token, scattered on the device at the logits rows.
        ids: list[int] = []
        for s in sched.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(r.tokens(start + 1, end))
            ids.append(0 if s.samples else r.token_at(end))
        ends = [
            s.request.num_computed_tokens + s.num_new_tokens for s in sched.scheduled if s.samples
        ]
        msg = DraftExtendMsg(np.asarray(ids, dtype=np.int64), ends, [r.pages for r in requests],
                             draft)  # fmt: skip
        if self.runner.step_sender is not None:
            self.runner.step_sender.send(msg)
            if ends:
                self.runner.tp.broadcast(sampled.contiguous(), src=0)
        return self.draft_after_extend(target, msg, sampled)

    def draft_after_extend(
        self, target: TargetOutput, msg: DraftExtendMsg, sampled: torch.Tensor
    ) -> torch.Tensor | None:
        """`after_extend` from its host rows (`msg`: the MTP's input ids, and per sampled
        sequence its end and pages) and the sampled ids [n], on any rank."""
        batch = target.batch
        n = len(msg.ends)
        ids = torch.from_numpy(msg.ids)
        batch.input_ids.copy_(_upload(ids, batch.input_ids.device))
        if n:
            batch.input_ids.index_copy_(0, batch.logits_indices, sampled)
        self.runner.attn_backend.prepare(batch)
        h = self.mtp(batch.input_ids, batch.positions, target.hidden, batch)
        if not n or not msg.draft:
            return None
        self.sel_hidden[:n].copy_(h.index_select(0, batch.logits_indices))
        # The sampled rows' page tables, in rows 0..n-1 of the input buffers (what the chain
        # reads), padded to the draft graph's size.
        ends = msg.ends
        host = HostBatch(
            ForwardMode.DECODE, [0] * n, [e - 1 for e in ends], [0] * n, ends, [1] * n,
            msg.tables, [],
        )  # fmt: skip
        size = self._graph_size(n)
        chain = self.runner.make_batch(host, pad_to=size or n)
        self.sel_pos[: chain.bs].copy_(chain.positions)
        return self._run_draft(chain.bs, size is not None, max(ends))[:n]

    def _run_draft(self, size: int, graphed: bool, max_seq_len: int) -> torch.Tensor:
        entry = self.graphs.get(("draft", 1, size)) if graphed else None
        if entry is not None:
            entry.graph.replay()
            self.num_replays += 1
        else:
            self._draft(size, max_seq_len + self.k)
        return self.drafts_t[:, :size].T

    def _graph_size(self, n: int) -> int | None:
        sizes = sorted({size for (_, _, size) in self.graphs})
        return next((s for s in sizes if s >= n), None)

    # ----- start-up -----
    def reset_accept(self) -> None:
        """Accept length 1 in every row: what a batch of padding rows may select with any q
        (a real step writes its own before the draft-extend; the buffer otherwise holds the
        last step's lengths, up to k+1, which would select past a q = 1 batch)."""
        self.accept.fill_(1)

    def release(self) -> None:
        """Destroy the draft's graphs (`CudaGraphRunner.release`), once the device is done."""
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        for entry in self.graphs.values():
            entry.graph.reset()
        self.graphs.clear()

    def capture(self, graphs: CudaGraphRunner, q_lens: tuple[int, ...]) -> int:
        """Warm up, then capture DRAFT_EXTEND (per q in q_lens) and DRAFT per captured size,
        after (and into the pool of) every target graph. Returns the number captured."""
        bound = graphs.bound

        def de_batch(q: int, size: int) -> ForwardBatch:
            batch = graphs.dummy_batch(target_mode(q), q, size)
            return dataclasses.replace(batch, mode=ForwardMode.DRAFT_EXTEND, attn_metadata=None)

        def target_hidden(q: int, size: int) -> torch.Tensor:
            return graphs.graphs[(target_mode(q), q, size)].hidden

        if not graphs.use_graphs:
            return 0
        # Under TP the workers capture the same draft graphs after their target graphs, in
        # this order (`engine/tp_worker.py`; the target plan was checked equal there).
        if self.runner.step_sender is not None:
            self.runner.step_sender.send(CaptureDraftMsg(tuple(q_lens)))
        self.reset_accept()
        sizes = list(reversed(graphs.batch_sizes))
        for size in sizes:  # warm-up: every lazily compiled kernel runs before capture
            for q in q_lens:
                self._draft_extend(de_batch(q, size), target_hidden(q, size))
            self._draft(size, bound)
        torch.cuda.synchronize(self.runner.device)
        self.runner.join_kernel_warm_up()  # no other thread launches during a capture
        for size in sizes:
            for q in q_lens:
                batch, hidden = de_batch(q, size), target_hidden(q, size)
                self.graphs[("extend", q, size)] = self._capture(
                    graphs, lambda b=batch, h=hidden: self._draft_extend(b, h)
                )
            self.graphs[("draft", 1, size)] = self._capture(
                graphs, lambda s=size: self._draft(s, bound)
            )
        return len(self.graphs)

    def _capture(self, graphs: CudaGraphRunner, fn) -> _Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs.pool):
            fn()
        return _Graph(graph)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> device without waiting for the GPU (pinned, non-blocking)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
