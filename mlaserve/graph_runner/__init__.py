"""CUDA graphs for uniform forwards (decode, and with speculation verify / draft steps), captured
at start-up against the model runner's preallocated buffers and replayed with padding; piecewise
graphs (everything but attention, per token bucket) for EXTEND forwards."""

from mlaserve.graph_runner.compile_watch import CompileWatch
from mlaserve.graph_runner.cuda_graph_runner import CaptureReport, CudaGraphRunner, TargetOutput
from mlaserve.graph_runner.piecewise_graph_runner import PiecewiseGraphRunner, PiecewiseReport

__all__ = [
    "CaptureReport",
    "CompileWatch",
    "CudaGraphRunner",
    "PiecewiseGraphRunner",
    "PiecewiseReport",
    "TargetOutput",
]
