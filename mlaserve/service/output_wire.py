"""A step's `RequestOutput`s as plain tuples, for the pipe from the engine process.

Pickling dataclass instances costs a class lookup and a state dict per object, and unpickling
rebuilds each through `__new__` + `__setstate__`; tuples cost a fraction of that (measured:
bench/RESULTS.md, "Moved from mlaserve/service/output_wire.py"), and the engine side (dumps) is
on the step's critical path. Each object becomes the tuple of its fields' values in declaration
order (`__dict__` order: every field is set by the generated `__init__`), so a
field added to these dataclasses travels without a change here. Logprob dicts travel as they
are (only requests that ask for logprobs have them).
"""

from __future__ import annotations

import dataclasses

from mlaserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["decode_outputs", "encode_outputs"]

_FIELDS = [f.name for f in dataclasses.fields(RequestOutput)]
_OUTPUTS = _FIELDS.index("outputs")
_METRICS = _FIELDS.index("metrics")


def encode_outputs(outputs: list[RequestOutput]) -> list[tuple]:
    wire = []
    for out in outputs:
        values = list(out.__dict__.values())
        values[_OUTPUTS] = [tuple(c.__dict__.values()) for c in out.outputs]
        m = out.metrics
        values[_METRICS] = None if m is None else tuple(m.__dict__.values())
        wire.append(tuple(values))
    return wire


def decode_outputs(wire: list[tuple]) -> list[RequestOutput]:
    outputs = []
    for values in wire:
        values = list(values)
        values[_OUTPUTS] = [CompletionOutput(*c) for c in values[_OUTPUTS]]
        m = values[_METRICS]
        if m is not None:
            values[_METRICS] = RequestMetrics(*m)
        outputs.append(RequestOutput(*values))
    return outputs
