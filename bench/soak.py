"""Seeded soak of a live `mlaserve serve`: a random but replayable mix of requests for a fixed
time, then checks that the server survived it, let go of everything and still answers alike
(issue 40 item 3: the server died under load on a GPU; this is the harness that catches that).

    python3 bench/soak.py [--seed S] [--duration-s 480] [--model PATH] [ENGINE OPTIONS ...]
    python3 bench/soak.py --url http://127.0.0.1:8000 [--spec K] [ENGINE OPTIONS ...]
    python3 bench/soak.py --duration-s 60 --max-tokens 24 --concurrency 16 --burst-min 6 \
        --burst-max 16 --steady-min 4 --steady-max 12 --gap-s 0.3 \
        --max-model-len 256 --page-size 16 --num-pages 12          # the CPU default model

Without --url it starts `python -m mlaserve serve` on 127.0.0.1 itself (`--device auto` unless
one is given) and passes it every option this script does not know, e.g. `--num-pages 64
--num-speculative-tokens 3 --max-model-len 2048`; the KV pool, the admission bound and the
tokenizer queue are read from its startup log. With --url the options only describe that server
(the pool's `--num-pages` / `--page-size`, speculation); it must be on loopback. Speculation is
also probed (a prompt_logprobs request is refused with 400 when it is on).

The mix, every draw from `random.Random(seed)` (a seed replays the same request sequence):
completions (token-id and text prompts) and chat (30%); prompt lengths from 1 to the limit (the
context or, when smaller, what the KV pool holds for one request), half log-uniform and half
uniform, 2% exactly at the limit (limit - 1 prompt tokens + max_tokens 1) and 2% at limit -
max_tokens, and with a pool smaller than the context 2% one token past the pool (a 400 is
expected); bursts of --burst-min..--burst-max requests at once between steady stretches
(exponential gaps of mean --gap-s), at most --concurrency requests and the server's admission
bound of sequences in flight (so a 503 is never the harness's doing); half streamed, 15% of the
streams closed after 1-4 chunks, 5% of the others abandoned after 0.05-1 s; half greedy, 10% n
2-4, 15% logprobs (top 1-5), 8% prompt_logprobs (not streamed), 15% stop strings, 8% structured
output (guided_json, response_format json_schema / json_object), 30% ignore_eos. With
speculation on, prompt_logprobs and structured output must get their 400.

Checks (exit code 1 if any fails): the server alive, /health 200 and a clean SIGTERM exit; no
5xx, no error event in a stream, no transport error, no 4xx but the expected ones, no traceback
in the server log; running, waiting and KV usage back to 0 after the load; the greedy requests
(n 1, answered whole; a seeded sample of at most --max-reruns, within --rerun-budget-s) run again
alone afterwards, non-streamed with logprobs 2: the fraction with the same output is at least
--min-agreement, where a divergence at a near tie counts as agreeing: the alone run's top-1
minus top-2 logprob at the first differing token at most --tie-gap (batch-dependent bf16
numerics flip such a choice, as in SGLang and vLLM; random weights tie exactly, gap 0.0). A
divergence at a wider gap, or where the alone run has no logprobs for that token, does not.
Outputs are compared by text, finish reason and completion_tokens, and token by token through
the logprobs' token strings where the load request asked for logprobs (the API returns no token
ids); a divergence is reported with its position and that gap. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from urllib.parse import urlparse

import httpx

# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from tests.service.server_process import ServerProcess, start_server

# Python-like fragments (the default model was trained on Python), some multi-byte so that text
# prompts and outputs cross UTF-8 boundaries.
WORDS = (
    "def", "return", "self", "import", "os", "path", "for", "in", "range(", "):", "\n", "    ",
    "if", "else:", "x", "=", "1", "None", "class", "__init__", "#", "'''", "é", "中文", "λ",
)  # fmt: skip
STOPS = ("\n", "(", "):", " = ", "return", "self.", "e")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
# Tokens a chat template may add around the messages (the default model's adds ~10).
CHAT_TEMPLATE_TOKENS = 64
# Every kind of request the mix holds (tests/bench checks that a plan covers them).
KINDS = (
    "completions", "chat", "token_ids", "text", "at_limit_minus_1", "at_limit", "over_pool",
    "burst", "steady", "stream", "no_stream", "disconnect", "cancel", "n>1", "logprobs",
    "prompt_logprobs", "stop", "structured", "greedy", "sampled", "ignore_eos", "spec_refused",
)  # fmt: skip
# Outcomes that fail the run (classify()).
FAILURES = ("5xx", "stream_error", "transport_error", "unexpected_4xx", "unexpected_200",
            "truncated", "unfinished")  # fmt: skip


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server under test."""

    max_model_len: int
    vocab_size: int
    max_tokens: int  # the mix's largest max_tokens
    pool_tokens: int | None = None  # prompt + max_tokens that the KV pool holds for one request
    spec: bool = False

    @property
    def fit(self) -> int:
        """The most prompt + output tokens one request may hold."""
        return min(self.max_model_len, self.pool_tokens or self.max_model_len)

    @property
    def pool_below_context(self) -> bool:
        return self.pool_tokens is not None and self.pool_tokens < self.max_model_len


@dataclass(frozen=True)
class Arrivals:
    burst_min: int = 20
    burst_max: int = 100
    steady_min: int = 10
    steady_max: int = 60
    gap_s: float = 0.1  # mean gap between steady arrivals


@dataclass
class Planned:
    """One request of the mix."""

    index: int
    endpoint: str  # "completions" or "chat"
    body: dict
    kinds: tuple[str, ...]
    gap_s: float = 0.0  # wait before sending it (0 inside a burst)
    disconnect_after: int | None = None  # streamed: close after this many content chunks
    cancel_after_s: float | None = None  # not streamed: give up waiting after this long
    expect_400: str | None = None  # a 400 whose message holds this is the right answer

    @property
    def n(self) -> int:
        return self.body.get("n", 1)

    @property
    def greedy_checkable(self) -> bool:
        return (
            self.body.get("temperature") == 0
            and self.n == 1
            and self.expect_400 is None
            and self.disconnect_after is None
            and self.cancel_after_s is None
        )


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    if hi <= lo:
        return lo
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def _length(rng: random.Random, most: int) -> int:
    """A prompt length in [1, most]: half log-uniform (many short prompts), half uniform (long
    ones, which fill the KV pool and so force preemption)."""
    return _log_uniform(rng, 1, most) if rng.random() < 0.5 else rng.randint(1, max(1, most))


def _text(rng: random.Random, nbytes: int) -> str:
    """Text of at most `nbytes` UTF-8 bytes, not all whitespace: a whitespace-split tokenizer
    (bench/make_checkpoint.py's) makes no token of that, and the empty prompt's 400 is right."""
    parts, size = [], 0
    while size < nbytes:
        word = rng.choice(WORDS)
        parts.append(word)
        size += len(word.encode()) + 1
    text = " ".join(parts).encode()[: max(1, nbytes)].decode(errors="ignore")
    return text if text.strip() else "x"


def _request(rng: random.Random, index: int, limits: Limits) -> Planned:
    kinds: list[str] = []
    expect = None
    fit = limits.fit
    chat_room = fit - CHAT_TEMPLATE_TOKENS - 1
    chat = rng.random() < 0.3 and chat_room > 2
    stream = rng.random() < 0.5
    greedy = rng.random() < 0.5
    max_tokens = _log_uniform(rng, 1, max(1, min(limits.max_tokens, fit // 2)))
    body: dict = {}
    shape = rng.random()
    plain = False  # a request about the limits only: no extras
    if chat:
        max_tokens = min(max_tokens, chat_room - 1)
        content = _text(rng, _length(rng, chat_room - max_tokens))
        body["messages"] = [{"role": "user", "content": content}]
        kinds += ["chat", "text"]
    else:
        kinds.append("completions")
        if shape < 0.02 and limits.pool_below_context:
            # One token more than the pool holds for a request (the context has room): the
            # server must refuse it with a 400 and go on.
            prompt_len, max_tokens, plain = fit, 1, True
            kinds.append("over_pool")
            expect = "KV pages"
        elif shape < 0.04:
            prompt_len, max_tokens = fit - 1, 1
            kinds.append("at_limit_minus_1")
        elif shape < 0.06:
            prompt_len = fit - max_tokens
            kinds.append("at_limit")
        else:
            prompt_len = _length(rng, fit - max_tokens)
        if prompt_len < 2 or shape < 0.06 or rng.random() < 0.5:
            body["prompt"] = [rng.randrange(3, limits.vocab_size) for _ in range(prompt_len)]
            kinds.append("token_ids")
        else:
            # Byte-level BPE: at most one token a byte, plus BOS.
            body["prompt"] = _text(rng, prompt_len - 1)
            kinds.append("text")
    body["max_tokens"] = max_tokens
    if plain:
        stream = False
    elif greedy:
        body["temperature"] = 0.0
    else:
        body["temperature"] = round(rng.uniform(0.3, 1.5), 2)
        if rng.random() < 0.5:
            body["top_p"] = round(rng.uniform(0.5, 1.0), 2)
        if rng.random() < 0.3:
            body["top_k"] = rng.randint(1, 50)
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
    kinds.append("greedy" if body.get("temperature") == 0 else "sampled")
    item = Planned(index, "chat" if chat else "completions", body, ())
    if not plain:
        if rng.random() < 0.1:
            body["n"] = rng.randint(2, 4)
            kinds.append("n>1")
        if rng.random() < 0.3:
            body["ignore_eos"] = True
            kinds.append("ignore_eos")
        if rng.random() < 0.15:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
            kinds.append("stop")
        if rng.random() < 0.15:
            k = rng.randint(1, 5)
            body.update({"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k})
            kinds.append("logprobs")
        if not stream and rng.random() < 0.08:
            body["prompt_logprobs"] = rng.randint(0, 5)
            kinds.append("prompt_logprobs")
        if rng.random() < 0.08:
            if not chat:
                body["guided_json"] = SCHEMA
            elif rng.random() < 0.5:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "item", "schema": SCHEMA},
                }
            else:
                body["response_format"] = {"type": "json_object"}
            kinds.append("structured")
        if limits.spec and ("prompt_logprobs" in kinds or "structured" in kinds):
            expect = "speculative"  # refused with speculation on (_refuse_with_speculation)
            kinds.append("spec_refused")
    if stream:
        body["stream"] = True
        if rng.random() < 0.7:
            body["stream_options"] = {"include_usage": True}
        if expect is None and rng.random() < 0.15:
            item.disconnect_after = rng.randint(1, 4)
            kinds.append("disconnect")
    elif expect is None and rng.random() < 0.05:
        item.cancel_after_s = round(rng.uniform(0.05, 1.0), 3)
        kinds.append("cancel")
    kinds.append("stream" if stream else "no_stream")
    item.kinds = tuple(kinds)
    item.expect_400 = expect
    return item


def plan(seed: int, limits: Limits, arrivals: Arrivals = Arrivals()) -> Iterator[Planned]:
    """The endless request sequence of a seed: steady stretches and bursts, alternating."""
    rng = random.Random(seed)
    index, bursty = 0, False
    while True:
        if bursty:
            size = rng.randint(arrivals.burst_min, arrivals.burst_max)
        else:
            size = rng.randint(arrivals.steady_min, arrivals.steady_max)
        for i in range(size):
            gap = 0.0
            if (not bursty or i == 0) and arrivals.gap_s > 0:
                gap = rng.expovariate(1 / arrivals.gap_s)
            item = _request(rng, index, limits)
            item.gap_s = round(gap, 4)
            item.kinds += ("burst" if bursty else "steady",)
            yield item
            index += 1
        bursty = not bursty


def plan_list(seed: int, limits: Limits, count: int, arrivals: Arrivals = Arrivals()) -> list:
    return list(islice(plan(seed, limits, arrivals), count))


# ----- sending -----


@dataclass
class Outcome:
    """What one request got."""

    item: Planned
    status: int | None = None  # None: no HTTP response
    error: str | None = None
    stream_error: str | None = None  # an error event inside a 200 stream
    response_id: str | None = None
    texts: dict[int, str] = field(default_factory=dict)  # per choice index
    tokens: dict[int, list[str]] = field(default_factory=dict)  # with logprobs
    tops: dict[int, list[list[float]]] = field(default_factory=dict)  # top logprobs, sorted
    finish: dict[int, str | None] = field(default_factory=dict)
    completion_tokens: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    complete: bool = False  # the whole response arrived ([DONE] for a stream)
    closed_early: bool = False  # the client left as planned
    elapsed_s: float = 0.0

    @property
    def outcome(self) -> str:
        return classify(self)


def classify(o: Outcome) -> str:
    if o.status is None:
        if o.closed_early:
            return "cancel"
        return "unfinished" if o.error == "unfinished" else "transport_error"
    if o.status >= 500:
        return "5xx"
    if o.stream_error is not None:
        return "stream_error"
    expected = o.item.expect_400
    if o.status == 400 and expected is not None and expected in (o.error or ""):
        return "expected_400"
    if o.status != 200:
        return "unexpected_4xx"
    if expected is not None:
        return "unexpected_200"
    if o.closed_early:
        return "disconnect"
    return "ok" if o.complete else "truncated"


def _choice_logprobs(o: Outcome, i: int, endpoint: str, logprobs: dict | None) -> None:
    if not logprobs:
        return
    if endpoint == "chat":
        entries = logprobs.get("content") or []
        toks = [e["token"] for e in entries]
        tops = [sorted((t["logprob"] for t in e.get("top_logprobs") or []), reverse=True)
                for e in entries]  # fmt: skip
    else:
        toks = logprobs.get("tokens") or []
        tops = [
            sorted((d or {}).values(), reverse=True) for d in logprobs.get("top_logprobs") or []
        ]
    o.tokens.setdefault(i, []).extend(toks)
    o.tops.setdefault(i, []).extend(tops)


def _error_text(data: object) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        err = data["error"]
        return f"{err.get('code')}: {err.get('message')}"
    return str(data)[:300]


def _read_json(o: Outcome, r: httpx.Response) -> None:
    o.status = r.status_code
    try:
        data = r.json()
    except ValueError:
        o.error = f"not JSON: {r.text[:200]!r}"
        return
    if r.status_code != 200:
        o.error = _error_text(data)
        return
    o.response_id = data.get("id")
    for ch in data.get("choices", []):
        i = ch["index"]
        o.texts[i] = ch["message"].get("content") or "" if "message" in ch else ch["text"]
        o.finish[i] = ch.get("finish_reason")
        _choice_logprobs(o, i, o.item.endpoint, ch.get("logprobs"))
    o.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
    o.complete = True


async def _stream(client: httpx.AsyncClient, url: str, o: Outcome, t0: float) -> None:
    item = o.item
    async with client.stream("POST", url, json=item.body) as r:
        o.status = r.status_code
        if r.status_code != 200:
            await r.aread()
            _read_json(o, r)
            return
        first = last = None
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                o.complete = True
                break
            data = json.loads(payload)
            if "error" in data:
                o.stream_error = _error_text(data)
                continue
            o.response_id = data.get("id") or o.response_id
            if data.get("usage"):
                o.completion_tokens = data["usage"].get("completion_tokens")
            content = False
            for ch in data.get("choices") or []:
                i = ch["index"]
                piece = (
                    (ch.get("delta") or {}).get("content")
                    if item.endpoint == "chat"
                    else ch.get("text")
                )
                o.texts[i] = o.texts.get(i, "") + (piece or "")
                if ch.get("finish_reason") is not None:
                    o.finish[i] = ch["finish_reason"]
                _choice_logprobs(o, i, item.endpoint, ch.get("logprobs"))
                content = content or bool(piece) or bool(ch.get("logprobs"))
            if content:
                last = time.perf_counter()
                first = first or last
                chunks += 1
                if item.disconnect_after is not None and chunks >= item.disconnect_after:
                    o.closed_early = True  # leaving the block closes the connection mid-stream
                    return
        if first is not None:
            o.ttft_s = first - t0
            if item.n == 1 and o.completion_tokens and o.completion_tokens > 1:
                o.tpot_s = (last - first) / (o.completion_tokens - 1)


async def send(client: httpx.AsyncClient, item: Planned) -> Outcome:
    """Send one planned request and read what comes back (or leave as planned)."""
    o = Outcome(item)
    url = "/v1/chat/completions" if item.endpoint == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    try:
        if item.body.get("stream"):
            await _stream(client, url, o, t0)
        elif item.cancel_after_s is not None:
            try:
                r = await asyncio.wait_for(client.post(url, json=item.body), item.cancel_after_s)
                _read_json(o, r)
            except TimeoutError:
                o.closed_early = True  # the cancelled POST closed its connection
        else:
            _read_json(o, await client.post(url, json=item.body))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        o.error = f"{type(e).__name__}: {e}"
    o.elapsed_s = time.perf_counter() - t0
    return o


class _InFlight:
    """At most `requests` requests and `sequences` sequences (n choices each) in flight: the
    server's tokenizer queue and admission bound, so that its 503s are never the harness's doing."""

    def __init__(self, requests: int, sequences: int) -> None:
        self.requests, self.sequences = requests, sequences
        self.used_requests = self.used_sequences = 0
        self.cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self.cond:
            await self.cond.wait_for(
                lambda: (
                    self.used_requests < self.requests and self.used_sequences + n <= self.sequences
                )
            )
            self.used_requests += 1
            self.used_sequences += n

    async def release(self, n: int) -> None:
        async with self.cond:
            self.used_requests -= 1
            self.used_sequences -= n
            self.cond.notify_all()


def http_client(url: str, timeout_s: float, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def run_load(
    url: str,
    items: Iterator[Planned],
    duration_s: float,
    concurrency: int,
    sequences: int,
    timeout_s: float,
    drain_timeout_s: float,
    max_requests: int,
    alive: Callable[[], bool],
) -> tuple[list[Outcome], float]:
    """Send `items` for `duration_s` (at most `max_requests`), then wait for the ones in flight
    (at most `drain_timeout_s`; those still out count as unfinished). Returns the outcomes in
    sending order and the wall time until the last one ended."""
    gate = _InFlight(concurrency, max(sequences, 4))
    sent: list[tuple[Planned, asyncio.Task]] = []

    refused = False  # a connection was refused: the server is gone, stop sending

    async def one(item: Planned) -> Outcome:
        nonlocal refused
        try:
            o = await send(client, item)
            refused = refused or (o.error or "").startswith("ConnectError")
            return o
        finally:
            await gate.release(item.n)

    t0 = time.monotonic()
    deadline = t0 + duration_s
    async with http_client(url, timeout_s, concurrency + 4) as client:
        for item in items:
            if len(sent) >= max_requests or refused or not alive():
                break
            if item.gap_s:
                await asyncio.sleep(min(item.gap_s, max(0.0, deadline - time.monotonic())))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(gate.acquire(item.n), left)
            except TimeoutError:
                break
            sent.append((item, asyncio.create_task(one(item))))
        if sent:
            _, pending = await asyncio.wait([t for _, t in sent], timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - t0
    outcomes = [
        Outcome(item, error="unfinished") if task.cancelled() else task.result()
        for item, task in sent
    ]
    return outcomes, wall


# ----- the server under test -----


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def engine_option(options: list[str], name: str) -> str | None:
    """The last value of `name V` / `name=V` among the server options."""
    value = None
    for i, arg in enumerate(options):
        if arg == name and i + 1 < len(options):
            value = options[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def spec_tokens(options: list[str]) -> int:
    """k of the speculation the server options ask for (0: none)."""
    k: object = engine_option(options, "--num-speculative-tokens")
    config = engine_option(options, "--speculative-config")
    if config:
        with contextlib.suppress(ValueError, AttributeError):
            k = json.loads(config).get("num_speculative_tokens", k)
    return int(k or 0)


_METRIC = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$")


class Target:
    """The server under test: started here (and stopped at the end), or attached by URL."""

    def __init__(self, url: str, proc: ServerProcess | None, log_path: Path | None) -> None:
        self.url, self.proc, self.log_path = url, proc, log_path

    @classmethod
    def start(
        cls, model: str | None, log_path: Path, options: list[str], timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> Target:  # fmt: skip
        # start_server defaults to the CPU; auto takes the GPU where there is one. A --device
        # among the options comes later and wins. `env`: the server's MLASERVE_* switches
        # (start_server drops this process's own).
        model_dir = Path(model) if model else None
        proc = start_server(model_dir, log_path, "--device", "auto", *options, env=env)
        try:
            proc.wait_ready(timeout=timeout_s)
        except BaseException:
            proc.stop()
            raise
        return cls(proc.url, proc, log_path)

    def alive(self) -> bool:
        return self.proc is None or self.proc.proc.poll() is None

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=10).status_code
        except httpx.HTTPError:
            return None

    def metrics(self) -> dict[str, float]:
        """/metrics samples by name (summed over labels) and by name{labels}."""
        out: dict[str, float] = {}
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return out  # a dead server: the checks read the absence
        for line in text.splitlines():
            m = _METRIC.match(line)
            if m:
                value = float(m.group(3))
                out[m.group(1)] = out.get(m.group(1), 0.0) + value
                out[m.group(1) + (m.group(2) or "")] = value
        return out

    def model(self) -> dict:
        return httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        return self.proc.stop() if self.proc is not None else None


def probe_spec(url: str) -> bool:
    """Whether the server speculates: it then refuses prompt_logprobs with a 400."""
    body = {"prompt": [5], "max_tokens": 1, "prompt_logprobs": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    return r.status_code == 400 and "speculative" in r.text


@dataclass
class ServerFacts:
    """The server's limits, from its startup log where it says them, else its options."""

    pool_pages: int | None
    page_size: int
    admission: int  # sequences in flight (max_num_seqs + max_queue)
    tokenizer_queue: int
    spec_k: int

    @classmethod
    def read(cls, log: str, options: list[str], spec_k: int | None) -> ServerFacts:
        num_pages = engine_option(options, "--num-pages")
        page_size = int(engine_option(options, "--page-size") or 64)
        pool = int(num_pages) if num_pages else None
        if m := re.search(r"KV cache: (\d+) pages x (\d+) tokens", log):
            pool, page_size = int(m.group(1)), int(m.group(2))
        seqs = int(engine_option(options, "--max-num-seqs") or 64)
        admission = seqs + int(engine_option(options, "--max-queue") or 256)
        tokenizer = int(engine_option(options, "--tokenizer-queue") or 64)
        if m := re.search(r"admission: (\d+) sequences in flight.*tokenizer queue: (\d+)", log):
            admission, tokenizer = int(m.group(1)), int(m.group(2))
        k = spec_k if spec_k is not None else spec_tokens(options)
        return cls(pool, page_size, admission, tokenizer, k)

    def pool_tokens(self, spec: bool) -> int | None:
        """Prompt + max_tokens that fit the pool: page 0 is reserved, and speculation reserves
        2k lookahead slots (LLMEngine._validate)."""
        if self.pool_pages is None:
            return None
        lookahead = 2 * self.spec_k if spec else 0
        return (self.pool_pages - 1) * self.page_size - lookahead


def wait_idle(target: Target, wait_s: float) -> dict:
    """Poll /metrics until nothing runs, waits or holds KV pages (at most `wait_s`)."""
    t0 = time.monotonic()
    while True:
        m = target.metrics()
        if not m:  # no server to ask
            return {"running": None, "waiting": None, "kv_usage": None, "waited_s": 0.0}
        state = {
            "running": m.get("mlaserve:num_requests_running"),
            "waiting": m.get("mlaserve:num_requests_waiting"),
            "kv_usage": m.get("mlaserve:kv_cache_usage_perc"),
        }
        waited = time.monotonic() - t0
        if not any(state.values()) or waited >= wait_s:
            return {**state, "waited_s": round(waited, 2)}
        time.sleep(0.25)


# ----- greedy agreement -----


def alone_body(item: Planned) -> dict:
    """The request as it is run again alone: not streamed, with the top-2 logprobs."""
    body = {k: v for k, v in item.body.items() if k not in ("stream", "stream_options")}
    if item.endpoint == "chat":
        body.update(logprobs=True, top_logprobs=max(2, body.get("top_logprobs") or 0))
    else:
        body["logprobs"] = max(2, body.get("logprobs") or 0)
    return body


def compare(load: Outcome, alone: Outcome) -> dict | None:
    """None when the alone run produced what the loaded one did, else where they part: the
    token position and the alone run's top-1 minus top-2 logprob there (a near tie flipped by
    batch-dependent numerics, or, with a big gap, a wrong token)."""
    load_text, alone_text = load.texts.get(0, ""), alone.texts.get(0, "")
    load_tokens, alone_tokens = load.tokens.get(0), alone.tokens.get(0, [])
    same = load_text == alone_text and load.finish.get(0) == alone.finish.get(0)
    if load.completion_tokens is not None:
        same = same and load.completion_tokens == alone.completion_tokens
    if load_tokens is not None:
        same = same and load_tokens == alone_tokens
    if same:
        return None
    if load_tokens is not None:
        pairs = zip(load_tokens, alone_tokens)
        pos = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        pos = min(len(load_tokens), len(alone_tokens)) if pos is None else pos
        by = "tokens"
    else:  # the token whose text holds the first differing character
        c = next((i for i, (a, b) in enumerate(zip(load_text, alone_text)) if a != b), None)
        c = min(len(load_text), len(alone_text)) if c is None else c
        pos, end = len(alone_tokens), 0
        for i, tok in enumerate(alone_tokens):
            end += len(tok)
            if end > c:
                pos = i
                break
        by = "text"
    tops = alone.tops.get(0, [])
    top = tops[pos] if pos < len(tops) else []
    return {
        "request": load.item.index,
        "response_id": load.response_id,
        "endpoint": load.item.endpoint,
        "kinds": [k for k in load.item.kinds if k not in ("greedy", "no_stream")],
        "compared_by": by,
        "position": pos,
        "logit_gap": round(top[0] - top[1], 4) if len(top) >= 2 else None,
        "alone_token": alone_tokens[pos] if pos < len(alone_tokens) else None,
        "load_token": load_tokens[pos] if load_tokens and pos < len(load_tokens) else None,
        "load_text": load_text[:120],
        "alone_text": alone_text[:120],
        "finish": [load.finish.get(0), alone.finish.get(0)],
        "completion_tokens": [load.completion_tokens, alone.completion_tokens],
    }


def near_tie(divergence: dict, tie_gap: float) -> bool:
    """Whether a `compare` divergence is at a near tie: the alone run's top-1 minus top-2
    logprob there is known and at most `tie_gap`."""
    gap = divergence["logit_gap"]
    return gap is not None and gap <= tie_gap


async def rerun_alone(
    url: str, loaded: list[Outcome], timeout_s: float, budget_s: float
) -> tuple[list[tuple[Outcome, Outcome]], int]:
    """Each request again, one at a time, until `budget_s` is spent: (loaded, alone) pairs, and
    how many were left out for time."""
    pairs = []
    t0 = time.monotonic()
    async with http_client(url, timeout_s, 2) as client:
        for i, o in enumerate(loaded):
            if time.monotonic() - t0 > budget_s:
                return pairs, len(loaded) - i
            item = Planned(o.item.index, o.item.endpoint, alone_body(o.item), o.item.kinds)
            pairs.append((o, await send(client, item)))
    return pairs, 0


# ----- report -----


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


def log_problems(log: str) -> tuple[int, list[str]]:
    """Tracebacks in the server log, and the lines around the first one."""
    lines = log.splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    excerpt = lines[max(0, hits[0] - 5) : hits[0] + 30] if hits else []
    return len(hits), excerpt


def failure_record(o: Outcome, phase: str = "load") -> dict:
    return {
        "request": o.item.index,
        "phase": phase,
        "outcome": o.outcome,
        "status": o.status,
        "error": o.stream_error or o.error,
        "endpoint": o.item.endpoint,
        "kinds": list(o.item.kinds),
        "expected": o.item.expect_400,
        "body": {
            k: (f"<{len(v)} token ids>" if k == "prompt" and isinstance(v, list) else v)
            for k, v in o.item.body.items()
            if k != "messages"
        },
    }


def print_table(report: dict) -> None:
    lim, thr, g, idle = report["limits"], report["throughput"], report["greedy"], report["idle"]
    print(f"soak seed {report['seed']}: {report['duration_s']} s of load on {report['server']}, "
          f"max_model_len {lim['max_model_len']}, request limit {lim['fit']} tokens "
          f"(KV pool {lim['pool_tokens']}), speculation {'on' if lim['spec'] else 'off'}")  # fmt: skip
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items())))
    print("statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(report["statuses"].items())))
    print("kinds sent: " + ", ".join(f"{k} {v}" for k, v in report["kinds"].items()))
    rows = [
        ("requests sent / completed", f"{report['sent']} / {thr['completed']}"),
        ("load wall s", thr["wall_s"]),
        ("output tokens (server) / per s", f"{thr['output_tokens']} / {thr['output_tok_s']}"),
        ("TTFT p50 / p99 ms (streamed)", f"{thr['ttft_p50_ms']} / {thr['ttft_p99_ms']}"),
        ("TPOT p50 / p99 ms (streamed)", f"{thr['tpot_p50_ms']} / {thr['tpot_p99_ms']}"),
        ("preemptions / aborts (server)", f"{thr['preemptions']} / {thr['aborts']}"),
        (
            "greedy identical alone",
            f"{g['identical']}/{g['compared']} ({g['fraction']}), {g['left_out']} left out",
        ),
        (
            f"+ diverged at a near tie (gap <= {g['tie_gap']})",
            f"{g['at_near_ties']}: agreeing {g['agreeing']}",
        ),
        (
            "after load: running / waiting / KV",
            f"{idle['running']} / {idle['waiting']} / {idle['kv_usage']} ({idle['waited_s']} s)",
        ),
        ("/health at end, exit code", f"{report['health']}, {report['exit_code']}"),
        ("tracebacks in server log", report["log_tracebacks"]),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for d in g["divergences"][:20]:
        print(f"  divergence: request {d['request']} ({d['response_id']}) at token {d['position']}"
              f", gap {d['logit_gap']}, alone {d['alone_token']!r} load {d['load_token']!r}"
              f" (by {d['compared_by']})")  # fmt: skip
    for f in report["failures"][:20]:
        print(f"  failure: request {f['request']} ({f['phase']}) {f['outcome']} {f['status']}: "
              f"{f['error']}")  # fmt: skip
    if report["log_excerpt"]:
        print("  server log at the first traceback:")
        for line in report["log_excerpt"]:
            print(f"    {line}")
    print("check                 ok")
    for name, ok in report["checks"].items():
        print(f"  {name:<20} {'yes' if ok else 'NO'}")


def server_env(pairs: list[str]) -> dict[str, str]:
    """`--server-env NAME=VALUE` pairs -> the started server's extra environment."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--server-env {pair!r}: expected NAME=VALUE")
        env[name] = value
    return env


def soak(args: argparse.Namespace, options: list[str], seed: int) -> dict:
    if args.url:
        target = Target(
            args.url.rstrip("/"), None, Path(args.server_log) if args.server_log else None
        )
    else:
        log_path = Path(args.server_log or f"/tmp/soak-server-{seed}.log")
        env = server_env(args.server_env)
        target = Target.start(args.model, log_path, options, args.startup_timeout_s, env)
    try:
        return _soak(args, options, seed, target)
    finally:
        target.stop()


def _soak(args: argparse.Namespace, options: list[str], seed: int, target: Target) -> dict:
    info = target.model()
    config = Path(info.get("root") or "") / "config.json"
    vocab = args.vocab_size or (
        json.loads(config.read_text())["vocab_size"] if config.is_file() else 4096
    )
    spec = probe_spec(target.url)
    facts = ServerFacts.read(target.log(), options, args.spec if args.spec else None)
    if spec and not facts.spec_k:
        facts.spec_k = 4  # speculating with an unknown k: assume 4 (8 lookahead slots)
    limits = Limits(info["max_model_len"], vocab, args.max_tokens, facts.pool_tokens(spec), spec)
    arrivals = Arrivals(
        args.burst_min, args.burst_max, args.steady_min, args.steady_max, args.gap_s
    )
    concurrency = min(args.concurrency, facts.tokenizer_queue)
    before = target.metrics()
    outcomes, wall = asyncio.run(
        run_load(target.url, plan(seed, limits, arrivals), args.duration_s, concurrency,
                 facts.admission, args.request_timeout_s, args.drain_timeout_s,
                 args.max_requests, target.alive)
    )  # fmt: skip
    idle = wait_idle(target, args.idle_wait_s)
    after = target.metrics()  # {} from a dead server

    # Greedy agreement: a seeded sample of the greedy requests, each again alone.
    eligible = [o for o in outcomes if o.item.greedy_checkable and o.outcome == "ok"]
    chosen = random.Random(seed + 1).sample(eligible, min(len(eligible), args.max_reruns))
    chosen.sort(key=lambda o: o.item.index)
    pairs: list[tuple[Outcome, Outcome]] = []
    if target.alive():
        pairs, _ = asyncio.run(
            rerun_alone(target.url, chosen, args.request_timeout_s, args.rerun_budget_s)
        )
    rerun_failed = [failure_record(a, "rerun") for _, a in pairs if a.outcome != "ok"]
    divergences = [d for o, a in pairs if a.outcome == "ok" and (d := compare(o, a)) is not None]
    compared = sum(1 for _, a in pairs if a.outcome == "ok")
    fraction = (compared - len(divergences)) / compared if compared else None
    at_ties = sum(1 for d in divergences if near_tie(d, args.tie_gap))
    agreeing = (compared - len(divergences) + at_ties) / compared if compared else None

    health = target.health()
    alive = target.alive()
    exit_code = target.stop() if target.proc is not None else None
    tracebacks, excerpt = log_problems(target.log())  # the shutdown's too

    counts = Counter(o.outcome for o in outcomes)
    statuses = Counter(str(o.status) if o.status is not None else "none" for o in outcomes)
    kinds = Counter(k for o in outcomes for k in o.item.kinds)
    ok = [o for o in outcomes if o.outcome == "ok"]
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    abort_key = (
        f'mlaserve:request_success_total{{finished_reason="abort",model_name="{info["id"]}"}}'
    )

    def delta(name: str) -> int | None:
        return int(after[name] - before.get(name, 0)) if name in after else None

    tokens = delta("mlaserve:generation_tokens_total")

    checks = {
        "server_alive": alive and health == 200,
        "clean_exit": exit_code in (None, 0),
        "no_5xx": counts["5xx"] == 0,
        "no_stream_errors": counts["stream_error"] == 0,
        "no_lost_requests": counts["transport_error"] + counts["unfinished"] + counts["truncated"] == 0,
        "only_expected_4xx": counts["unexpected_4xx"] + counts["unexpected_200"] == 0,
        "no_tracebacks": tracebacks == 0,
        "idle_after_load": idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_usage"] == 0,
        "greedy_agreement": agreeing is not None and agreeing >= args.min_agreement,
        "reruns_ok": not rerun_failed,
        "completed_some": len(ok) > 0,
    }  # fmt: skip
    failures = [failure_record(o) for o in outcomes if o.outcome in FAILURES] + rerun_failed
    return {
        "bench": "soak",
        "seed": seed,
        "duration_s": args.duration_s,
        "server": "url " + target.url if args.url else "self-started server",
        "server_options": options,
        "server_env": server_env(args.server_env),
        "limits": {
            "max_model_len": limits.max_model_len,
            "fit": limits.fit,
            "pool_tokens": limits.pool_tokens,
            "spec": spec,
            "spec_k": facts.spec_k,
            "vocab_size": vocab,
            "max_tokens": limits.max_tokens,
            "concurrency": concurrency,
            "admission": facts.admission,
        },
        "sent": len(outcomes),
        "outcomes": dict(counts),
        "statuses": dict(statuses),
        "kinds": {k: kinds[k] for k in KINDS if kinds[k]},
        "throughput": {
            "completed": len(ok),
            "wall_s": round(wall, 2),
            "output_tokens": tokens,
            "output_tok_s": round(tokens / wall, 2) if tokens is not None and wall else None,
            "ttft_p50_ms": _ms(quantile(ttft, 0.5)),
            "ttft_p99_ms": _ms(quantile(ttft, 0.99)),
            "tpot_p50_ms": _ms(quantile(tpot, 0.5)),
            "tpot_p99_ms": _ms(quantile(tpot, 0.99)),
            "streams_timed": len(tpot),
            "preemptions": delta("mlaserve:num_preemptions_total"),
            "aborts": delta(abort_key),
        },
        "greedy": {
            "eligible": len(eligible),
            "compared": compared,
            "identical": compared - len(divergences),
            "fraction": None if fraction is None else round(fraction, 4),
            "at_near_ties": at_ties,
            "tie_gap": args.tie_gap,
            "agreeing": None if agreeing is None else round(agreeing, 4),
            "left_out": len(eligible) - len(pairs),
            "compared_by_tokens": sum(1 for o, _ in pairs if o.tokens.get(0) is not None),
            "divergences": divergences,
        },
        "idle": idle,
        "health": health,
        "exit_code": exit_code,
        "log_tracebacks": tracebacks,
        "log_excerpt": excerpt,
        "failures": failures,
        "checks": checks,
        "ok": all(checks.values()),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Any other option goes to `mlaserve serve` (or describes the --url server).",
    )
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    ap.add_argument("--duration-s", type=float, default=480.0, help="time requests are sent")
    ap.add_argument("--url", default=None, help="attach to this loopback server instead")
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped one)")
    ap.add_argument("--spec", type=int, default=0, help="k of the --url server's speculation")
    ap.add_argument("--server-log", default=None, help="where the server logs (read for facts)")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment of the started server, e.g. a switch for an A/B "
                         "(MLASERVE_STEP_RING=0); repeatable")  # fmt: skip
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the model's config")
    ap.add_argument("--max-tokens", type=int, default=256, help="largest max_tokens of the mix")
    ap.add_argument("--concurrency", type=int, default=64, help="most requests in flight")
    ap.add_argument("--burst-min", type=int, default=20)
    ap.add_argument("--burst-max", type=int, default=100)
    ap.add_argument("--steady-min", type=int, default=10)
    ap.add_argument("--steady-max", type=int, default=60)
    ap.add_argument("--gap-s", type=float, default=0.1, help="mean gap of steady arrivals")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--drain-timeout-s", type=float, default=600.0,
                    help="wait for the requests in flight after the load; then they are lost")  # fmt: skip
    ap.add_argument("--idle-wait-s", type=float, default=10.0,
                    help="wait for running / waiting / KV usage to reach 0 after the load")  # fmt: skip
    ap.add_argument("--max-reruns", type=int, default=1000, help="greedy requests rerun alone")
    ap.add_argument("--rerun-budget-s", type=float, default=600.0)
    ap.add_argument(
        "--min-agreement",
        type=float,
        default=0.99,
        help="fraction of the greedy reruns that must agree (near ties included)",
    )
    ap.add_argument("--tie-gap", type=float, default=0.05,
                    help="a divergence where the alone run's top-1 - top-2 logprob is at most "
                         "this agrees (batch-dependent numerics at a near tie)")  # fmt: skip
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args, options = parser().parse_known_args(argv)
    if args.url and not is_loopback(args.url):
        parser().error(f"--url must be a loopback address, not {args.url}")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    given = sys.argv[1:] if argv is None else argv
    rest = [a for i, a in enumerate(given)
            if not a.startswith("--seed") and (i == 0 or given[i - 1] != "--seed")]  # fmt: skip
    print(f"soak seed {seed}; replay: python3 bench/soak.py --seed {seed} {' '.join(rest)}",
          flush=True)  # fmt: skip
    report = soak(args, options, seed)
    print_table(report)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
