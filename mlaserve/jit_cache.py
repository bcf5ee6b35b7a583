"""One directory for every just-in-time compiled artefact: the `--cache-dir DIR` option.

Each JIT compiler this server may run keeps its own on-disk cache, named by its own environment
variable; `JitCache(DIR)` points each of them at a folder under DIR:

    TRITON_CACHE_DIR              DIR/triton      Triton kernels (ours, Inductor's, tokenspeed's)
    TORCHINDUCTOR_CACHE_DIR       DIR/inductor    torch.compile's Inductor (code, FX graphs)
    TORCHINDUCTOR_FX_GRAPH_CACHE  1               Inductor's FX graph cache on
    FLASHINFER_WORKSPACE_BASE     DIR/flashinfer  flashinfer's JIT modules (it appends
                                                  .cache/flashinfer to this base)
    CUTE_DSL_CACHE_DIR            DIR/cute_dsl    the CuTe DSL's compiled kernels (tokenspeed_mla)
    CUDA_CACHE_PATH               DIR/nv          the CUDA driver's PTX-to-SASS cache
    PYTHONPYCACHEPREFIX           DIR/python      Python's bytecode (`cache_python_bytecode`)

A variable the user already set is kept (theirs wins). The names are the libraries' own: Triton
3.6's `triton.knobs.cache.dir`, torch's `_inductor/runtime/cache_dir_utils.py` and
`_inductor/config.py`, flashinfer's `flashinfer/jit/env.py`, CUTLASS's
`CuTeDSL/cutlass/base_dsl/cache_helpers.py` (`{DSL}_CACHE_DIR`), and the CUDA driver's documented
`CUDA_CACHE_PATH`.

When: before the libraries read them. flashinfer and the CuTe DSL read theirs once, when first
imported; Triton and Inductor on each use. `mlaserve serve` and `mlaserve precompile` apply the
cache before the engine process is spawned (it inherits the variables before it imports
anything), `LLMEngine` applies its config's before it builds the model (the offline API), and
every tensor-parallel worker inherits them and applies its config's first thing.

Python's bytecode: an installation that ships none (torch's wheel as installed on the GPU hosts
here: no __pycache__) under PYTHONDONTWRITEBYTECODE (those hosts, and this project's image)
compiles every module's source at every start: `import torch` took 3.5 s there, 2.2 s from
cached bytecode. A process that calls `cache_python_bytecode` (the server's, the engine's, each
tensor-parallel worker's, first thing) writes bytecode under DIR/python, never beside the
sources, which is what that variable is set for; its children read it from their first import.

Unset (the default), nothing is changed: each library keeps its own default folder (Triton's
~/.triton/cache, Inductor's /tmp/torchinductor_USER, ...), as before this option existed. The
Docker image sets the option (its environment variable) to /var/cache/mlaserve, its volume.

Layer 3 (README, "Layers"): nothing from mlaserve but `config/`'s `ConfigError`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from mlaserve.config.error import ConfigError

__all__ = ["JitCache", "apply_jit_cache", "cache_python_bytecode"]

# variable -> folder under the cache root ("" means the value is not a folder: see _VALUES)
_FOLDERS = {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "CUTE_DSL_CACHE_DIR": "cute_dsl",
    "CUDA_CACHE_PATH": "nv",
    "PYTHONPYCACHEPREFIX": "python",
}
_VALUES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}


@dataclass(frozen=True)
class JitCache:
    """The cache root and what it sets; `apply()` writes the variables into the environment."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser().absolute())

    def variables(self) -> dict[str, str]:
        """Every variable this cache sets, with its value (whether or not the user set it)."""
        folders = {name: str(self.root / sub) for name, sub in _FOLDERS.items()}
        return {**folders, **_VALUES}

    def apply(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Create the folders and set each variable the environment does not already hold ->
        the variables kept from the environment (name -> the user's value). A folder that cannot
        be created or written is a `ConfigError` naming the option."""
        environ = os.environ if environ is None else environ
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if not os.access(self.root, os.W_OK):
                raise PermissionError(f"not writable by uid {os.getuid()}")
        except OSError as e:
            raise ConfigError(
                f"cache_dir: cannot use {str(self.root)!r} ({e.strerror or e}); give a writable "
                "folder (the Docker image mounts its volume at /var/cache/mlaserve)"
            ) from None
        for name, value in self.variables().items():
            if environ.get(name) and not _is_library_default(name, environ[name]):
                continue
            if name in _FOLDERS:
                Path(value).mkdir(parents=True, exist_ok=True)
            environ[name] = value
        return self.kept(environ)

    def kept(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """The variables the environment holds with another value than this cache's (the
        user's, which win) -> name -> value."""
        environ = os.environ if environ is None else environ
        return {
            name: environ[name]
            for name, value in self.variables().items()
            if environ.get(name)
            and environ[name] != value
            and not _is_library_default(name, environ[name])
        }

    def describe(self, environ: MutableMapping[str, str] | None = None) -> str:
        """One log line: where the cache is, and which variables the user's environment kept."""
        kept = self.kept(environ)
        line = (
            f"JIT cache: {self.root} (Triton, Inductor, flashinfer, CuTe DSL, CUDA PTX, "
            "Python bytecode)"
        )
        if kept:
            line += "; kept from the environment: " + ", ".join(
                f"{name}={value}" for name, value in sorted(kept.items())
            )
        return line


def _is_library_default(name: str, value: str) -> bool:
    """Whether `value` is what the library itself wrote there, not the user: Inductor writes its
    default folder into TORCHINDUCTOR_CACHE_DIR the first time torch asks for it (as building a
    tensor from a checkpoint can, before an in-process `LLMEngine` applies its cache)."""
    if name != "TORCHINDUCTOR_CACHE_DIR":
        return False
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    return utils is not None and os.path.abspath(value) == utils.default_cache_dir()


def apply_jit_cache(
    cache_dir: str | None, environ: MutableMapping[str, str] | None = None
) -> JitCache | None:
    """`JitCache(cache_dir).apply(environ)` when a cache directory is given -> the cache, or
    None (nothing changed) when it is not."""
    if cache_dir is None:
        return None
    cache = JitCache(Path(cache_dir))
    cache.apply(environ)
    return cache


def cache_python_bytecode(cache_dir: str | None) -> bool:
    """This process reads and writes Python's bytecode under the cache's `python` folder from
    now on, where PYTHONPYCACHEPREFIX names that folder (set by `apply`, not by the user: a
    user's own prefix, or no cache directory, changes nothing) -> whether it does. Writing is
    turned on even under PYTHONDONTWRITEBYTECODE (module doc): the files go to the cache only."""
    if cache_dir is None:
        return False
    folder = JitCache(Path(cache_dir)).variables()["PYTHONPYCACHEPREFIX"]
    if os.environ.get("PYTHONPYCACHEPREFIX") != folder:
        return False
    sys.pycache_prefix = folder
    sys.dont_write_bytecode = False
    return True
