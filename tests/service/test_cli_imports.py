"""`mlaserve serve --help`, `--version` and a bad option never import torch, CUDA or the engine:
an operator's `docker run IMAGE --help` answers at once (issue 44). Nor pydantic (the API's
schema): `serve` spawns the engine process once the settings are built, and pydantic's import
held that spawn back 0.45 s. Each command runs in a fresh interpreter that reports, at exit,
which of those modules were ever imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.service.server_process import REPO_ROOT

# Runs `mlaserve` with argv, then prints the heavy modules found in sys.modules at exit (also
# after argparse's SystemExit), as JSON on the last line of stderr.
_WRAPPER = """
import atexit, json, sys
HEAVY = ("torch", "triton", "transformers", "uvicorn", "fastapi", "pydantic", "mlaserve.llm_engine",
         "mlaserve.service.async_engine", "mlaserve.service.app", "mlaserve.service.protocol")
atexit.register(lambda: print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)),
                              file=sys.stderr))
from mlaserve.service.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _imported_heavy(*argv: str) -> tuple[int, list[str], str]:
    done = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    return done.returncode, json.loads(last), done.stdout + done.stderr


@pytest.mark.parametrize(
    "argv, code",
    [
        (("serve", "--help"), 0),
        (("--version",), 0),
        (("precompile", "--help"), 0),
        (("precompile", "/no/such/model"), 2),  # preflight: no engine built
        (("serve", "--no-such-option"), 2),  # argparse's error
        (("serve", "--max-num-seqs", "many"), 2),  # a bad value: ConfigError
        (("serve", "--port", "99999"), 2),  # ServerConfig's validation
    ],
)
def test_parsing_imports_no_torch_nor_the_engine(argv: tuple[str, ...], code: int) -> None:
    rc, heavy, output = _imported_heavy(*argv)
    assert rc == code, output
    assert heavy == [], f"{' '.join(argv)} imported {heavy}"


def test_the_wrapper_sees_torch_when_it_is_imported() -> None:
    """The check above can fail: a run that does import torch is reported as such."""
    done = subprocess.run(
        [sys.executable, "-c", "import torch\n" + _WRAPPER, "--version"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "torch" in json.loads(done.stderr.strip().splitlines()[-1])
