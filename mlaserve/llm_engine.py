"""The engine: requests in, tokens out, one `step()` at a time.

    step():  schedule -> (draft) run (forward + sample) (verify, accept) -> postprocess

The run is `ModelRunner` and the graph runner (with speculation, `SpecDecoder`); postprocessing
(append, detokenize, stop, the outputs) is `engine/output_processor.py`, request checks
`engine/request_validator.py`, the counters `engine/stats.py`.

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
from typing import Any

import torch

from mlaserve.config import EngineConfig, ModelConfig
from mlaserve.engine.gpu_only_options import ignored_gpu_options
from mlaserve.engine.grammar import GrammarBackend, GrammarError
from mlaserve.engine.output_processor import OutputProcessor
from mlaserve.engine.overlap import StepLedger
from mlaserve.engine.prefix_sharing import PrefixSharing
from mlaserve.engine.read_back import InFlightStep, PendingSample, StepResult
from mlaserve.engine.request import FinishReason, Request
from mlaserve.engine.request_validator import InvalidRequestError, RequestValidator
from mlaserve.engine.scheduler import Scheduler, SchedulerOutput
from mlaserve.engine.stats import STEP_HISTORY, EngineStats
from mlaserve.engine.tp_workers import EngineDeadError, start_runner
from mlaserve.engine_warmup import release_graphs, warm_up
from mlaserve.graph_runner import CaptureReport, CompileWatch, CudaGraphRunner
from mlaserve.jit_cache import apply_jit_cache
from mlaserve.outputs import RequestMetrics, RequestOutput
from mlaserve.sampling_params import SamplingParams
from mlaserve.spec import (
    Decision,
    MTPDrafter,
    SpecDecoder,
    SpecPolicy,
    StepCosts,
)
from mlaserve.startup_times import StartupTimes
from mlaserve.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["STEP_HISTORY", "EngineDeadError", "EngineStats", "InvalidRequestError", "LLMEngine"]

logger = logging.getLogger(__name__)


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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Where start-up goes, phase by phase (logged, and on /metrics, once warm-up ends).
        self.startup = StartupTimes()
        # Before anything compiles (and before the TP workers are spawned: they inherit it).
        self.jit_cache = apply_jit_cache(config.cache_dir)
        logger.info(
            "%s",
            self.jit_cache.describe()
            if self.jit_cache is not None
            else "JIT cache: --cache-dir not set; each library's own folder",
        )
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.max_model_len = config.resolved_max_model_len(self.model_config)
        self.model_name = config.served_model_name or config.model or "mlaserve-default"
        with self.startup.phase("tokenizer"):
            # The engine decodes; transformers' import waits for a use that needs it (encoding
            # a text prompt, a chat template, a grammar's vocabulary): `tokenizer.py`.
            self.tokenizer = Tokenizer.from_pretrained(
                config.tokenizer_path,
                trust_remote_code=config.trust_remote_code,
                defer_transformers=True,
            )
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        eos_token_ids = sorted(eos)
        self.compile_watch = CompileWatch()
        device = config.resolved_device()
        for line in ignored_gpu_options(config, device):  # taken, but only a GPU reads them
            logger.warning("%s", line)
        if device.type == "cuda":  # the CUDA context, on its own (else in model construction)
            with self.startup.phase("device_init"):
                torch.empty(1, device=device)
                torch.cuda.synchronize(device)
        # Tensor parallelism: this process is rank 0 (scheduler, step loop, sampling); ranks
        # 1..N-1 are worker processes, running each step's forward with it.
        self.runner, self.tp_workers = start_runner(
            config, self.model_config, eos_token_ids, startup=self.startup
        )
        self.graph_report: CaptureReport | None = None
        self.spec_costs: StepCosts | None = None
        spec = config.speculative
        self.graphs = CudaGraphRunner.for_engine(self.runner, config)
        self.spec_decoder: SpecDecoder | None = None
        if spec is not None:
            drafter = MTPDrafter(self.runner, spec.k)
            policy = SpecPolicy(spec.k, disable_batch_size=config.speculative_disable_batch_size)
            self.spec_decoder = SpecDecoder(
                self.runner, self.graphs, drafter, spec.k, policy,
                extend_drafts=config.enable_prefix_caching,
            )  # fmt: skip
        # One GPU: the kernel warm-up on threads (started with the runner) also compiles the
        # decoder layers at every token count the graphs take; the first capture joins it.
        self.runner.extend_kernel_warm_up(self.graphs.token_counts())
        # Prefix caching (None when off: `PrefixSharing.build`).
        self.allocator, prefix = PrefixSharing.build(config, self.runner.num_pages)
        self.scheduler = Scheduler(
            self.allocator,
            page_size=config.page_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_lookahead_tokens=config.num_lookahead_tokens,
            prefix=prefix,
        )
        self.requests: dict[str, Request] = {}
        self.validator = RequestValidator(
            self.model_config.vocab_size,
            self.max_model_len,
            self.scheduler,
            self.allocator,
        )
        self.output = OutputProcessor(
            self.tokenizer, self.scheduler, self.requests, eos_token_ids, self.max_model_len
        )
        self.grammar: GrammarBackend | None = None  # built for the first structured request
        self._grammar_lock = threading.Lock()  # compile_grammar may run on another thread
        self.num_grammar_compiles_on_add = 0  # structured requests compiled inside add_request
        self.num_steps = 0  # forwards run
        self.num_scheduled_tokens = 0  # tokens those forwards computed (prompt + decode)
        self.recent_step_num_tokens: deque[int] = deque(maxlen=STEP_HISTORY)
        self._seed_rng = random.Random(config.seed)
        self.overlap = config.resolved_overlap_schedule()
        # At most one launched step is not yet waited on (overlap rule 1, engine/overlap.py).
        self.ledger = StepLedger()
        self._inflight: InFlightStep | None = None  # the launched step not yet waited on

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a request (the model's and the tokenizer's EOS), sorted; the stop
        check reads them where they live, in the output processor."""
        return self.output.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.output.eos_token_ids = ids

    # ----- requests -----
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        grammar: Any | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """`grammar`: the matcher `compile_grammar(params)` made ahead of time for a structured
        request (compiled here otherwise). `cache_salt` (vLLM's name): with prefix caching,
        requests share cached pages only with requests of the same salt."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(
                f"cache_salt: expected a non-empty string, got {cache_salt!r}", "cache_salt"
            )
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        max_tokens = params.max_tokens or self.max_model_len - len(token_ids)
        self._refuse_with_speculation(params)
        self.validator.validate(token_ids, params, max_tokens)
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
            cache_salt=cache_salt,
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
            self.validator.refuse_with_speculation(params)

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
        cache = self.allocator.cache
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
            startup_seconds=self.startup.phase_seconds(),
            spec_break_even=(
                {b: policy.costs.break_even(b) for b in policy.costs.plain_s}
                if policy is not None and policy.costs is not None
                else {}
            ),
            prefix_cache_queries=cache.num_queried_tokens if cache is not None else 0,
            prefix_cache_hits=cache.num_hit_tokens if cache is not None else 0,
        )

    def reset_prefix_cache(self) -> int:
        """vLLM's reset_prefix_cache: forget every cached key; the cached pages no request
        holds become free. -> how many pages were freed (0 with prefix caching off). Pages of
        running requests stay theirs, uncached."""
        return self.allocator.reset_cache()

    # ----- the loop -----
    def step(self) -> list[RequestOutput]:
        """One engine step (`_step`); under tensor parallelism guarded by the workers
        (`TPWorkers.run_step`: a failed rank is `EngineDeadError`)."""
        workers = self.tp_workers
        return self._step() if workers is None else workers.run_step(self._step)

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a tensor-parallel rank exited or a node went silent since
        the last step (nothing on one rank). The engine process calls it while idle: a group
        that dies between requests is reported then, not at the next request."""
        if self.tp_workers is not None:
            self.tp_workers.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing on one rank); the engine cannot step after.
        Also runs when the engine is collected or the interpreter exits. An engine stopped
        before its warm-up first lets the background kernel warm-up end (one GPU)."""
        if getattr(self, "runner", None) is not None and self.runner.kernel_warm_up is not None:
            try:
                self.runner.join_kernel_warm_up()
            except Exception as e:  # its failure would have been raised at warm-up
                logger.warning("kernel warm-up failed: %s", e)
        if self.tp_workers is not None:
            # Graphs go first: one that captured NCCL collectives hangs the group's teardown.
            if self.tp_workers.dead is None:
                try:
                    self.release_graphs()
                except Exception as e:  # a faulted device: stopping the workers comes first
                    logger.warning("releasing the CUDA graphs failed: %s", e)
            self.tp_workers.stop()

    def release_graphs(self) -> None:
        """Destroy every CUDA graph this engine captured (`engine_warmup.release_graphs`)."""
        release_graphs(self)

    def _step(self) -> list[RequestOutput]:
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
        self.num_scheduled_tokens += scheduled.num_tokens
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
    ) -> tuple[list[RequestOutput], InFlightStep | None]:
        """One step of the speculative decoder -> (its outputs, the step if still in flight).
        Synchronous when it samples (its read-back is its wait); one that samples nothing is
        left in flight with a fence, as a plain engine's is."""
        step = self.ledger.launch()
        result, num_accepted = self.spec_decoder.step(scheduled, decision)
        self.scheduler.after_step(scheduled, num_accepted)
        if not scheduled.sampled_requests:
            return [], InFlightStep(scheduled, PendingSample(None, None, self.runner.fence()), step)
        self.ledger.waited(step)
        self.scheduler.commit(scheduled)  # its read-back came after its MTP KV writes
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

    def _launch(self, scheduled: SchedulerOutput, prev: InFlightStep | None) -> InFlightStep:
        """Forward and sample on the device; the sampled tokens stay pending there."""
        step = self.ledger.launch()
        host = self.runner.build_host_batch(
            scheduled,
            prev.sample.feed if prev is not None else None,
            prev.step if prev is not None else None,
        )
        # Under TP with overlap, the workers get the sampled ids on the device (their next
        # step's future ids): the forward's message announces them, `feed_workers` sends them.
        feed = len(scheduled.sampled_requests) if self.overlap else 0
        # ... or read them from their own graph's argmax, where that is what rank 0 samples
        greedy_feed = feed > 0 and self.runner.takes_graph_greedy(scheduled, self.grammar)
        target = self.graphs.run_with_hidden(host, feed, greedy_feed)
        logits = target.logits[: target.num_rows]
        if host.prompt_spans:
            for scored in self.runner.prompt_logprobs(logits, host):
                self.output.record_prompt_logprobs(scored)
        sample = self.runner.sample_async(logits, scheduled, self.grammar, target.greedy)
        self.runner.feed_workers(sample.feed, feed, target.greedy if target.greedy_feed else None)
        self.scheduler.after_step(scheduled)
        for row, r in enumerate(scheduled.sampled_requests):
            r.num_pending_tokens += 1
            r.pending_row = row
            r.pending_step = step
        return InFlightStep(scheduled, sample, step)

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Read a launched step's tokens back (its one host sync; a fence for a step that
        sampled nothing) and postprocess them."""
        result = step.sample.result()
        self.ledger.waited(step.step)
        # The step is done on the device: its full pages may now be found by others.
        self.scheduler.commit(step.scheduled)
        for r in step.scheduled.sampled_requests:
            r.num_pending_tokens -= 1
        return self._postprocess(step.scheduled, result)

    def drain(self) -> list[RequestOutput]:
        """Resolve the step still in flight (overlap scheduling), if any."""
        prev, self._inflight = self._inflight, None
        return self._resolve(prev) if prev is not None else []

    def warmup(self) -> None:
        """Everything that compiles or allocates lazily happens here, before serving
        (`engine_warmup.warm_up`): a throwaway request, every graph shape and its capture."""
        warm_up(self)

    def _postprocess(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        return self.output.process(scheduled, result)

    def __repr__(self) -> str:
        return f"LLMEngine(model={self.config.model_path}, requests={len(self.requests)})"
