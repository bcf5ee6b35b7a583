"""`--cache-dir` / `MLASERVE_CACHE_DIR` (mlaserve/jit_cache.py): every JIT compiler's cache
variable points under one folder, the user's own settings win, and the variables reach the
engine's process and every tensor-parallel worker before they import anything (a spawned process
inherits them: /proc/PID/environ is the environment it was started with).

On the CPU nothing of the project's compiles (its Triton kernels run in the interpreter, and the
engine uses no torch.compile), so what can be checked here is where the variables go; that a
second start compiles nothing is the GPU's to show (bench/RESULTS.md). What this machine can
compile, torch Inductor's C++ kernels, shows the folder is used and hit by a second process
(tests/test_jit_cache_inductor.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from mlaserve.config import ConfigError, EngineConfig
from mlaserve.jit_cache import JitCache, apply_jit_cache

NAMES = (
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "FLASHINFER_WORKSPACE_BASE",
    "CUTE_DSL_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "PYTHONPYCACHEPREFIX",
)


def test_every_variable_points_under_the_root_and_the_folders_exist(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    cache = JitCache(tmp_path / "jit")
    assert cache.apply(environ) == {}
    assert sorted(environ) == sorted(NAMES)
    for name in NAMES:
        if name == "TORCHINDUCTOR_FX_GRAPH_CACHE":
            assert environ[name] == "1"
            continue
        folder = Path(environ[name])
        assert folder.parent == tmp_path / "jit" and folder.is_dir(), name
    assert len({environ[n] for n in NAMES if n != "TORCHINDUCTOR_FX_GRAPH_CACHE"}) == 6
    assert str(tmp_path / "jit") in cache.describe(environ)


def test_the_users_own_variables_win_and_are_reported(tmp_path: Path) -> None:
    environ = {"TRITON_CACHE_DIR": "/elsewhere/triton"}
    kept = JitCache(tmp_path).apply(environ)
    assert kept == {"TRITON_CACHE_DIR": "/elsewhere/triton"}
    assert environ["TRITON_CACHE_DIR"] == "/elsewhere/triton"
    assert environ["CUTE_DSL_CACHE_DIR"] == str(tmp_path / "cute_dsl")
    assert "kept from the environment: TRITON_CACHE_DIR=/elsewhere/triton" in JitCache(
        tmp_path
    ).describe(environ)
    # applied twice (the engine process, then a worker, on the inherited environment): the same
    assert JitCache(tmp_path).apply(environ) == kept


def test_inductors_own_default_is_not_taken_for_the_users_choice(tmp_path: Path) -> None:
    """Inductor writes its default folder into the environment when torch first asks for it;
    an in-process engine applied after that still points Inductor under the cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    environ = {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}
    assert JitCache(tmp_path).apply(environ) == {}
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_relative_and_home_paths_become_absolute(tmp_path: Path) -> None:
    assert JitCache(Path("~/x")).root == Path.home() / "x"
    assert JitCache(Path("rel")).root.is_absolute()


def test_a_folder_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    environ: dict[str, str] = {}
    with pytest.raises(ConfigError, match="cache_dir: cannot use"):
        JitCache(blocker / "jit").apply(environ)
    assert environ == {}


def test_unset_changes_nothing() -> None:
    environ = {"PATH": "/bin"}
    assert apply_jit_cache(None, environ) is None
    assert environ == {"PATH": "/bin"}


def test_an_empty_cache_dir_is_refused() -> None:
    with pytest.raises(ConfigError, match="cache_dir"):
        EngineConfig(cache_dir=" ")


@pytest.fixture
def clean_cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's variables unset, and restored after it (the engine writes os.environ)."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
def test_the_engine_and_its_tp_worker_get_the_cache(
    tmp_path: Path, checkpoint: Callable[[str], Path], clean_cache_env: None
) -> None:
    from mlaserve.llm_engine import LLMEngine

    root = tmp_path / "jit"
    config = EngineConfig(
        model=str(checkpoint("v3_moe")), device="cpu", dtype="float32", page_size=4,
        max_model_len=128, max_num_seqs=8, tensor_parallel_size=2, cache_dir=str(root),
    )  # fmt: skip
    engine = LLMEngine(config)
    try:
        assert engine.tp_workers is not None and len(engine.tp_workers.pids) == 1
        want = JitCache(root).variables()
        for where, environ in [
            ("rank 0", dict(os.environ)),
            ("rank 1", _environ_of(engine.tp_workers.pids[0])),
        ]:
            assert {n: environ.get(n) for n in NAMES} == want, where
    finally:
        engine.shutdown()


_IMPORT_PROBE = """
import sys
from mlaserve.jit_cache import apply_jit_cache, cache_python_bytecode
cache_dir = sys.argv[1]
apply_jit_cache(cache_dir)  # the server's step before it spawns the engine
print(sys.flags.dont_write_bytecode, cache_python_bytecode(cache_dir), flush=True)
sys.path.insert(0, sys.argv[2])
import probe_module
"""


@pytest.mark.parametrize("users_prefix", [False, True])
def test_python_bytecode_goes_to_the_cache_even_where_writing_it_is_off(
    tmp_path: Path, users_prefix: bool
) -> None:
    """Under PYTHONDONTWRITEBYTECODE (the GPU hosts', the image's) a process that calls
    `cache_python_bytecode` writes the bytecode of what it imports next under the cache's
    `python` folder, and nothing beside the source; a prefix the user set is left alone (the
    process then writes nothing). A fresh interpreter each, as the engine process is."""
    import subprocess
    import sys

    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "probe_module.py").write_text("VALUE = 1\n")
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if users_prefix:
        env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "theirs")
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, str(tmp_path / "jit"), str(sources)],
        env=env, capture_output=True, text=True, timeout=120, check=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    flag, cached = done.stdout.split()
    assert flag == "1"  # the interpreter started with writing off
    written = list((tmp_path / "jit" / "python").rglob("probe_module*.pyc"))
    assert not (sources / "__pycache__").exists()
    if users_prefix:
        assert cached == "False" and written == []
        assert not (tmp_path / "theirs").exists()
    else:
        assert cached == "True" and len(written) == 1, written
