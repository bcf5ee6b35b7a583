"""Two "nodes" of N/2 GPUs on one host against single-process TP N (issue 46): greedy equality,
the decode step at each batch size under both NCCL transports, and the worker-loss check.

    python3 bench/two_node.py                          # 4 GPUs, the default model
    python3 bench/two_node.py --model /models/DeepSeek-V2-Lite
    python3 bench/two_node.py --device cpu --tp 2 --batch-sizes 1 --max-tokens 8   # smoke

Setups, each a real `mlaserve serve` (node 0 on --port) started, measured and stopped in turn:
- `single`: one server, `-tp N`, every GPU visible;
- `nodes-default`: two launchers, `--nnodes 2`, CUDA_VISIBLE_DEVICES split in halves, NCCL's
  default transports (P2P / SHM between the halves);
- `nodes-net`: the same with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: NCCL's network transport,
  as between real machines.

Greedy: `--prompts` prompts x `--max-tokens` tokens, temperature 0, ignore_eos, one request at a
time; each setup's texts against `single`'s. Decode step at batch size bs: bs streamed requests
at once (`--max-tokens` each, ignore_eos); step = median over the requests of their time per
output token after the first (first event to last, over `--max-tokens` - 1), as the client sees it.
Worker loss (`--kill`, on `nodes-default`): node 1's launcher is SIGKILLed mid-stream; reported
are the stream's last event, the seconds until node 0 exits and its code, and the GPU
processes left (nvidia-smi). Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The capital of France is",
           "class Stack:", "# Quick sort in Python\n", "SELECT name FROM", "Once upon a time",
           "The derivative of x^2 is"]  # fmt: skip
NET = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def _launch(args: argparse.Namespace, nodes: int, env: dict[str, str], dist_port: int) -> list:
    gpus = [str(i) for i in range(args.tp)]
    procs = []
    for rank in range(nodes):
        cmd = [sys.executable, "-m", "mlaserve", "serve", "-tp", str(args.tp),
               "--device", args.device, "--port", str(args.port)]  # fmt: skip
        if args.model:
            cmd += ["--model", args.model]
        if nodes > 1:
            cmd += ["--nnodes", str(nodes), "--node-rank", str(rank),
                    "--dist-init-addr", f"127.0.0.1:{dist_port}"]  # fmt: skip
        half = gpus[rank * len(gpus) // nodes : (rank + 1) * len(gpus) // nodes]
        # the repository first, then what the caller's path already had (a --target site)
        path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
        full = {**os.environ, **env, "PYTHONPATH": path}
        if args.device != "cpu":
            full["CUDA_VISIBLE_DEVICES"] = ",".join(half)
        log = open(Path(args.logs) / f"{args.setup}-node{rank}.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{args.setup}: a process exited (logs in {args.logs})")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return procs
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{args.setup}: not ready")


def _greedy(url: str, args: argparse.Namespace) -> list[str]:
    body = {"model": _model(url), "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    return [
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=600).json()[
            "choices"][0]["text"]
        for p in PROMPTS[: args.prompts]
    ]  # fmt: skip


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def _stream_tpot(url: str, body: dict, out: list) -> None:
    """One stream's seconds per output token after the first: its first event to its last, over
    `max_tokens - 1` (ignore_eos: every token comes). A span, not the median gap between events:
    under load several tokens can share one event, and the median gap then reads near zero."""
    first = last = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = time.perf_counter()
                first = last if first is None else first
    if first is not None and last is not None and body["max_tokens"] > 1:
        out.append((last - first) / (body["max_tokens"] - 1))


def _step_ms(url: str, bs: int, args: argparse.Namespace) -> float:
    body = {"model": _model(url), "prompt": "Once upon a time", "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    per_token: list[float] = []
    threads = [
        threading.Thread(target=_stream_tpot, args=(url, body, per_token)) for _ in range(bs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 1e3 * statistics.median(per_token)


def _stop(procs: list) -> list[int | None]:
    procs[0].send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(120))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    return codes


def _gpu_pids() -> set[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return set()
    return {int(x) for x in out.split()}


def _kill_check(args: argparse.Namespace) -> dict:
    args.setup = "kill"
    procs = _launch(args, 2, {}, args.dist_port + 3)
    url = f"http://127.0.0.1:{args.port}"
    body = {"model": _model(url), "prompt": "Once upon a time", "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    last, t_kill = "", 0.0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 20:
                procs[1].send_signal(signal.SIGKILL)
                t_kill = time.monotonic()
            if line.startswith("data: ") and line != "data: [DONE]":
                last = line
    try:
        code = procs[0].wait(60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        code = None
    exited_s = time.monotonic() - t_kill
    time.sleep(2)
    return {"last_event": last[:300], "node0_code": code, "node0_exit_s": round(exited_s, 1),
            "gpu_pids_left": sorted(_gpu_pids())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--dist-port", type=int, default=29500)
    ap.add_argument("--logs", default="/tmp/two_node_logs")
    ap.add_argument("--no-kill", dest="kill", action="store_false")
    args = ap.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    setups = [("single", 1, {}), ("nodes-default", 2, {}), ("nodes-net", 2, NET)]
    rows, texts = [], {}
    for i, (name, nodes, env) in enumerate(setups):
        args.setup = name
        procs = _launch(args, nodes, env, args.dist_port + i)
        try:
            texts[name] = _greedy(url, args)
            steps = {bs: round(_step_ms(url, bs, args), 3) for bs in args.batch_sizes}
        finally:
            codes = _stop(procs)
        same = sum(a == b for a, b in zip(texts[name], texts["single"]))
        rows.append({"setup": name, "greedy_equal": f"{same}/{len(texts[name])}",
                     "step_ms": steps, "exit_codes": codes})  # fmt: skip
    result = {"tp": args.tp, "model": args.model or "default", "device": args.device,
              "setups": rows}  # fmt: skip
    if args.kill:
        result["worker_loss"] = _kill_check(args)
    print(f"{'setup':<14} {'greedy = single':>15} " + " ".join(
        f"{'bs ' + str(bs) + ' ms':>10}" for bs in args.batch_sizes) + "  exit codes")  # fmt: skip
    for row in rows:
        print(
            f"{row['setup']:<14} {row['greedy_equal']:>15} "
            + " ".join(f"{row['step_ms'][bs]:>10.2f}" for bs in args.batch_sizes)
            + f"  {row['exit_codes']}"
        )
    if args.kill:
        print("worker loss:", result["worker_loss"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
