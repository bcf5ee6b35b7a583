"""Start, probe and stop a real `python -m mlaserve serve` subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class ServerProcess:
    def __init__(
        self, proc: subprocess.Popen, port: int, log_path: Path, api_key: str | None
    ) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=60.0)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs) -> httpx.Response:
        return self.http.get(path, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> list[tuple[int, int]]:
        """Poll until /ready is 200; returns the (/health, /ready) statuses seen on the way."""
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2.0).status_code
                ready = httpx.get(f"{self.url}/ready", timeout=2.0).status_code
                seen.append((health, ready))
                if ready == 200:
                    return seen
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.logs()}")

    def metric(self, name: str, **labels: str) -> float:
        """One sample from /metrics (0.0 when absent), matched on the labels given."""
        total = None
        for line in self.get("/metrics").text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{([^}]*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + float(m.group(4))
        return total or 0.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    model_dir: Path | None,
    log_path: Path,
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    script: Path | None = None,
) -> ServerProcess:
    """Launch the server; returns at once (call `wait_ready`). Output goes to `log_path`.

    `script`: a Python file to run instead of `-m mlaserve`; it patches something and calls
    `mlaserve.service.cli.main` (it re-runs in the engine process, so its patches hold there)."""
    port = port or free_port()
    entry = [str(script)] if script is not None else ["-m", "mlaserve"]
    cmd = [sys.executable, *entry, "serve", "--port", str(port), "--device", "cpu"]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(args)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLASERVE_")}
    full_env.update(env or {})
    # The repo after the caller's PYTHONPATH, and not the working directory first (`-m` would
    # put it there): a tree named on PYTHONPATH (an A/B's old one) is the one that serves.
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [full_env.get("PYTHONPATH"), str(REPO_ROOT)])
    )
    full_env["PYTHONSAFEPATH"] = "1"
    # One intra-op thread: the tiny model gains nothing from more, and spinning OpenMP workers
    # would fight the test's own client threads for the 2 CI cores.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    return ServerProcess(proc, port, log_path, api_key)
