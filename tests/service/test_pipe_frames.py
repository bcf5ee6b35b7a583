"""Messages from the engine process larger than the pipe's buffer, on a non-blocking descriptor
(what uvloop's `add_reader` makes of it): `FrameReader` reassembles them, and a real server
under uvicorn's default loop (uvloop, installed with the package) serves a step whose message
is several times the pipe's buffer. Before `FrameReader`, the frontend read such a message with
`recv_bytes`, failed halfway with BlockingIOError, took it for the engine's death and closed
the pipe: the engine died of a broken pipe (seen on an H100 under bench/soak.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import threading

import pytest

from mlaserve.service.pipe_frames import FrameReader
from tests.service.server_process import ServerProcess

PIPE_BUFFER = 1 << 16  # Linux's default


def _read_all(reader: FrameReader, fd: int, count: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count:
        select.select([fd], [], [], 10.0)
        got += reader.read()
    return got


def test_frames_split_across_reads_come_out_whole_and_in_order() -> None:
    rx, tx = multiprocessing.Pipe(duplex=False)
    os.set_blocking(rx.fileno(), False)  # as uvloop leaves it
    sizes = [0, 1, 4, 16384, 16385, PIPE_BUFFER + 7, 3 * 2**20, 5, 200_000]
    sent = [os.urandom(n) for n in sizes]
    writer = threading.Thread(target=lambda: [tx.send_bytes(m) for m in sent])
    writer.start()
    reader = FrameReader(rx.fileno())
    got = _read_all(reader, rx.fileno(), len(sent))
    writer.join()
    assert got == sent
    tx.close()
    select.select([rx.fileno()], [], [], 10.0)
    with pytest.raises(EOFError):
        reader.read()


def test_recv_bytes_fails_on_such_a_descriptor() -> None:
    """The failure `FrameReader` replaces: `recv_bytes` of a message that arrives in pieces."""
    rx, tx = multiprocessing.Pipe(duplex=False)
    os.set_blocking(rx.fileno(), False)

    def send() -> None:
        with contextlib.suppress(BrokenPipeError):  # the reader closes first
            tx.send_bytes(os.urandom(4 * PIPE_BUFFER))

    writer = threading.Thread(target=send)
    writer.start()
    select.select([rx.fileno()], [], [], 10.0)
    with pytest.raises(BlockingIOError):
        for _ in range(1000):  # the first piece may be read whole before the writer refills
            rx.recv_bytes()
    writer.join(timeout=0.1)
    rx.close()  # unblocks the writer (broken pipe) if it is still writing
    writer.join()


def test_a_step_message_larger_than_the_pipe_buffer_is_served(
    server: ServerProcess, model_name: str
) -> None:
    pytest.importorskip("uvloop")  # uvicorn's loop="auto" takes it, as on the GPU hosts
    prompt = [3 + (7 * i) % 97 for i in range(240)]
    body = {"model": model_name, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20}
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    scored = r.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and all(len(e) >= 20 for e in scored[1:])
    assert len(r.content) > 2 * PIPE_BUFFER  # the engine's message was at least as large
    assert server.get("/health").status_code == 200
