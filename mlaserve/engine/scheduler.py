"""Continuous batching: which requests run this step, and how many of their tokens.

Each step spends a token budget (`max_num_batched_tokens`): running requests first (a decode
costs one token, an unfinished prefill continues with its next chunk), then waiting requests are
admitted in arrival order while pages and sequence slots last, their prompts chunked to fit the
budget. When a running request needs a page and none is free, the newest running request is
preempted: its pages are freed and it goes back to the front of the queue, to be recomputed
from its prompt and the tokens it already generated.

With speculative decoding (`num_lookahead_tokens` > 0) every scheduled request also gets pages
for that many KV slots past its step (the verify and draft forwards write them), reserved here
before the step, so nothing allocates inside it; admission counts them too. A decode is still
scheduled as one token: the speculative decoder widens it, and `after_step` learns how many
extra tokens each request accepted.

With prefix caching (`prefix`, `engine/prefix_sharing.py`; None when off, and then nothing
below changes) a request admitted without pages first takes the cached pages of its prefix
and starts at num_computed_tokens = their tokens; one whose next page another running request
is computing waits for it, keeping its place in the queue, and the requests behind it are
admitted meanwhile (an n > 1 sibling holds up nothing; FCFS is otherwise kept: a request that
does not fit still stops admission). Freed pages go back through the
allocator's reference counts (cached ones stay findable until evicted), and the engine calls
`commit` once a step's results are on the host to register the full pages it computed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlaserve.engine.forward_batch import ForwardMode
from mlaserve.engine.prefix_sharing import PrefixSharing
from mlaserve.engine.request import Request, RequestStatus
from mlaserve.kv_cache import PageAllocator

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # query tokens this step: [num_computed, num_computed + num_new_tokens)
    # Whether this step ends at the request's last known token, so it samples the next one.
    samples: bool = field(init=False)
    # One new token after a fully computed prompt: the request is decoding. Anything else
    # (a prompt chunk, a recomputation after preemption) is prefill work.
    is_decode: bool = field(init=False)
    # The request's num_computed_tokens once this step is accounted (`after_step`): what the
    # step computed ends there (prefix caching commits up to it when the step resolves).
    computed_end: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens == r.num_tokens
        self.is_decode = (
            self.num_new_tokens == 1
            and self.samples
            and r.num_computed_tokens >= r.num_prompt_tokens
        )


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that got a slot this step (new, or resumed after preemption): their per-slot
    # device state (SamplingSlots.admit) must be written before this step samples.
    admitted: list[Request] = field(default_factory=list)
    # Two outputs with the same id schedule the same requests in the same order (every running
    # request, none of them admitted or preempted since): what lets a steady step skip
    # per-request work. None: a batch not known to equal any other.
    batch_id: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def sampled_requests(self) -> list[Request]:
        """The requests this step samples a token for, in scheduling order (the order of the
        sampler's rows)."""
        return [s.request for s in self.scheduled if s.samples]

    @property
    def mode(self) -> ForwardMode:
        """DECODE when every scheduled request decodes one token; EXTEND when any carries prompt
        (or recomputed) tokens. The attention backend's decode kernel sees only the former."""
        if all(s.is_decode for s in self.scheduled):
            return ForwardMode.DECODE
        return ForwardMode.EXTEND

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead_tokens: int = 0,
        prefix: PrefixSharing | None = None,
    ) -> None:
        self.allocator = allocator
        self.prefix = prefix
        self.num_lookahead_tokens = num_lookahead_tokens
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Oldest first. Finished/aborted requests are removed lazily (see `finish`): the
        # counters say how many finished ones each still holds.
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Free sequence slots (the last freed is reused first). A running request holds one, so
        # len(running) < max_num_seqs means one is free.
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._num_finished_waiting = 0
        self._num_finished_running = 0
        self.num_preemptions = 0  # since start-up
        self._batch_id = 0  # `SchedulerOutput.batch_id`: a new one whenever the batch changes
        self._last_whole = False  # whether the last output scheduled the whole running list

    # ----- queue management -----
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.running) - self._num_finished_running

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) - self._num_finished_waiting

    def has_unfinished(self) -> bool:
        return self.num_running > 0 or self.num_waiting > 0

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request's pages now; forget it in O(1).

        Removing it from `running`/`waiting` here would be O(n) per call (a thousand aborts at
        once: O(n^2)). It is marked FINISHED instead and dropped by the next `schedule()`, which
        walks the running list anyway; a finished waiting request is dropped when it reaches
        the front of the queue. Order (oldest first) is unchanged.
        """
        if request.status is RequestStatus.RUNNING:
            self._num_finished_running += 1
        elif request.status is RequestStatus.WAITING:
            self._num_finished_waiting += 1
        self._free_pages(request)
        self._free_slot(request)
        request.status = RequestStatus.FINISHED

    def _drop_finished(self) -> bool:
        """-> whether the running list changed."""
        dropped = bool(self._num_finished_running)
        if dropped:
            self.running = [r for r in self.running if not r.is_finished]
            self._num_finished_running = 0
        while self.waiting and self.waiting[0].is_finished:
            self.waiting.popleft()
            self._num_finished_waiting -= 1
        return dropped

    # ----- scheduling -----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        changed = self._drop_finished()

        # 1) Running requests, oldest first; preempt the newest when pages run out.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending_tokens and request.num_output_tokens >= request.max_tokens:
                i += 1  # its token still on the device is its last (overlap scheduling)
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._reserve(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; nothing newer is left running

        # 2) Admit waiting requests while budget, slots and pages last (none were preempted).
        # Requests waiting for a page another request is computing step aside (`parked`) and
        # go back to the front, in order, at the end: they hold their place, not the queue.
        parked: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if out.preempted:
                break
            request = self.waiting[0]
            if request.is_finished:  # aborted while waiting
                self.waiting.popleft()
                self._num_finished_waiting -= 1
                continue
            if request.num_pending_tokens:
                # Preempted with its last token still on the device: its recomputation needs
                # that token on the host first (overlap rule 5, engine/overlap.py).
                break
            hit, prefix = None, self.prefix
            if prefix is not None and not request.pages:
                hit = prefix.lookup(request)
                if hit is None:  # its next page is being computed by a running request
                    parked.append(self.waiting.popleft())
                    continue
                prefix.attach(request, hit)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, num_new):
                if prefix is not None and hit is not None:
                    prefix.detach(request)
                break
            if prefix is not None and hit is not None:
                prefix.admitted(request, hit)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.slot = self._free_slots.pop()
            self.running.append(request)
            out.admitted.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(parked))
        # The same batch as the last output's: both scheduled the whole running list (no request
        # left out by the budget or a pending last token), and the list did not change since.
        whole = len(out.scheduled) == len(self.running)
        if not (whole and self._last_whole) or changed or out.preempted or out.admitted:
            self._batch_id += 1
        self._last_whole = whole
        out.batch_id = self._batch_id
        return out

    def after_step(self, out: SchedulerOutput, num_accepted: list[int] | None = None) -> None:
        """The forward wrote KV for every scheduled token. `num_accepted` (speculation): per
        sampled request, in scheduling order, the draft tokens it accepted, whose KV the
        verify forward wrote as well."""
        sampled = 0
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                if num_accepted is not None and s.is_decode:
                    s.request.num_computed_tokens += num_accepted[sampled]
                sampled += 1
            s.computed_end = s.request.num_computed_tokens

    def commit(self, out: SchedulerOutput) -> None:
        """Prefix caching: `out`'s step has been waited on (its results are on the host):
        register the full pages its requests computed. Requests that ended or were preempted
        since are skipped (their pages are gone; a preempted one's num_computed_tokens restarts
        below computed_end). Only tokens whose ids are on the host are keyed."""
        prefix = self.prefix
        if prefix is None:
            return
        for s in out.scheduled:
            r = s.request
            if r.status is not RequestStatus.RUNNING:
                continue
            known = r.num_prompt_tokens + len(r.output_token_ids)
            prefix.commit(r, min(s.computed_end, r.num_computed_tokens, known))

    # ----- pages -----
    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve(self, request: Request, num_new: int) -> bool:
        """Make sure pages exist for the request's KV up to num_computed + num_new tokens."""
        total = request.num_computed_tokens + num_new + self.num_lookahead_tokens
        needed = self.num_pages_for(total) - len(request.pages)
        if needed <= 0:
            return True
        if not self.allocator.can_allocate(needed):
            return False
        request.pages.extend(self.allocator.allocate(needed))
        return True

    def _free_pages(self, request: Request) -> None:
        if self.prefix is not None:
            self.prefix.release(request)
        if request.pages:
            # With prefix caching the last page goes first: the LRU then evicts a chain from
            # its tail, and the prefix that stays cached keeps its head (vLLM's order).
            pages = request.pages if self.prefix is None else request.pages[::-1]
            self.allocator.free(pages)
            request.pages = []

    def _free_slot(self, request: Request) -> None:
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self._free_pages(request)
        self._free_slot(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        if request.metrics is not None:
            request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
