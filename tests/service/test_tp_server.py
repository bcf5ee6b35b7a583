"""`mlaserve serve -tp 2` on the CPU (gloo): the official client gets TP1's greedy text, and
SIGTERM stops the server, its engine and the tensor-parallel worker in time, leaving no process."""

from __future__ import annotations

import os
import time
from pathlib import Path

from openai import OpenAI

from mlaserve import LLM, SamplingParams
from tests.service.server_process import start_server

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]


def _descendants(pid: int) -> set[int]:
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_tp2_server_serves_tp1_text_and_stops_cleanly(tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(device="cpu")
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm

    server = start_server(None, tmp_path / "server.log", "-tp", "2")
    try:
        server.wait_ready()
        below = _descendants(server.proc.pid)
        assert len(below) >= 2, f"engine and worker processes expected, got {below}"
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        model = client.models.list().data[0].id
        for prompt, text in zip(PROMPTS, expected):
            got = client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert got.choices[0].text == text
        code = server.stop(timeout=60.0)
    finally:
        server.stop()
    logs = server.logs()
    assert code == 0, logs
    # the engine stopped its worker and exited, not killed past the shutdown timeout
    assert "did not stop" not in logs, logs
    deadline = time.monotonic() + 10.0
    while any(_alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in below if _alive(p)], "a process outlived the server"
