"""`mlaserve/triton_key.py`: Triton's cache key computed once, ahead, so the kernel warm-up's
threads find it memoised instead of each computing it (a warm start's profile:
bench/RESULTS.md, "twenty-sixth"). A fresh interpreter shows the memo's state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_PROBE = """
import json, sys
from mlaserve import triton_key
triton_key.start()  # Triton not imported yet: nothing (no import on two threads at once)
started_early = triton_key._thread is not None
import triton
from triton.runtime.cache import triton_key as key
triton_key.start(); triton_key.start()  # idempotent
triton_key.wait()
after_wait = key.cache_info()
key()
print(json.dumps({"started_early": started_early, "cached": after_wait.currsize,
                  "misses": after_wait.misses, "hits_after": key.cache_info().hits}))
"""


def test_the_key_is_computed_once_ahead_and_found_memoised() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"started_early": False, "cached": 1, "misses": 1, "hits_after": 1}
