"""Start-up time of `mlaserve serve` to `/ready`, with the engine's phase split (issue 44's table).

    python3 bench/startup.py --scenario no-cache         # an empty --cache-dir: all compiles
    python3 bench/startup.py --scenario warm-cache       # twice on one folder: the second row
    python3 bench/startup.py --scenario precompiled      # `mlaserve precompile`, then serve
    ... [--model PATH] [--cache-dir DIR] [-- extra serve options]

Each run starts `python3 -m mlaserve serve` in a fresh process (the clock starts before its
Popen), polls `/ready` until 200, reads `mlaserve:startup_duration_seconds{phase}` from /metrics
and the warm-up's compile count from the log ("compile watch: N JIT compilations"), then stops
it with SIGTERM. Prints one line per run and one JSON line per run. A "cold host" row needs a
machine started for it (the OS page cache and the driver's state are the host's, not the
folder's): run `--scenario no-cache` first on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from mlaserve.jit_cache import JitCache  # noqa: E402

FAMILY = "mlaserve:startup_duration_seconds"
READY_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def parse_phases(exposition: str) -> dict[str, float]:
    """/metrics text -> phase -> seconds of the start-up gauge."""
    pattern = rf'^{FAMILY}\{{model_name="[^"]*",phase="(\w+)"\}} (\S+)$'
    return {
        m.group(1): float(m.group(2))
        for line in exposition.splitlines()
        if (m := re.match(pattern, line))
    }


def parse_compiles(log: str) -> int | None:
    m = re.search(r"compile watch: (\d+) JIT compilations during start-up", log)
    return int(m.group(1)) if m else None


def parse_cache_loads(log: str) -> int | None:
    m = re.search(r"(\d+) kernels loaded from the on-disk cache", log)
    return int(m.group(1)) if m else None


def _env(cache_dir: Path) -> dict[str, str]:
    # The folder decides, not variables of this shell (which would win over it).
    env = {k: v for k, v in os.environ.items() if k not in JitCache(cache_dir).variables()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MLASERVE_CACHE_DIR"] = str(cache_dir)
    return env


def serve_once(label: str, cache_dir: Path, args: list[str], log_path: Path) -> dict:
    """One `mlaserve serve` start to /ready -> its row."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlaserve", "serve", "--port", str(port), *args]
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(cache_dir), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        while _get(f"http://127.0.0.1:{port}/ready")[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}:\n{log_path.read_text()}")
            if time.perf_counter() - t0 > READY_TIMEOUT_S:
                raise TimeoutError(f"not ready after {READY_TIMEOUT_S} s:\n{log_path.read_text()}")
            time.sleep(0.05)
        ready_s = time.perf_counter() - t0
        phases = parse_phases(_get(f"http://127.0.0.1:{port}/metrics")[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    return {"run": label, "ready_s": round(ready_s, 2), "compiles": parse_compiles(log),
            "cache_loads": parse_cache_loads(log),
            "phases": {k: round(v, 3) for k, v in phases.items()}}  # fmt: skip


def precompile(cache_dir: Path, args: list[str], log_path: Path) -> dict:
    engine_args = [a for a in args if not a.startswith("--port")]
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        done = subprocess.run(
            [sys.executable, "-m", "mlaserve", "precompile", *engine_args], cwd=REPO_ROOT,
            env=_env(cache_dir), stdout=log, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"precompile exited {done.returncode}:\n{log_path.read_text()}")
    text = log_path.read_text()
    m = re.search(r"JIT compilations during warm-up: (\d+)", text)
    return {"run": "precompile", "wall_s": round(time.perf_counter() - t0, 2),
            "compiles": int(m.group(1)) if m else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", choices=("no-cache", "warm-cache", "precompiled"),
                        default="warm-cache")  # fmt: skip
    parser.add_argument("--model", default=None, help="checkpoint folder (default: shipped)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="cache folder (default: a fresh temporary one)")  # fmt: skip
    parser.add_argument("serve_args", nargs="*", help="more `mlaserve serve` options, after --")
    opts = parser.parse_args(argv)
    cache_dir = opts.cache_dir or Path(tempfile.mkdtemp(prefix="mlaserve-startup-"))
    args = ([opts.model] if opts.model else []) + opts.serve_args
    logs = Path(tempfile.mkdtemp(prefix="mlaserve-startup-logs-"))
    rows = []
    if opts.scenario == "precompiled":
        rows.append(precompile(cache_dir, args, logs / "precompile.log"))
    runs = 2 if opts.scenario == "warm-cache" else 1
    for i in range(runs):
        label = "first" if opts.scenario == "no-cache" or (runs == 2 and i == 0) else "served"
        rows.append(serve_once(label, cache_dir, args, logs / f"serve{i}.log"))
    print(f"scenario {opts.scenario}, cache {cache_dir}, logs {logs}")
    for row in rows:
        split = ", ".join(f"{k} {v:.2f}" for k, v in row.get("phases", {}).items())
        when = row.get("ready_s", row.get("wall_s"))
        loads = f" (cache loads {row['cache_loads']})" if row.get("cache_loads") is not None else ""
        print(f"  {row['run']:<10} {when:>7.2f} s  compiles {row['compiles']}{loads}  {split}")
    for row in rows:
        print(json.dumps({"scenario": opts.scenario, **row}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
