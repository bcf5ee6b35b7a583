"""One engine step with speculative decoding.

    decode step, every request holding k drafts (the policy said speculate):
        VERIFY target forward over [last token, d_1..d_k]  (graph: VERIFY, q_len k+1)
        -> lossless acceptance on the device (`sampling/rejection.accept_draft`)
        -> draft-extend over the k+1 rows, fixed stride (graph) -> [draft graph: k drafts]
    decode step otherwise (a plain step):
        DECODE target forward (graph, q_len 1) -> sampler; if the next step speculates,
        draft-extend over the one row -> draft graph; if not, either the draft's cache update
        alone (draft-extend, "refresh": when the policy finds it cheap) or no draft work at all
        (a plain engine's step: with overlap scheduling the engine runs it as one, overlapped
        with its neighbours, after `plan` decided it), after which those requests' draft
        caches are stale
        (`Request.draft_cache_valid`: positions the MTP layer never saw). A stale request is
        still verified when its batch speculates (drafts from an incomplete cache; acceptance is
        lossless whatever the drafts), but its accept lengths do not feed the policy's estimate.
    EXTEND step (prefill chunks, maybe with decodes):
        target forward -> sampler -> the draft over the same rows (eager) -> [draft graph];
        with overlap scheduling, when the policy keeps the next step plain and no refresh
        pays, a plain engine's step instead (`plan`): no draft pass over the prompt, and the
        requests' draft caches start stale; except with prefix caching (`extend_drafts`),
        where the draft pass over the prompt always runs (a refresh): a page registers only
        with its MTP rows written (`engine/prefix_sharing.py`), so without it a prompt of an
        engine whose speculation does not pay would never be cached

Whether the NEXT step speculates is decided in this one (`SpecPolicy`, from the batch size, the
number of stale caches, the running accept length and the step costs), since its drafts are
drafted now. Each steady-state decode step's kind (spec, plain, refresh) is kept so the engine
can report the step's wall time back to the policy (`observe_step_time`), which takes it only
from a settled batch: same kind and same requests as the step before. The first steps after a
batch changes are slower than the rest, and a policy that counted them saw speculation dearer
than it was.

The only device->host transfer is one packed int64 copy: the emitted tokens, the accept
lengths, the per-request finite flags and the next drafts (the host builds the next verify
batch from them; reading them in the same copy costs no extra wait). Logprobs, when a request
asks for them, come after it as in the plain path.
"""

from __future__ import annotations

import logging
import time

import torch

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.input_buffers import HostBatch
from mlaserve.engine.model_runner import ModelRunner
from mlaserve.engine.read_back import NONFINITE_LOGITS, StepResult
from mlaserve.engine.request import Request
from mlaserve.engine.scheduler import SchedulerOutput
from mlaserve.graph_runner import CudaGraphRunner, TargetOutput
from mlaserve.sampling.rejection import accept_draft
from mlaserve.sampling.sampler import finite_rows, raw_logprobs
from mlaserve.spec.mtp_drafter import Drafter, target_mode
from mlaserve.spec.spec_policy import Decision, SpecPolicy
from mlaserve.spec.spec_stats import SpecStats

__all__ = ["SpecDecoder"]

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 30.0  # the periodic acceptance log line
# Settled plain steps' wall times go to the policy in groups of this many: on a small model a
# plain step's host work is its time, and a policy call per step was a measurable share of it.
OBSERVE_EVERY = 8


class SpecDecoder:
    def __init__(
        self,
        runner: ModelRunner,
        graphs: CudaGraphRunner,
        drafter: Drafter,
        k: int,
        policy: SpecPolicy | None = None,
        *,
        extend_drafts: bool = False,
    ) -> None:
        """`extend_drafts`: an EXTEND step never goes plain (prefix caching: the prompt's pages
        need their MTP rows to be registered); costs the draft layer's pass over the prompt."""
        self.runner = runner
        self.extend_drafts = extend_drafts
        self.graphs = graphs
        self.drafter = drafter
        self.k = k
        self.policy = policy or SpecPolicy(k)
        self.stats = SpecStats(k)
        self._last_log = time.monotonic()
        # The last step's kind (spec, plain, refresh) when it was a steady-state decode step,
        # else None, and its batch: its size and `SchedulerOutput.batch_id`.
        self._last_kind: str | None = None
        self._batch_size = 0
        self._batch_id: int | None = None
        self._prev_key: tuple | None = None  # (kind, batch id) of the step before, if steady
        self._pending: list[float] = []  # settled plain steps' seconds not yet given the policy
        self._pending_size = 0  # and their batch size
        # The batch id of the last step when it was a plain decode step (every request's draft
        # cache stale, no drafts): the next step of that batch needs no per-request work.
        self._plain_batch: int | None = None

    def reset_stats(self) -> None:
        """Forget what throwaway steps (the start-up cost measurement) taught: counters, the
        policy's decisions and its accept-length observations (the measurement's synthetic
        prompts are drafted almost perfectly, which would hold the estimate too high)."""
        self.stats = SpecStats(self.k)
        self.policy.decisions.clear()
        self.policy.reset_observations()

    def log_line(self) -> str:
        st = self.stats
        rates = [a / max(st.num_drafts, 1) for a in st.accepted_per_pos]
        return (
            f"spec decode (mtp, k={self.k}): mean accept length {st.mean_accept_length:.2f}, "
            f"draft acceptance {st.num_accepted_tokens / max(st.num_draft_tokens, 1):.1%}, "
            f"per position {' '.join(f'{r:.2f}' for r in rates)} over {st.num_drafts} drafts; "
            f"policy estimate {self.policy.accept_length_estimate:.2f}"
        )

    def plan(self, sched: SchedulerOutput) -> Decision | None:
        """Decide a step with nothing to verify before it runs, for an engine that overlaps
        plain steps; None for a DECODE step that verifies (`step` decides what follows it). On
        a plain decision (`Decision.plain`) the engine runs the step as an engine without
        speculation would, overlapped with its neighbours (launched before the previous step's
        tokens are read back), and the requests' draft caches go stale here: for an EXTEND
        step that means no draft pass over its rows (a policy that keeps decode steps plain
        and skips the refresh would let those caches go stale one step later anyway, and the
        pass would cost the prompt its time to first token). Any other decision is handed to
        `step`."""
        if sched.batch_id is not None and sched.batch_id == self._plain_batch:
            # The requests of the last step, a plain decode step: all decoding, every cache
            # stale, no drafts. On a small model a step's host work is its time: the
            # per-request loops below are skipped.
            decision = self.policy.repeat()
            if decision is None:
                n = len(sched.scheduled)
                decision = self.policy.decide(n, n)
            if decision.plain:
                self._last_kind = "plain"
                return decision
            self._plain_batch = self._last_kind = None  # (`_decide`'s work, less the count)
            return decision
        requests = [s.request for s in sched.scheduled]
        decode = sched.mode is ForwardMode.DECODE
        if decode and self._verifies(requests):
            return None
        decision = self._decide(requests, sched.batch_id)
        if decision.plain and not decode and self.extend_drafts:
            decision = Decision(False, decision.reason, refresh=True)
        if decision.plain:
            self._go_plain(requests, sched.batch_id if decode else None)
        return decision

    def _verifies(self, requests: list[Request]) -> bool:
        return all(len(r.draft_token_ids) == self.k for r in requests)

    def _decide(self, requests: list[Request], batch_id: int | None) -> Decision:
        """The policy's decision for a decode step of `requests` (counted); `batch_id`: theirs
        (`SchedulerOutput.batch_id`)."""
        num_stale = 0
        for r in requests:
            if r.num_computed_tokens == 0:  # (re)computed from its prompt
                r.draft_cache_valid = True
            elif not r.draft_cache_valid:
                num_stale += 1
        self._last_kind = self._plain_batch = None
        self._batch_size, self._batch_id = len(requests), batch_id
        return self.policy.decide(len(requests), num_stale)

    def step(
        self, sched: SchedulerOutput, decision: Decision | None = None
    ) -> tuple[StepResult, list[int]]:
        """-> (the tokens each sampled request emits, in scheduling order; the draft tokens each
        accepted, for `Scheduler.after_step`). Drafts for the next step land in
        `request.draft_token_ids` (empty when the next step does not speculate). `decision`:
        `plan`'s for this step, if it made one."""
        self.runner.admit(sched)
        requests = [s.request for s in sched.scheduled]
        decode = sched.mode is ForwardMode.DECODE
        verify = decode and self._verifies(requests)
        target = None
        if decode and not verify:
            # A DECODE forward whatever the decision (which only says what follows it): start
            # it first, so the decision's host work runs beside it, as a plain engine's would.
            target = self.graphs.run_with_hidden(self.runner.build_host_batch(sched))
        decision = decision or self._decide(requests, sched.batch_id)
        if decode:
            if target is not None and decision.plain:
                return self._plain(sched, requests, target)
            result, accepted = self._decode(sched, requests, decision, target)
        else:
            result, accepted = self._extend(sched, decision.speculate)
        if time.monotonic() - self._last_log >= LOG_INTERVAL_S and self.stats.num_drafts:
            self._last_log = time.monotonic()
            logger.info("%s", self.log_line())
        return result, accepted

    def observe_step_time(self, seconds: float) -> None:
        """The wall time of the engine step that just ran (scheduling to outputs): reported to
        the policy's online costs when it was a steady-state decode step of a settled batch
        (the step before was of the same kind, over the same requests)."""
        kind, batch_id = self._last_kind, self._batch_id
        key = None if kind is None or batch_id is None else (kind, batch_id)
        if key is not None and key == self._prev_key:  # settled
            if kind != "plain":
                self.policy.observe_step(kind, self._batch_size, seconds)
            else:
                pending = self._pending
                pending.append(seconds)
                self._pending_size = self._batch_size
                if len(pending) >= OBSERVE_EVERY:
                    self._flush_observed()
        elif self._pending:
            self._flush_observed()
        self._prev_key = key

    def _flush_observed(self) -> None:
        """Hand the settled plain steps' wall times held since the last flush to the policy:
        in groups of OBSERVE_EVERY steps, one sort of its window each instead of one per step
        (a speculative step is dearer, and its own host work larger: it reports each step)."""
        # (the batch size of the steps held: a flush on a change of batch runs after `_decide`
        # has taken the new batch's)
        self.policy.observe_steps("plain", self._pending_size, self._pending)
        self._pending = []

    # ----- EXTEND: plain target forward, then the draft over the same rows -----
    @torch.inference_mode()
    def _extend(self, sched: SchedulerOutput, speculate: bool) -> tuple[StepResult, list[int]]:
        """The draft runs over every row (prefill keeps its cache complete); it drafts when the
        next step speculates."""
        target = self.graphs.run_with_hidden(self.runner.build_host_batch(sched))
        requests = sched.sampled_requests
        n = len(requests)
        dev = target.hidden.device
        sampled = torch.empty(0, dtype=torch.int64, device=dev)
        out = None
        if n:
            _, out = self.runner.sample_requests(target.logits[:n], requests)
            sampled = out.token_ids
        drafts = self.drafter.after_extend(sched, target, sampled, requests, speculate)
        for s in sched.scheduled:
            s.request.draft_token_ids = []
        if not n:
            return StepResult(token_ids=[]), []
        parts = [sampled, out.finite.to(torch.int64)]
        if drafts is not None:
            parts.append(drafts.reshape(-1))
        values = self.runner.read_back(torch.cat(parts))
        self._set_drafts(requests, values[2 * n :] if drafts is not None else None)
        result = StepResult(token_ids=[[t] for t in values[:n]])
        self._errors(result, values[n : 2 * n])
        if out.logprobs is not None:
            self._logprobs(result, out, [1] * n, 1)
        return result, [0] * n

    # ----- DECODE: verify k drafts, or a plain step -----
    @torch.inference_mode()
    def _decode(
        self,
        sched: SchedulerOutput,
        requests: list[Request],
        decision: Decision,
        target: TargetOutput | None,
    ) -> tuple[StepResult, list[int]]:
        """target: the DECODE forward already started when no request holds drafts; None: every
        request holds k drafts, verified here. Speculating next: draft-extend + drafts. Not:
        the draft-extend alone (refresh), or no draft work at all (`_plain`, when there is
        nothing to verify either) and the requests' draft caches go stale."""
        k = self.k
        fresh = [r.draft_cache_valid for r in requests]  # before this step may change it
        bs = len(requests)
        verify = target is None
        q = k + 1 if verify else 1
        if verify:
            target = self.graphs.run_with_hidden(self._verify_batch(requests))
        logits = target.logits[: bs * q]
        if verify:
            slots = self.runner.sampling_slots
            steps = [r.num_output_tokens for r in requests]
            sb = slots.verify_batch([r.slot for r in requests], steps, k)
            # The drafts are still in the input buffer (verify rows 1..k).
            drafts_in = target.batch.input_ids.view(-1, q)[:bs, 1:]
            accept_len, out_tokens = accept_draft(logits.view(bs, q, -1), drafts_in, sb)
            slots.record(sb.slots[::q], out_tokens, accept_len)
            # A request is finite when every row it emits from is (NaN/inf: an error).
            row_ok = finite_rows(logits, out_tokens.reshape(-1), sb.all_greedy).view(bs, q)
            emitted = torch.arange(q, device=logits.device) < accept_len.unsqueeze(1)
            finite = (row_ok | ~emitted).all(dim=1)
        else:
            sb, out = self.runner.sample_requests(logits, requests)
            out_tokens, finite = out.token_ids.unsqueeze(1), out.finite
            accept_len = torch.ones(bs, dtype=torch.int64, device=logits.device)
        drafts = None
        if decision.speculate or decision.refresh:
            drafts = self.drafter.after_decode(
                target, out_tokens, accept_len, requests, decision.speculate
            )
        else:
            for r in requests:
                r.draft_cache_valid = False
        if verify == decision.speculate:  # steady state: not a switch between the two
            self._last_kind = "spec" if verify else "refresh" if decision.refresh else "plain"
        parts = [out_tokens.reshape(-1), accept_len, finite.to(torch.int64)]
        if drafts is not None:
            parts.append(drafts.reshape(-1))
        values = self.runner.read_back(torch.cat(parts))
        lens = values[bs * q : bs * q + bs]
        off = bs * q + 2 * bs
        self._set_drafts(requests, values[off:] if drafts is not None else None)
        result = StepResult(token_ids=[values[i * q : i * q + lens[i]] for i in range(bs)])
        self._errors(result, values[bs * q + bs : off])
        if verify:
            for r, n in zip(requests, lens, strict=True):
                if r.metrics is not None:
                    r.metrics.num_draft_tokens += k
                    r.metrics.num_accepted_tokens += n - 1
            self.stats.record(lens)
            self.policy.observe([n for n, ok in zip(lens, fresh, strict=True) if ok])
        if sb.need_logprobs:
            lp = raw_logprobs(logits.float(), out_tokens.reshape(-1), sb.max_num_logprobs)
            self._logprobs(result, lp, lens, q)
        return result, [n - 1 for n in lens]

    def _plain(
        self, sched: SchedulerOutput, requests: list[Request], target: TargetOutput
    ) -> tuple[StepResult, list]:
        """No draft work at all: exactly a plain engine's step (its host batch fast path, its
        forward, sampling and read-back), so speculation off costs what an engine without it
        does. The draft caches go stale."""
        self._go_plain(requests, sched.batch_id)
        logits = target.logits[: target.num_rows]
        return self.runner.sample(logits, sched, greedy=target.greedy), [0] * len(requests)

    def _go_plain(self, requests: list[Request], decode_batch: int | None) -> None:
        """A step without draft work: the requests' draft caches go stale and they hold no
        drafts. A decode step (`decode_batch`: its batch id) is counted as plain for the
        policy's online costs, and the next step of the same batch takes `plan`'s fast path;
        an EXTEND step (None) is not a decode step's cost."""
        for r in requests:
            r.draft_cache_valid = False
            if r.draft_token_ids:
                r.draft_token_ids = []
        self._last_kind = "plain" if decode_batch is not None else None
        self._plain_batch = decode_batch

    def _verify_batch(self, requests: list[Request]) -> HostBatch:
        """VERIFY rows: each request's last token and its k drafts (q_len k+1, causal)."""
        q, ps = self.k + 1, self.runner.page_size
        host = HostBatch(target_mode(q), [], [], [], [], [], [], [])
        for r in requests:
            start = r.num_tokens - 1
            host.input_ids.append(r.token_at(start))
            host.input_ids.extend(r.draft_token_ids)
            host.positions.extend(range(start, start + q))
            host.slot_mapping.extend(
                r.pages[p // ps] * ps + p % ps for p in range(start, start + q)
            )
            host.seq_lens.append(start + q)
            host.q_lens.append(q)
            host.block_tables.append(r.pages)
        return host

    # ----- helpers -----
    def _set_drafts(self, requests: list[Request], values: list[int] | None) -> None:
        k = self.k
        for i, r in enumerate(requests):
            r.draft_token_ids = values[i * k : (i + 1) * k] if values is not None else []

    @staticmethod
    def _errors(result: StepResult, finite: list[int]) -> None:
        if not all(finite):
            result.errors = [None if ok else NONFINITE_LOGITS for ok in finite]

    @staticmethod
    def _logprobs(result: StepResult, out, lens: list[int], stride: int) -> None:
        lp, ranks = out.logprobs.tolist(), out.ranks.tolist()

        def cut(values: list) -> list[list]:
            return [values[i * stride : i * stride + n] for i, n in enumerate(lens)]

        result.logprobs, result.ranks = cut(lp), cut(ranks)
        if out.top_ids is not None:
            result.top_ids = cut(out.top_ids.tolist())
            result.top_logprobs = cut(out.top_logprobs.tolist())
