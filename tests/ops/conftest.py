"""Kernel tests run on the GPU (marked gpu) or, without CUDA, under Triton's interpreter.

`TRITON_INTERPRET` is read when a kernel is decorated, i.e. when `mlaserve.ops.<op>` is first
imported, so it is set here, at collection, before any test imports one. Without CUDA nothing
else in the suite imports the kernels (modules only pick them on CUDA), so the setting cannot
change another test's path; with CUDA it is left alone and the compiled kernels run."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
