"""Compile Triton kernels ahead of time for SM90 and SM100 on a machine without either GPU.

`compile_for_gpus(cases, expected, num_stages)` runs, in a fresh interpreter (TRITON_INTERPRET,
which the CPU tests set at import, must not leak into it), a script of `cases` (Python that
fills the list `cases` with (name, kernel, signature, constexprs), using `signature()` below)
compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90 | 100))`. Every kernel
must produce a cubin within the SM90/SM100 shared-memory limit. `ptx_for_sm90(cases)` returns
the SM90 PTX of each case instead, for tests that check which instructions a kernel has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHARED_LIMIT = 227 * 1024  # bytes of shared memory per block on SM90 / SM100

_PRELUDE = r"""
import inspect, json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def signature(fn, pointers, floats=(), constexprs=()):
    sig = {p: "i32" for p in inspect.signature(fn.fn).parameters}
    sig.update(pointers)
    sig.update({name: "fp32" for name in floats})
    sig.update({name: "constexpr" for name in constexprs})
    return sig

cases = []
"""

_COMPILE = r"""
result = {}
for arch in (90, 100):
    for name, fn, sig, consts in cases:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": 4, "num_stages": NUM_STAGES})
        result[f"sm{arch}/{name}"] = [len(k.asm["cubin"]), k.metadata.shared]
print(json.dumps(result))
"""


_PTX = r"""
print(json.dumps({
    name: triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    for name, fn, sig, consts in cases
}))
"""


def _run(script: str) -> dict:
    """Run `script` in a fresh interpreter without TRITON_INTERPRET; its last line is JSON."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ptx_for_sm90(cases: str) -> dict[str, str]:
    """name -> the PTX of each of `cases` compiled for SM90 (what a test reads instructions in)."""
    return _run(_PRELUDE + cases + _PTX)


def compile_for_gpus(cases: str, expected: int, num_stages: int) -> dict[str, list[int]]:
    result = _run(_PRELUDE + cases + _COMPILE.replace("NUM_STAGES", str(num_stages)))
    assert len(result) == expected, sorted(result)
    for name, (cubin_bytes, shared) in result.items():
        assert cubin_bytes > 0, name
        assert shared <= SHARED_LIMIT, f"{name}: {shared} B of shared memory"
    return result
