"""Batched on-device sampling: `SamplingSlots` keeps each request's sampling state on the device
(written once at admission, output counts updated on the device), `SamplingSlots.batch` (or
`SamplingBatch.build` from host lists) gives a step's `SamplingBatch`, `Sampler()(logits, batch)`
draws one token per row with seed-reproducible counter-based noise."""

from mlaserve.sampling.sampler import GreedyRows, Sampler, SamplerOutput, greedy_rows
from mlaserve.sampling.sampling_batch import SamplingBatch
from mlaserve.sampling.sampling_slots import SamplingSlots

__all__ = [
    "GreedyRows",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingSlots",
    "greedy_rows",
]
