"""Compute kernels with no knowledge of the model: FP8 block quantisation and block-scaled GEMMs.

A leaf package: it imports torch (and Triton where available) and nothing outside
`mlaserve.ops`, so any layer may use it without creating an import cycle.
"""
