"""What the tests that kill a server's processes share: a /health poller, a stream that must end
in an error, the wait for processes to exit."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.service.server_process import ServerProcess, pid_alive

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
EXIT_WAIT_S = 30.0  # bounds a hang, not a speed: a healthy exit takes well under a second


class HealthPoller(threading.Thread):
    """Polls /health on fresh connections until the server stops answering; keeps every
    answer: a status code, or None for a refused connection."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.seen: list[tuple[int | None, dict | None]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                r = httpx.get(f"{self.url}/health", timeout=5.0)
                self.seen.append((r.status_code, r.json()))
            except httpx.TransportError:
                self.seen.append((None, None))
                return
            time.sleep(0.005)

    def codes_never_up_again(self) -> list[int | None]:
        """The statuses seen; asserts that once /health was not 200 it stayed 503 or refused."""
        codes = [code for code, _ in self.seen]
        first_down = next((i for i, c in enumerate(codes) if c != 200), len(codes))
        assert all(c in (503, None) for c in codes[first_down:]), codes
        return codes


def stream_until_error(server: ServerProcess, on_first_frame) -> dict:
    """Streams LONG; calls `on_first_frame()` once generation has started; returns the error
    event that must end the stream (followed by [DONE])."""
    with server.http.stream("POST", "/v1/completions", json=LONG) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        frames = [next(line for line in lines if line.startswith("data: "))]
        on_first_frame()
        frames += [line for line in lines if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]", frames[-3:]
    return json.loads(frames[-2].removeprefix("data: "))["error"]


def assert_all_exit(pids: set[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)], "a process outlived the server"
