"""Compile Triton kernels ahead of time for SM90 and SM100 on a machine without either GPU.

`compile_for_gpus(script)` runs a script in a fresh interpreter (TRITON_INTERPRET, which the CPU
tests set at import, must not leak into it) that prints one JSON line {"sm90/name": [cubin bytes,
shared bytes], ...}, and checks every kernel produced a cubin within the SM90/SM100 shared-memory
limit. The script builds its cases with `triton.compile(ASTSource(...), target=GPUTarget(...))`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHARED_LIMIT = 227 * 1024  # bytes of shared memory per block on SM90 / SM100


def compile_for_gpus(script: str, expected: int) -> dict[str, list[int]]:
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == expected, sorted(result)
    for name, (cubin_bytes, shared) in result.items():
        assert cubin_bytes > 0, name
        assert shared <= SHARED_LIMIT, f"{name}: {shared} B of shared memory"
    return result
