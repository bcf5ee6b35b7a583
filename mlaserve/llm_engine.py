"""The engine: requests in, tokens out, one `step()` at a time.

    step():  schedule -> run (forward + sample) -> postprocess (append, detokenize, stop)

With overlap scheduling (on with CUDA) `step()` launches its forward and sampling, then reads
back and postprocesses the *previous* step's tokens while the GPU works; the next forward takes
those tokens straight from the device. A request that stops is then computed one step past its
end, and that row's token is dropped.

Not thread-safe: one thread owns an engine (the HTTP service runs it in its own thread).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mlaserve.config import EngineConfig, ModelConfig
from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.grammar import GrammarBackend, GrammarError
from mlaserve.engine.model_runner import ModelRunner, PendingSample, StepResult
from mlaserve.engine.overlap import StepLedger
from mlaserve.engine.prompt_logprobs import PromptLogprobs
from mlaserve.engine.request import FinishReason, Request
from mlaserve.engine.scheduler import Scheduler, SchedulerOutput
from mlaserve.graph_runner import CaptureReport, CompileWatch, CudaGraphRunner
from mlaserve.kv_cache import PageAllocator
from mlaserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mlaserve.sampling_params import RequestOutputKind, SamplingParams
from mlaserve.spec import (
    Decision,
    MTPDrafter,
    SpecDecoder,
    SpecPolicy,
    StepCosts,
    measure_engine_step_costs,
)
from mlaserve.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, stop_holdback

__all__ = ["STEP_HISTORY", "EngineStats", "InvalidRequestError", "LLMEngine"]

STEP_HISTORY = 4096  # steps whose token counts EngineStats carries

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    # Running totals since start-up (the metrics layer turns them into counters).
    num_graph_replays: int = 0
    num_piecewise_replays: int = 0  # EXTEND forwards from piecewise graphs
    num_eager_steps: dict[str, int] = field(default_factory=dict)  # by reason
    num_compiles_while_serving: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # Tokens (prompt + generated) each of the last steps ran, newest last, at most
    # STEP_HISTORY of them: whoever reads stats less often than every step (the engine process
    # sends them every STATS_INTERVAL_S) still sees every step since its last read.
    recent_step_num_tokens: tuple[int, ...] = ()
    # Speculative decoding running totals (zero when it is off): verify steps (one per request
    # per step), draft tokens proposed, accepted drafts per draft position, and how many verify
    # steps emitted n tokens (bonus included).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_accept_lengths: dict[int, int] = field(default_factory=dict)
    # The policy's per-step decisions ("on:pays", "off:cap", ... -> steps) and its running
    # accept-length estimate (what it compares with the measured break-even).
    spec_decisions: dict[str, int] = field(default_factory=dict)
    spec_accept_length_estimate: float = 0.0
    # The policy's current break-even accept length per captured batch size (its costs follow
    # the served steps); empty while unmeasured (CPU, graphs off).
    spec_break_even: dict[int, float] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_pages / max(self.num_total_pages, 1)


def _without_finished(scheduled: SchedulerOutput) -> SchedulerOutput:
    """`scheduled` less the requests that ended since it was built (their pages are released):
    an overlapped step, launched before the previous step's tokens are read back, runs them
    (their extra token is dropped); a step launched after that read-back (a synchronous or a
    speculative one) must not."""
    if not any(s.request.is_finished for s in scheduled.scheduled):
        return scheduled
    return SchedulerOutput(
        [s for s in scheduled.scheduled if not s.request.is_finished],
        scheduled.preempted,
        [r for r in scheduled.admitted if not r.is_finished],
    )


@dataclass
class _InFlight:
    """A launched step the host has not waited on yet: its sampled tokens are still on the
    device, or (it samples nothing) its fence has not been waited on."""

    scheduled: SchedulerOutput
    sample: PendingSample
    step: int  # its `StepLedger` id

    @property
    def samples(self) -> bool:
        """Whether it sampled tokens (whose read-back may end requests)."""
        return self.sample.read_back is not None


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.max_model_len = config.resolved_max_model_len(self.model_config)
        self.model_name = config.served_model_name or config.model or "mlaserve-default"
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer_path)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.compile_watch = CompileWatch()
        t0 = time.perf_counter()
        self.runner = ModelRunner(config, self.model_config, self.eos_token_ids)
        self.load_time_s = time.perf_counter() - t0
        self.graph_report: CaptureReport | None = None
        self.spec_costs: StepCosts | None = None
        use_graphs = config.resolved_cuda_graph()
        spec = config.speculative
        # With speculation a decode step is a VERIFY of k+1 tokens per request, or a plain
        # DECODE when the policy says speculation does not pay; both graphed.
        shapes = [(ForwardMode.DECODE, 1)]
        if spec is not None:
            shapes.append((ForwardMode.VERIFY, spec.k + 1))
        self.graphs = CudaGraphRunner(
            self.runner,
            config.resolved_cuda_graph_batch_sizes() if use_graphs else (),
            use_graphs=use_graphs,
            shapes=shapes,
            piecewise_max_tokens=config.resolved_piecewise_cuda_graph_max_tokens(),
        )
        self.spec_decoder: SpecDecoder | None = None
        if spec is not None:
            drafter = MTPDrafter(self.runner, spec.k)
            policy = SpecPolicy(spec.k, disable_batch_size=config.speculative_disable_batch_size)
            self.spec_decoder = SpecDecoder(self.runner, self.graphs, drafter, spec.k, policy)
        self.allocator = PageAllocator(self.runner.num_pages)
        self.scheduler = Scheduler(
            self.allocator,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_lookahead_tokens=config.num_lookahead_tokens,
        )
        self.requests: dict[str, Request] = {}
        self.grammar: GrammarBackend | None = None  # built for the first structured request
        self._grammar_lock = threading.Lock()  # compile_grammar may run on another thread
        self.num_grammar_compiles_on_add = 0  # structured requests compiled inside add_request
        self.num_steps = 0  # forwards run
        self.recent_step_num_tokens: deque[int] = deque(maxlen=STEP_HISTORY)
        self._seed_rng = random.Random(config.seed)
        self.overlap = config.resolved_overlap_schedule()
        # At most one launched step is not yet waited on (overlap rule 1, engine/overlap.py).
        self.ledger = StepLedger()
        self._inflight: _InFlight | None = None  # the launched step not yet waited on

    # ----- requests -----
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        grammar: Any | None = None,
    ) -> None:
        """`grammar`: the matcher `compile_grammar(params)` made ahead of time for a structured
        request (compiled here otherwise)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        self._validate(token_ids, params, max_tokens)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(63),
            max_tokens=max_tokens,
            arrival_time=arrival_time or time.time(),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens
            ),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.structured_outputs is not None:
            if grammar is None:
                self.num_grammar_compiles_on_add += 1
                grammar = self.compile_grammar(params)
            request.grammar = grammar
        request.metrics = RequestMetrics(
            arrival_time=request.arrival_time, num_prompt_tokens=len(token_ids)
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """A fresh grammar matcher for `params.structured_outputs` (InvalidRequestError for a
        schema xgrammar refuses). Compiling takes milliseconds for a small vocabulary and tens
        of them for DeepSeek's 129k tokens; the first call also builds xgrammar's tokenizer
        tables (seconds there). Thread-safe: the server's engine process calls it on its command
        thread, so the engine loop keeps stepping meanwhile, and passes the matcher to
        `add_request`."""
        self._refuse_with_speculation(params)
        try:
            with self._grammar_lock:
                if self.grammar is None:
                    self.grammar = GrammarBackend(
                        self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                    )
            return self.grammar.matcher(params.structured_outputs)
        except GrammarError as e:
            raise InvalidRequestError(f"structured_outputs: {e}", "structured_outputs") from None

    def _refuse_with_speculation(self, params: SamplingParams) -> None:
        if self.spec_decoder is not None:
            # The speculative loop samples and verifies on the device without the grammar mask
            # and keeps no prompt-logprob rows: refused rather than silently ignored.
            for name in ("prompt_logprobs", "structured_outputs"):
                if getattr(params, name) is not None:
                    raise InvalidRequestError(
                        f"{name}: not supported with speculative decoding (start the server "
                        "without --speculative-config / --num-speculative-tokens)",
                        name,
                    )

    def _validate(self, token_ids: list[int], params: SamplingParams, max_tokens: int) -> None:
        self._refuse_with_speculation(params)
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("prompt: must contain at least one token", "prompt")
        vocab = self.model_config.vocab_size
        # min / max run in C (a 2048-token prompt's check: ~10 us, not ~55 scanning in Python)
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise InvalidRequestError(
                f"prompt: token id {bad} is outside the vocabulary [0, {vocab})", "prompt"
            )
        try:
            params.check_vocab(vocab)
        except ValueError as e:
            raise InvalidRequestError(str(e), "stop_token_ids") from None
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt: {n} tokens leave no room to generate within max_model_len "
                f"{self.max_model_len}",
                "prompt",
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens: {params.max_tokens} + {n} prompt tokens exceeds max_model_len "
                f"{self.max_model_len}",
                "max_tokens",
            )
        total = n + max_tokens
        if (
            self.scheduler.num_pages_for(total + self.scheduler.num_lookahead_tokens)
            > self.allocator.num_usable_pages
        ):
            raise InvalidRequestError(
                f"prompt: {total} tokens need more KV pages than the cache holds "
                f"({self.allocator.num_usable_pages} pages of {self.config.page_size})",
                "prompt",
            )

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            request.finish_reason = FinishReason.ABORT
            self.scheduler.finish(request)

    def has_unfinished_requests(self) -> bool:
        if self.scheduler.has_unfinished():
            return True
        # A step in flight whose requests all ended (aborted) is resolved by the next step.
        step = self._inflight
        return step is not None and any(not r.is_finished for r in step.scheduled.sampled_requests)

    def get_stats(self) -> EngineStats:
        spec = self.spec_decoder.stats if self.spec_decoder is not None else None
        policy = self.spec_decoder.policy if self.spec_decoder is not None else None
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_pages=self.allocator.num_free_pages,
            num_total_pages=self.allocator.num_usable_pages,
            num_graph_replays=self.graphs.num_replays,
            num_piecewise_replays=self.graphs.piecewise.num_replays if self.graphs.piecewise else 0,
            num_eager_steps=dict(self.graphs.num_eager_steps),
            num_compiles_while_serving=self.compile_watch.compiles_since_ready,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            recent_step_num_tokens=tuple(self.recent_step_num_tokens),
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_accepted_per_pos=list(spec.accepted_per_pos) if spec else [],
            spec_accept_lengths=dict(spec.accept_lengths) if spec else {},
            spec_decisions=(
                {f"{'on' if on else 'off'}:{why}": n for (on, why), n in policy.decisions.items()}
                if policy
                else {}
            ),
            spec_accept_length_estimate=policy.accept_length_estimate if policy else 0.0,
            spec_break_even=(
                {b: policy.costs.break_even(b) for b in policy.costs.plain_s}
                if policy is not None and policy.costs is not None
                else {}
            ),
        )

    # ----- the loop -----
    def step(self) -> list[RequestOutput]:
        """schedule -> (draft) run (verify, accept) -> postprocess. With overlap scheduling the
        step is launched, then the previous step's tokens are read back and postprocessed while
        the GPU runs it: the outputs returned are the previous step's. A step that samples
        nothing (a prompt chunk) stays in flight the same way, in either mode, until the next
        step has been launched; at most one step is ever in flight (engine/overlap.py)."""
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return self._resolve(prev) if prev is not None else []
        now = time.time()
        for r in scheduled.admitted:  # queue time ends here, before the forward
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
        self.num_steps += 1
        self.recent_step_num_tokens.append(scheduled.num_tokens)
        overlap = self.overlap and not self._needs_host_tokens(scheduled)
        spec = self.spec_decoder
        # With speculation only plain steps (no draft work) overlap: the rest read their tokens
        # back before the next step can be built, and need every earlier token on the host.
        decision = spec.plan(scheduled) if spec is not None and overlap else None
        # the speculative decoder runs every step but the plain ones it overlaps
        by_spec = spec is not None and not (decision is not None and decision.plain)
        outputs = []
        if prev is not None and prev.samples and (by_spec or not overlap):
            # Read back first; those tokens may end requests this step has scheduled.
            outputs, prev = self._resolve(prev), None
            scheduled = _without_finished(scheduled)
            if scheduled.is_empty:
                return outputs
        if by_spec:
            done, self._inflight = self._run_spec(scheduled, decision)
            if prev is not None:  # a step that sampled nothing: only its fence to wait on
                outputs += self._resolve(prev)
            # the step's wall time feeds the policy's online costs
            spec.observe_step_time(time.perf_counter() - t0)
            return outputs + done
        launched = self._launch(scheduled, prev)
        if prev is not None:
            outputs += self._resolve(prev)  # the host's work, while the GPU runs `launched`
        if spec is not None:  # a plain step's wall time, overlapped as the policy will serve it
            spec.observe_step_time(time.perf_counter() - t0)
        if overlap or not launched.samples:
            self._inflight = launched
            return outputs
        return outputs + self._resolve(launched)

    def _run_spec(
        self, scheduled: SchedulerOutput, decision: Decision | None
    ) -> tuple[list[RequestOutput], _InFlight | None]:
        """One step of the speculative decoder -> (its outputs, the step if still in flight).
        Synchronous when it samples (its read-back is its wait); one that samples nothing is
        left in flight with a fence, as a plain engine's is."""
        step = self.ledger.launch()
        result, num_accepted = self.spec_decoder.step(scheduled, decision)
        self.scheduler.after_step(scheduled, num_accepted)
        if not scheduled.sampled_requests:
            return [], _InFlight(scheduled, PendingSample(None, None, self.runner.fence()), step)
        self.ledger.waited(step)
        return self._postprocess(scheduled, result), None

    @staticmethod
    def _needs_host_tokens(scheduled: SchedulerOutput) -> bool:
        """Whether a step must not overlap its neighbours: a grammar masks with the matcher
        that accepted the previous token; logprobs read extra device rows back."""
        return any(
            r.grammar is not None
            or r.params.logprobs is not None
            or r.params.prompt_logprobs is not None
            for r in (s.request for s in scheduled.scheduled)
        )

    def _launch(self, scheduled: SchedulerOutput, prev: _InFlight | None) -> _InFlight:
        """Forward and sample on the device; the sampled tokens stay pending there."""
        step = self.ledger.launch()
        host = self.runner.build_host_batch(
            scheduled,
            prev.sample.feed if prev is not None else None,
            prev.step if prev is not None else None,
        )
        target = self.graphs.run_with_hidden(host)
        logits = target.logits[: target.num_rows]
        if host.prompt_spans:
            for scored in self.runner.prompt_logprobs(logits, host):
                self._record_prompt_logprobs(scored)
        sample = self.runner.sample_async(logits, scheduled, self.grammar, target.greedy)
        self.scheduler.after_step(scheduled)
        for row, r in enumerate(scheduled.sampled_requests):
            r.num_pending_tokens += 1
            r.pending_row = row
            r.pending_step = step
        return _InFlight(scheduled, sample, step)

    def _resolve(self, step: _InFlight) -> list[RequestOutput]:
        """Read a launched step's tokens back (its one host sync; a fence for a step that
        sampled nothing) and postprocess them."""
        result = step.sample.result()
        self.ledger.waited(step.step)
        for r in step.scheduled.sampled_requests:
            r.num_pending_tokens -= 1
        return self._postprocess(step.scheduled, result)

    def drain(self) -> list[RequestOutput]:
        """Resolve the step still in flight (overlap scheduling), if any."""
        prev, self._inflight = self._inflight, None
        return self._resolve(prev) if prev is not None else []

    def _record_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        piece = self.tokenizer.id_to_piece
        recorded = scored.span.request.prompt_logprobs
        for j, token in enumerate(scored.span.targets):
            entry = {token: Logprob(scored.logprobs[j], scored.ranks[j], piece(token))}
            if scored.top_ids is not None:
                k = scored.span.request.params.prompt_logprobs or 0
                top = zip(scored.top_ids[j][:k], scored.top_logprobs[j][:k])
                for rank, (t, lp) in enumerate(top, 1):
                    entry.setdefault(t, Logprob(lp, rank, piece(t)))
            recorded.append(entry)

    def warmup(self) -> None:
        """Everything that compiles or allocates lazily happens here, before serving: a
        throwaway request (prefill + decode + sampling), then every graph shape eagerly and its
        capture. Logs the start-up time split."""
        t0 = time.perf_counter()
        prompt = list(range(min(16, self.model_config.vocab_size)))[: self.max_model_len - 2]
        self.add_request("__warmup__", prompt, SamplingParams(max_tokens=2, temperature=0.0))
        while self.requests.get("__warmup__") is not None:
            self.step()
        self.drain()
        t1 = time.perf_counter()
        if self.spec_decoder is not None:
            self.spec_decoder.reset_stats()  # the throwaway request is not served traffic
        report = self.graphs.capture() if self.graphs.batch_sizes else None
        self.graph_report = report
        pw = report.piecewise if report else None
        if self.spec_decoder is not None and report is not None:
            self._capture_spec()
        self.compile_watch.mark_ready()
        logger.info(
            "start-up: load %.2f s, warm-up %.2f s, capture %.2f s (%s)",
            self.load_time_s,
            t1 - t0 + (report.warmup_s + (pw.warmup_s if pw else 0.0) if report else 0.0),
            report.capture_s + (pw.capture_s if pw else 0.0) if report else 0.0,
            f"{report.num_graphs} CUDA graphs"
            + (f" + {pw.num_graphs} prefill pieces" if pw else "")
            + f", pools {(report.pool_bytes + (pw.pool_bytes if pw else 0)) / 2**20:.1f} MiB"
            if report
            else "CUDA graphs off",
        )
        if self.spec_decoder is not None:
            logger.info(
                "speculative decoding: MTP chain draft, k=%d (verify q_len %d)",
                self.spec_decoder.k,
                self.spec_decoder.k + 1,
            )

    def _capture_spec(self) -> None:
        """The draft's graphs (after, and into the pool of, the target's), then the measured
        step costs the policy decides from."""
        dec = self.spec_decoder
        if dec is None or not isinstance(dec.drafter, MTPDrafter):
            return
        t0 = time.perf_counter()
        num = dec.drafter.capture(self.graphs, (1, dec.k + 1))
        t1 = time.perf_counter()
        costs = measure_engine_step_costs(self)
        dec.reset_stats()  # the measurement's requests are not served traffic
        dec.policy.costs = costs
        self.spec_costs = costs
        logger.info(
            "speculative decoding: %d draft graphs in %.2f s; break-even accept length per "
            "batch size (speculative / plain engine step, wall time): %s; draft-cache refresh "
            "overhead: %s; prior %.2f",
            num,
            t1 - t0,
            {b: round(costs.break_even(b), 2) for b in costs.plain_s} if costs else "unmeasured",
            {b: f"{costs.refresh_overhead(b):+.1%}" for b in costs.plain_s} if costs else "-",
            dec.policy.prior,
        )

    def _postprocess(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        now = time.time()
        outputs = []
        sampling = scheduled.sampled_requests
        errors = result.errors
        for i, request in enumerate(sampling):
            if request.is_finished:
                # Overlap scheduling ran it one step past its end (or it was aborted while the
                # step ran): the token is not its own.
                continue
            error = errors[i] if errors is not None else None
            if error is not None:
                # A wrong token is worse than none: end the request, say why, append nothing.
                logger.warning("request %s failed: %s", request.request_id, error)
                self._finish(request, FinishReason.ABORT, None)
                out = self._make_output(request, "", now, num_new=0, error=error)
            else:
                # Speculation emits several tokens; stop checks apply to each, the first hit
                # ends the request and the rest are dropped.
                new_text, num_new = "", 0
                for j in range(len(result.token_ids[i])):
                    new_text += self._append_token(request, i, j, result, now)
                    num_new += 1
                    if request.is_finished:
                        break
                out = self._make_output(request, new_text, now, num_new=num_new)
            if out is not None:
                outputs.append(out)
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _append_token(
        self, request: Request, i: int, j: int, result: StepResult, now: float
    ) -> str:
        """Append token j of request i's emitted tokens; check its stop conditions."""
        token = result.token_ids[i][j]
        output_ids = request.output_token_ids
        output_ids.append(token)
        params = request.params
        if request.logprobs is not None:
            request.logprobs.append(self._logprob_entry(token, i, j, result))
            request.cumulative_logprob += result.logprobs[i][j]
        text = request.output_text
        text_before = len(text)
        text.append(request.detokenizer.step((token,)))

        n_out = len(output_ids)
        grammar = request.grammar
        end: tuple[FinishReason, int | str | None] | None = None  # (reason, stop_reason)
        if grammar is not None and not grammar.accept_token(token):
            # Only reachable if every allowed token was banned too (e.g. min_tokens vs EOS).
            logger.warning("request %s: token %d breaks its grammar", request.request_id, token)
            end = (FinishReason.STOP, None)
        elif n_out >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids)
            or (params.stop_token_ids and token in params.stop_token_ids)
        ):
            end = (FinishReason.STOP, token)
        elif (
            n_out >= params.min_tokens
            and params.stop
            and (hit := self._cut_stop(request, text_before)) is not None
        ):
            end = (FinishReason.STOP, hit)
        elif grammar is not None and grammar.is_terminated():
            end = (FinishReason.STOP, token)  # complete (EOS with ignore_eos)
        elif n_out >= request.max_tokens or request.num_prompt_tokens + n_out >= self.max_model_len:
            end = (FinishReason.LENGTH, None)
        if end is not None:
            self._finish(request, *end)
            if not isinstance(request.stop_reason, str):
                text.append(request.detokenizer.flush())
        return self._release_text(request, end is not None)

    def _cut_stop(self, request: Request, text_before: int) -> str | None:
        """The stop string that the text appended after `text_before` characters completes,
        with the text cut there; None if none does."""
        params, text = request.params, request.output_text
        # Only a stop string ending in the new text can complete now: search the new text and
        # the longest stop's length before it, not the whole output.
        start = max(text_before - max(map(len, params.stop)) + 1, 0)
        hit = find_stop(
            text.tail(start),
            len(text) - text_before,
            params.stop,
            params.include_stop_str_in_output,
        )
        if hit is None:
            return None
        text.truncate(start + hit[0])
        return hit[1]

    def _release_text(self, request: Request, finished: bool) -> str:
        """Text safe to stream: hold back what could still turn into a stop string."""
        text, released = request.output_text, request.num_released_chars
        stop = request.params.stop
        held = 0
        if stop and not finished:
            held = stop_holdback(stop, request.params.include_stop_str_in_output)
        upto = max(released, len(text) - held)
        request.num_released_chars = upto
        return text.tail(released)[: upto - released]

    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.finish(request)

    def _logprob_entry(self, token: int, i: int, j: int, result: StepResult) -> dict[int, Logprob]:
        piece = self.tokenizer.id_to_piece
        entry = {token: Logprob(result.logprobs[i][j], result.ranks[i][j], piece(token))}
        if result.top_ids is not None:
            top_ids, top_lps = result.top_ids[i][j], result.top_logprobs[i][j]
            for rank, (t, lp) in enumerate(zip(top_ids, top_lps), 1):
                entry.setdefault(t, Logprob(lp, rank, piece(t)))
        return entry

    def _make_output(
        self,
        request: Request,
        new_text: str,
        now: float,
        num_new: int = 1,
        error: str | None = None,
    ) -> RequestOutput | None:
        """This step's output of `request`, shaped by its `output_kind`: DELTA and FINAL_ONLY
        keep the per-step host work O(new tokens); CUMULATIVE copies everything so far."""
        m = request.metrics
        finished = request.is_finished
        token_ids, logprobs = request.output_token_ids, request.logprobs
        n_out = len(token_ids)
        if num_new:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
        m.num_generation_tokens = n_out
        if finished:
            m.finished_time = now
        kind = request.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            text = new_text
            token_ids = token_ids[n_out - num_new :]
            if logprobs is not None:
                logprobs = logprobs[len(logprobs) - num_new :]
        else:
            text = str(request.output_text)
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        reason = "error" if error is not None else request.finish_reason
        prompt_logprobs = request.prompt_logprobs
        if kind is RequestOutputKind.DELTA and n_out > num_new:
            prompt_logprobs = None  # sent with the first delta
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=(
                        request.cumulative_logprob if request.logprobs is not None else None
                    ),
                    logprobs=logprobs,
                    finish_reason=str(reason) if reason is not None else None,
                    stop_reason=request.stop_reason,
                )
            ],
            finished=finished,
            metrics=m,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            num_new_tokens=num_new,
            new_text=new_text,
            error=error,
        )

    def __repr__(self) -> str:
        return f"LLMEngine(model={self.config.model_path}, requests={len(self.requests)})"
