"""Batched on-device sampling: `SamplingSlots` keeps each request's sampling state on the device
(written once at admission, output counts updated on the device), `SamplingSlots.batch` (or
`SamplingBatch.build` from host lists) gives a step's `SamplingBatch`, `Sampler()(logits, batch)`
draws one token per row with seed-reproducible counter-based noise."""

from mlaserve.sampling.sampler import Sampler, SamplerOutput
from mlaserve.sampling.sampling_batch import SamplingBatch
from mlaserve.sampling.sampling_slots import SamplingSlots

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "SamplingSlots"]
