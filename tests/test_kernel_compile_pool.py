"""`kernel_compile_pool`: when start-up compiles on worker processes, and, on the GPU, that the
variants collected from a task are the ones it builds, skipped without a launch, and that once
the pool compiled them the task only loads them.

The GPU cases run in fresh interpreters with their own Triton cache: Triton's in-memory kernels
are per process, and in this one earlier tests built them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mlaserve import kernel_compile_pool as kcp


def test_wanted_on_one_gpu_with_an_empty_cache_and_the_switches_on(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("MLASERVE_COMPILE_PROCESSES", raising=False)
    monkeypatch.delenv("MLASERVE_BACKGROUND_WARM_UP", raising=False)
    assert kcp.triton_cache_is_empty()  # missing
    assert kcp.compile_processes_wanted("cuda", 1)
    assert kcp.compile_processes_wanted("cuda:1", 1)
    assert not kcp.compile_processes_wanted("cpu", 1)
    assert not kcp.compile_processes_wanted("cuda", 2)  # TP: the warm-up runs in order
    monkeypatch.setenv("MLASERVE_COMPILE_PROCESSES", "0")
    assert not kcp.compile_processes_wanted("cuda", 1)
    monkeypatch.delenv("MLASERVE_COMPILE_PROCESSES")
    monkeypatch.setenv("MLASERVE_BACKGROUND_WARM_UP", "0")
    assert not kcp.compile_processes_wanted("cuda", 1)
    monkeypatch.delenv("MLASERVE_BACKGROUND_WARM_UP")
    (tmp_path / "triton").mkdir()
    assert kcp.triton_cache_is_empty()  # empty
    (tmp_path / "triton" / "abc").mkdir()
    assert not kcp.triton_cache_is_empty()
    assert not kcp.compile_processes_wanted("cuda", 1)  # a filled cache loads


def test_the_cache_folder_is_tritons(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert kcp.triton_cache_dir() == tmp_path
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert kcp.triton_cache_dir() == tmp_path / ".triton" / "cache"


_POOL = r"""
import json, sys
import torch
from triton import knobs
from mlaserve.kernel_compile_pool import KernelCompilePool, collect
from mlaserve.ops.kv_write import write_kv
from mlaserve.ops.rms_norm import rms_norm

dev = torch.device("cuda")
page = torch.full((1, 16, 576), float("nan"), dtype=torch.bfloat16, device=dev)
def write():
    rows = torch.ones(2, 576, dtype=torch.bfloat16, device=dev)
    write_kv(page, torch.tensor([0, 1], device=dev), rows[:, :512], rows[:, 512:])
def norm():
    rms_norm(torch.ones(4, 256, dtype=torch.bfloat16, device=dev), torch.ones(256, device=dev), 1e-6)

builds = []
knobs.compilation.listener = lambda **k: builds.append(bool(k.get("cache_hit")))
found = collect([write, norm])
torch.cuda.synchronize()
skipped = bool(page.isnan().all()) and builds == []
pool = KernelCompilePool(workers=2)
futures = [pool.submit(v) for vs in found for v in vs]
again = pool.submit(found[0][0]) is futures[0]
compiled = [f.result() for f in futures]
pool.shutdown()
write(); norm(); torch.cuda.synchronize()
print("RESULT " + json.dumps({
    "variants": [[v.module, v.name] for vs in found for v in vs], "skipped": skipped,
    "again": again, "compiled": compiled, "loads": builds, "written": bool((page[0, :2] == 1).all()),
}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_collected_variants_compile_on_workers_and_then_load(tmp_path) -> None:
    """Collection records each task's kernel (write_kv, rms_norm) and neither builds nor
    launches it (the NaN page stays NaN); the pool compiles each once, on its workers, into the
    cache; the tasks then run and every kernel they build is a load from that cache."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run(
        [sys.executable, "-c", _POOL], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got["variants"] == [
        ["mlaserve.ops.kv_write", "_write_kv_kernel"],
        ["mlaserve.ops.rms_norm", "_rms_norm_kernel"],
    ]
    assert got["skipped"] and got["again"]
    assert got["compiled"] == [True, True]  # by the workers: the cache was empty
    assert got["loads"] == [True, True] and got["written"]


_DRY_RUN = r"""
import json, torch
from mlaserve.kernel_compile_pool import collect
from mlaserve.ops.rms_norm import rms_norm

dev = torch.device("cuda")
x = torch.randn(8, 256, device=dev)
def task():
    y = rms_norm(torch.ones(4, 256, dtype=torch.bfloat16, device=dev), torch.ones(256, device=dev), 1e-6)
    # What a skipped kernel leaves for torch's operators: an index out of range, which
    # index_select checks on the device (an assert that ends the CUDA context).
    bad = torch.full((4,), 1 << 40, dtype=torch.long, device=dev)
    picked = torch.index_select(x, 0, bad) + y.float()[:, :1]
    int(picked.sum())  # a read to the host: collection stops here
    rms_norm(torch.ones(4, 256, dtype=torch.float32, device=dev), torch.ones(256, device=dev), 1e-6)
found = collect([task])
torch.cuda.synchronize()
print("RESULT " + json.dumps([[v.module, v.name] for v in found[0]]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_collection_launches_no_torch_operator_on_what_skipped_kernels_left(tmp_path) -> None:
    """Collection runs torch's operators dry (`device_dry_run.py`): one fed an out-of-range
    index, as a skipped kernel's output can be, launches nothing (the process and its device
    survive), and a read to the host ends the task's collection with what it recorded."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run(
        [sys.executable, "-c", _DRY_RUN], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line.removeprefix("RESULT ")) == [
        ["mlaserve.ops.rms_norm", "_rms_norm_kernel"]
    ]


_UNGUARDED = r"""
import os, sys
print("RAN", flush=True)  # a script's top level, no `if __name__ == "__main__"` guard
from concurrent.futures import ProcessPoolExecutor
import multiprocessing
from mlaserve import kernel_compile_pool as kcp

kcp.start_compile_server()
pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("forkserver"))
with kcp.main_hidden():
    worker = pool.submit(eval, "'mlaserve.ops' in __import__('sys').modules").result()
pool.shutdown()
kcp.stop_compile_server()
print("WORKER_PRELOADED", worker, "MAIN_KEPT", sys.modules["__main__"].__file__ == __file__)
"""


def test_the_compile_server_and_its_workers_do_not_run_the_main_script_again(tmp_path) -> None:
    """multiprocessing would import a process's main script in the fork server and in each
    worker (running a user's unguarded `LLM()` again); they start with it hidden, preload the
    kernels' modules, and the script's `__main__` is whole again afterwards."""
    script = tmp_path / "user_script.py"
    script.write_text(_UNGUARDED)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("RAN") == 1, proc.stdout
    assert "WORKER_PRELOADED True MAIN_KEPT True" in proc.stdout
