"""What compiles on this CPU machine goes where `--cache-dir` says, and a second process that
shares the folder compiles nothing: torch Inductor's C++ kernels, two `torch.compile` runs in two
fresh interpreters. (The project's own Triton kernels only run in Triton's interpreter on the CPU,
which compiles nothing; their cache is the GPU's to show, bench/RESULTS.md.)

The proof is Inductor's own counters: the first process misses its FX graph cache and writes
under DIR/inductor, the second hits it (0 misses), and nothing is written outside DIR."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.server_process import REPO_ROOT

_SCRIPT = """
import json, sys
from mlaserve.jit_cache import apply_jit_cache
apply_jit_cache(sys.argv[1])  # before torch is imported, as `mlaserve serve` does
import torch
from torch._dynamo.utils import counters
fn = torch.compile(lambda x: (x * 2).sin() + 1)
fn(torch.arange(8, dtype=torch.float32))
print(json.dumps({k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}))
"""


def _compile_in_a_fresh_process(cache_dir: Path) -> dict[str, int]:
    env_clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "MLASERVE_"))
    }
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(cache_dir)],
        cwd=REPO_ROOT, env=env_clean, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU backend needs a compiler")
def test_a_second_process_hits_the_shared_cache(tmp_path: Path) -> None:
    cache_dir = tmp_path / "jit"
    first = _compile_in_a_fresh_process(cache_dir)
    assert first == {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 1}
    written = [p for p in (cache_dir / "inductor").rglob("*") if p.is_file()]
    assert written, "Inductor wrote nothing under DIR/inductor"
    second = _compile_in_a_fresh_process(cache_dir)
    assert second == {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 0}
