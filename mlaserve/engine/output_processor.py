"""Turns a step's tokens into request outputs: append, detokenize, check stops, stream.

Runs on the host after each step's read-back (`LLMEngine._postprocess`). A request that ends
here is finished in the scheduler (its pages and slot are released) and dropped from the
engine's request table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from mlaserve.engine.prompt_logprobs import PromptLogprobs
from mlaserve.engine.read_back import StepResult
from mlaserve.engine.request import FinishReason, Request
from mlaserve.engine.scheduler import Scheduler, SchedulerOutput
from mlaserve.outputs import CompletionOutput, Logprob, RequestOutput
from mlaserve.sampling_params import RequestOutputKind
from mlaserve.tokenizer import Tokenizer, find_stop, stop_holdback

__all__ = ["OutputProcessor"]

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Per-token host work of the engine's outputs. Holds references, owns nothing: the
    engine's request table (`requests`, entries popped here when their request ends), its
    scheduler (told of each end) and tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        requests: dict[str, Request],
        eos_token_ids: Sequence[int],
        max_model_len: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests = requests
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def record_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """Append a scored prompt span's entries to its request's `prompt_logprobs`."""
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

    def process(self, scheduled: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """The outputs of a step's sampled requests (`result` rows in scheduling order)."""
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
        n_out = len(output_ids)
        stop_token = n_out >= params.min_tokens and (
            (not params.ignore_eos and token in self.eos_token_ids)
            or bool(params.stop_token_ids and token in params.stop_token_ids)
        )
        # The token that stops the request (EOS, a stop_token_ids entry) is not text unless
        # include_stop_str_in_output says so, as in vLLM: with skip_special_tokens=false an
        # EOS would otherwise end every answer.
        if not stop_token or params.include_stop_str_in_output:
            text.append(request.detokenizer.step((token,)))

        grammar = request.grammar
        end: tuple[FinishReason, int | str | None] | None = None  # (reason, stop_reason)
        if grammar is not None and not grammar.accept_token(token):
            # Only reachable if every allowed token was banned too (e.g. min_tokens vs EOS).
            logger.warning("request %s: token %d breaks its grammar", request.request_id, token)
            end = (FinishReason.STOP, None)
        elif stop_token:
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
