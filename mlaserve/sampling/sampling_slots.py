"""Per-request sampling state kept on the device, indexed by a slot in [0, max_num_seqs).

`SamplingBatch.build` rebuilds every row from host lists, scattering each penalised request's
whole prompt and output into fresh [n, V] tensors: O(total tokens) of host work and transfer per
step. Here each request's state is written once, when it is admitted to a slot:

- params: `_floats [S, 6]` float32 (temperature, top_p, min_p, repetition, frequency, presence)
  and `_ints [S, 3]` int64 (top_k, seed, is_greedy), in the neutral values `SamplingBatch.build` uses;
- `prompt_mask [S, V]` bool, the tokens of the prompt (read only by repetition penalties);
- `output_counts [S, V]` float32, how often each token was generated. `record` adds the tokens
  sampled in a step ON THE DEVICE (a scatter-add of the sampled ids), so no token list ever
  travels back from the host.

A step then copies only the step of each row (one pinned [n] int64 copy) and, when penalties
are on, gathers its rows' [n, V] output counts. The rows' params are gathered (two index
kernels, plus the prompt mask with a repetition penalty) once per row order, while the batch
keeps the same requests in the same rows: from one admission or finish to the next.
Which optional stages run (top-k, penalties, logprobs, min_tokens bans) is still decided on the
host, from the params mirrored per slot, so the sampler never asks the device.

Memory, S = max_num_seqs, V = vocab: the params are 48 B per slot. The penalty buffers are
S * V * 5 bytes (float32 counts + bool mask): 41.4 MB for V = 129280, S = 64 (33.1 MB counts +
8.3 MB mask). They are allocated lazily, when the first request with a penalty is admitted (or
up front by `reserve_penalties`), since most deployments never use penalties. Float32 counts are
exact up to 2**24 occurrences and are what the penalty arithmetic consumes, so no per-step cast.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlaserve.row_fences import RowFences
from mlaserve.sampling.random import to_int64
from mlaserve.sampling.sampling_batch import SamplingBatch, check_ids, host_switches
from mlaserve.sampling_params import SamplingParams

__all__ = ["SamplingSlots"]

_TEMP, _TOP_P, _MIN_P, _REP, _FREQ, _PRES = range(6)
_TOP_K, _SEED, _GREEDY = range(3)
_MAX_ROW_ORDERS = 8  # cached row orders (a speculative step alternates two or so)


@dataclass(frozen=True, slots=True)
class _Rows:
    """What a batch of one row order reuses from step to step."""

    template: SamplingBatch  # every field but steps, output_counts and the min_tokens bans
    index: torch.Tensor  # [n] int64 device: the slots (the batch's `slots`)
    penalised: bool  # some row uses a penalty: the output counts are gathered per step
    bans: list[tuple[int, int, tuple[int, ...]]]  # (row, min_tokens, ids banned below it)
    # Every row greedy, no penalty, no min_tokens ban: nothing in the batch changes from step
    # to step (no row draws noise, so no step is read), and the template is every step's batch.
    fixed: bool


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class SamplingSlots:
    def __init__(
        self,
        max_num_seqs: int,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """eos_token_ids: the model's EOS ids, banned (with each request's stop_token_ids) while
        a request is below its min_tokens, unless it sets ignore_eos."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        check_ids("eos_token_ids", eos_token_ids, vocab_size)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self._floats = torch.zeros(max_num_seqs, 6, dtype=torch.float32, device=self.device)
        self._ints = torch.zeros(max_num_seqs, 3, dtype=torch.int64, device=self.device)
        # Host mirror: the switches and the min_tokens bans are decided from it.
        self._params: list[SamplingParams | None] = [None] * max_num_seqs
        self._bans: list[tuple[int, ...]] = [()] * max_num_seqs
        self.prompt_mask: torch.Tensor | None = None  # [S, V] bool, lazily
        self.output_counts: torch.Tensor | None = None  # [S, V] float32, lazily
        pin = self.device.type == "cuda"
        # Two pinned staging rows used in turn: the copy of step t may still be in flight while
        # step t + 1 is being prepared. A row is rewritten only once its last copy is done
        # (overlap rule 2, mlaserve/engine/overlap.py): under the engine's one step in flight
        # that wait never blocks.
        self._staging = [
            torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        ]
        self._staging_np = [s.numpy() for s in self._staging]
        self._turn = 0
        self.fences = RowFences.for_device(2, self.device)
        # Per row order (the slots of a batch, in order): what `batch` reuses. Cleared by every
        # admit and release, the only changes to what it holds.
        self._rows: dict[tuple[int, ...], _Rows] = {}

    # ----- admission -----
    @property
    def penalty_bytes(self) -> int:
        """Bytes the penalty buffers take (or would take) on the device."""
        return self.max_num_seqs * self.vocab_size * (4 + 1)

    def reserve_penalties(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate the penalty buffers if they are not yet (call it at start-up to take them
        before memory is handed to the KV cache). Returns (output_counts, prompt_mask)."""
        if self.output_counts is None or self.prompt_mask is None:
            shape = (self.max_num_seqs, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    def admit(
        self,
        slot: int,
        params: SamplingParams,
        seed: int,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> None:
        """Write a request's state into `slot` (overwriting whatever was there).

        seed: any Python int (only its low 64 bits matter). output_ids: tokens the request
        already generated (a preempted request resuming); counted for frequency/presence.
        Prompt and output ids are read only when the request uses a penalty.
        """
        self._check_slot(slot)
        check_ids("stop_token_ids", params.stop_ids, self.vocab_size)
        greedy = params.is_greedy
        v = self.vocab_size
        floats = [0.0] * 6
        floats[_TEMP] = 1.0 if greedy else params.temperature
        floats[_TOP_P] = 1.0 if greedy else params.top_p
        floats[_MIN_P] = 0.0 if greedy else params.min_p
        floats[_REP] = params.repetition_penalty
        floats[_FREQ] = params.frequency_penalty
        floats[_PRES] = params.presence_penalty
        top_k = v if greedy or params.top_k == 0 else min(params.top_k, v)
        ints = [top_k, to_int64(seed), int(greedy)]
        self._floats[slot].copy_(self._upload(torch.tensor(floats, dtype=torch.float32)))
        self._ints[slot].copy_(self._upload(torch.tensor(ints, dtype=torch.int64)))
        if _uses_penalties(params):
            counts, mask = self.reserve_penalties()
            mask[slot] = False
            counts[slot] = 0.0
            if params.repetition_penalty != 1.0 and prompt_ids:
                mask[slot, self._ids(prompt_ids, "prompt_ids")] = True
            if output_ids:
                ones = torch.ones(len(output_ids), dtype=torch.float32, device=self.device)
                counts[slot].index_add_(0, self._ids(output_ids, "output_ids"), ones)
        self._params[slot] = params
        self._bans[slot] = self._ban_ids(params)
        self._rows.clear()

    def release(self, slot: int) -> None:
        """The slot's request finished or was preempted; its device rows are simply left behind
        (the next `admit` overwrites what it reads)."""
        self._check_slot(slot)
        self._params[slot] = None
        self._bans[slot] = ()
        self._rows.clear()

    def keeps_logits_greedy(self, params: SamplingParams) -> bool:
        """A row of these params is greedy and nothing changes its logits (no penalty, no
        min_tokens ban): the argmax of the raw logits is its token. A batch of such rows only
        is `fixed`."""
        if not params.is_greedy or _uses_penalties(params):
            return False
        return params.min_tokens == 0 or not self._ban_ids(params)

    def _ban_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids a row below its min_tokens may not sample: its stop ids and (unless it
        ignores EOS) the EOS ids."""
        eos = () if params.ignore_eos else self.eos_token_ids
        return tuple(sorted(set(params.stop_ids) | set(eos)))

    def params_of(self, slot: int) -> SamplingParams | None:
        return self._params[slot]

    # ----- per step -----
    def batch(self, slots: Sequence[int], steps: Sequence[int]) -> SamplingBatch:
        """The SamplingBatch of rows slots[i] at steps[i] (tokens generated before this one).
        Host -> device traffic: one [n] int64 copy of the steps, plus the (row, token) pairs of
        rows still below min_tokens when there are any. What depends only on which requests
        sit in which rows (params, switches, their device gathers) is built once per row order
        and reused until a slot is admitted or released: a decode batch keeps its rows for
        many steps."""
        n = len(slots)
        if n == 0:
            raise ValueError("slots: a sampling batch needs at least one row")
        if len(steps) != n:
            raise ValueError(f"steps: expected {n} rows (one per slot), got {len(steps)}")
        if min(steps) < 0:
            raise ValueError(f"steps: must be >= 0, got {list(steps)}")
        key = tuple(slots)
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) >= _MAX_ROW_ORDERS:
                self._rows.clear()
            rows = self._rows[key] = self._gather_rows(key)
        if rows.fixed:  # a greedy decode batch: no upload, no copy (its host work is its time)
            return rows.template

        if n > self._staging[0].shape[0]:  # a verify batch has k + 1 rows per slot
            pin = self.device.type == "cuda"
            self._staging = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
            self._staging_np = [s.numpy() for s in self._staging]
        turn = self._turn
        self.fences.before_write(turn)
        staging = self._staging[turn][:n]
        self._staging_np[turn][:n] = steps
        self._turn ^= 1
        # copy=True: on CPU too, the batch must not alias the staging row reused two steps on.
        step_t = staging.to(self.device, non_blocking=True, copy=True)
        self.fences.after_copy(turn)

        batch = copy.copy(rows.template)
        batch.steps = step_t
        if rows.penalised:
            # Rows without penalties read stale counts; their neutral factors ignore them.
            counts, _ = self.reserve_penalties()
            batch.output_counts = counts[rows.index]
        bans = [
            (row, t) for row, min_tokens, ids in rows.bans if steps[row] < min_tokens for t in ids
        ]
        if bans:
            pairs = self._upload(torch.tensor(bans, dtype=torch.int64).T.contiguous())  # [2, m]
            batch.banned_rows, batch.banned_tokens = pairs[0], pairs[1]
        return batch

    def _gather_rows(self, slots: tuple[int, ...]) -> _Rows:
        """What a batch of these rows needs that does not change from step to step."""
        params: list[SamplingParams] = []
        for slot in slots:
            self._check_slot(slot)
            p = self._params[slot]
            if p is None:
                raise ValueError(f"slots: slot {slot} holds no admitted request")
            params.append(p)
        index = self._upload(torch.tensor(slots, dtype=torch.int64))
        floats = self._floats[index]  # [n, 6]
        ints = self._ints[index]  # [n, 3]
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params)
        prompt_mask = None
        if use_rep:  # written at admission only, so gathered once
            _, mask = self.reserve_penalties()
            prompt_mask = mask[index]
        v = self.vocab_size
        switches = host_switches(params, v)
        bans = [
            (row, p.min_tokens, self._bans[slot])
            for row, (slot, p) in enumerate(zip(slots, params, strict=True))
            if p.min_tokens > 0 and self._bans[slot]
        ]
        fixed = all(self.keeps_logits_greedy(p) for p in params)
        template = SamplingBatch(
            vocab_size=v,
            temperatures=floats[:, _TEMP],
            is_greedy=ints[:, _GREEDY].bool(),
            top_ks=ints[:, _TOP_K],
            top_ps=floats[:, _TOP_P],
            min_ps=floats[:, _MIN_P],
            seeds=ints[:, _SEED],
            # replaced per step; zeros in a fixed batch, where no row draws noise to read them
            steps=torch.zeros_like(index) if fixed else index,
            repetition_penalties=floats[:, _REP] if use_rep else None,
            frequency_penalties=floats[:, _FREQ] if use_freq else None,
            presence_penalties=floats[:, _PRES] if use_freq else None,
            prompt_mask=prompt_mask,
            output_counts=None,  # gathered per step (record adds to the counts)
            banned_rows=None,
            banned_tokens=None,
            slots=index,
            **switches,
        )
        return _Rows(template, index, use_rep or use_freq, bans, fixed)

    def verify_batch(self, slots: Sequence[int], steps: Sequence[int], k: int) -> SamplingBatch:
        """The batch of a speculative verify with k draft tokens per request: k + 1 rows per
        slot, request-major, row j at steps[i] + j (the layout `rejection.accept_draft` takes).
        Draft tokens are not in the output counts yet; `accept_draft` adds them per row."""
        if k < 0:
            raise ValueError(f"k: must be >= 0, got {k}")
        rows = [slot for slot in slots for _ in range(k + 1)]
        row_steps = [step + j for step in steps for j in range(k + 1)]
        if len(steps) != len(slots):
            raise ValueError(f"steps: expected {len(slots)} rows (one per slot), got {len(steps)}")
        return self.batch(rows, row_steps)

    def record(
        self,
        slots: torch.Tensor,
        token_ids: torch.Tensor,
        num_tokens: torch.Tensor | None = None,
    ) -> None:
        """Count the tokens a step emitted, on the device (no host sync, graph-capturable).

        slots: [n] int64 device tensor, the step's rows: `batch(...).slots` (for a verify batch,
        `verify_batch(...).slots[:: k + 1]`).
        token_ids: [n] int64 (one token per row) or [n, m] (speculative: up to m per row).
        num_tokens: [n] int, with [n, m] token_ids: how many of each row's tokens count
        (the accept length); None = all of them.
        A no-op while no request uses penalties (nothing reads the counts).
        """
        if self.output_counts is None:
            return
        if token_ids.dim() == 1:
            token_ids = token_ids.unsqueeze(1)
        n, m = token_ids.shape
        if num_tokens is None:
            weights = torch.ones(n, m, dtype=torch.float32, device=token_ids.device)
        else:
            positions = torch.arange(m, device=token_ids.device)
            weights = (positions < num_tokens.unsqueeze(1)).float()
        # scatter_add_ on the flat view: never syncs (index_put_ with accumulate may sort).
        flat = slots.unsqueeze(1) * self.vocab_size + token_ids  # [n, m]
        self.output_counts.view(-1).scatter_add_(0, flat.flatten(), weights.flatten())

    # ----- helpers -----
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"slot: must be in [0, {self.max_num_seqs}), got {slot}")

    def _ids(self, ids: Sequence[int], name: str) -> torch.Tensor:
        check_ids(name, ids, self.vocab_size)
        return self._upload(torch.tensor(list(ids), dtype=torch.int64))

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device without a stream sync (a pageable copy would wait for the GPU):
        through a pinned buffer from torch's caching host allocator, which keeps it alive until
        the copy is done."""
        if self.device.type != "cuda":
            return host.clone()
        return host.pin_memory().to(self.device, non_blocking=True)
