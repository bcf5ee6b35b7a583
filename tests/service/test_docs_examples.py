"""Every `bash` and `python` block of docs/api.md, and of README.md's "HTTP API" section, runs
against the live server and succeeds.

Blocks marked `sh`, `json` or `yaml` are illustrations and are not run. `localhost:8000` in a
block is replaced by the test server's address.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.service.server_process import REPO_ROOT, ServerProcess

DOC = REPO_ROOT / "docs" / "api.md"
README = REPO_ROOT / "README.md"
# A curl that fails on HTTP errors (and shows the body), so a broken example fails the test.
CURL_PRELUDE = 'set -euo pipefail\ncurl() { command curl -sS --fail-with-body "$@"; }\n'


def _find(text: str) -> list[tuple[str, str]]:
    found = re.findall(r"^```(bash|python)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [(lang, code) for lang, code in found]


def _readme_api_section() -> str:
    # Only the HTTP API section: the quickstart's blocks install and start a server themselves.
    match = re.search(r"^## HTTP API.*?(?=^## )", README.read_text(), re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## HTTP API' section"
    return match.group(0)


def _blocks() -> list[tuple[str, str]]:
    return _find(DOC.read_text()) + _find(_readme_api_section())


BLOCKS = _blocks()


def test_the_doc_has_runnable_examples() -> None:
    langs = [lang for lang, _ in BLOCKS]
    assert langs.count("bash") >= 4 and langs.count("python") >= 2


@pytest.mark.parametrize(
    ("lang", "code"), BLOCKS, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(BLOCKS)]
)
def test_doc_example_runs(server: ServerProcess, lang: str, code: str) -> None:
    code = code.replace("localhost:8000", f"127.0.0.1:{server.port}")
    env = {**os.environ, "MLASERVE_API_KEY": "unused"}
    if lang == "bash":
        cmd = ["bash", "-c", CURL_PRELUDE + code]
    else:
        cmd = [sys.executable, "-c", code]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, f"{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    assert done.stdout.strip(), "the example printed nothing"
    assert '"error"' not in done.stdout
