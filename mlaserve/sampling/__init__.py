"""Batched on-device sampling: `SamplingBatch.build` gathers per-row params once per step,
`Sampler()(logits, batch)` draws one token per row with seed-reproducible counter-based noise."""

from mlaserve.sampling.sampler import Sampler, SamplerOutput
from mlaserve.sampling.sampling_batch import SamplingBatch

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch"]
