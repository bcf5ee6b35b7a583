"""Which `__main__` the engine process's spawn hides (`service/engine_process.py`): only
mlaserve's own entry points; a user's script that imports the CLI's `main` after patching
something must re-run in the child so its patches hold there (tests/service/test_engine_death.py
and test_hardening.py serve through such scripts)."""

from __future__ import annotations

import importlib.machinery
import types

from mlaserve.service.cli import main as cli_main
from mlaserve.service.engine_process import _is_mlaserve_cli


def _module(spec_name: str | None, file: str | None) -> types.ModuleType:
    m = types.ModuleType("__main__")
    m.__spec__ = None if spec_name is None else importlib.machinery.ModuleSpec(spec_name, None)
    if file is not None:
        m.__file__ = file
    m.main = cli_main  # every case holds the CLI's `main`: that alone decides nothing
    return m


def test_mlaserve_entry_points_are_recognised() -> None:
    assert _is_mlaserve_cli(_module("mlaserve.__main__", "/x/mlaserve/__main__.py"))
    assert _is_mlaserve_cli(_module(None, "/venv/bin/mlaserve"))  # the console script


def test_a_users_script_that_imports_the_cli_is_not() -> None:
    assert not _is_mlaserve_cli(_module(None, "/tmp/dying_server.py"))
    assert not _is_mlaserve_cli(_module("my_launcher", "/src/my_launcher.py"))
    assert not _is_mlaserve_cli(_module(None, None))  # an interactive session
