"""The engine's host time per step, early and late in long generations (issue 13).

    python3 bench/host_overhead.py [--model PATH] [--device cpu|cuda] [--streams 64]
                                   [--output-len 2000] [--kinds delta cumulative]
                                   [--clock wall|thread] [--threads N] [--params sampled|greedy]

`--streams` requests decode `--output-len` tokens each, all at once. `--params sampled` (the
default): temperature 0.8, logprobs=1, a stop string: every per-token path of `_postprocess` runs.
`--params greedy`: what `bench/decode.py` times on the GPU (temperature 0, no logprobs, no stop
strings), the case that sets the TPOT of a plain decode. Each step is split into device work, the
model forward and the sampler (on CUDA synchronised, so it is not charged to the host), and host
work: everything else (schedule, host batch, input buffers, sampling-batch build, the D2H copy's
bookkeeping, postprocess: append, detokenize, stop check, output objects). The table gives the
median host time of the steps where the outputs were ~10 tokens long (steps 6-15) and of the
last ten steps (~`--output-len` tokens), and the growth between them, per output kind:

    delta       what the HTTP service asks for (`RequestOutputKind.DELTA`): O(new tokens)
    cumulative  the offline default: every output copies the whole history, O(length) per step

On CPU the forward is host work too, but it is excluded all the same: the figure is the part of
a step that a CUDA-graph replay cannot hide. Prints a table and one JSON line. Not a test.

`--clock thread` times with the engine thread's CPU time instead of wall time: on a machine
shared with other work, wall time also counts the time the thread waited for a core, and ten
steps' medians then swing by tens of percent between runs of the same code. With `--threads 1`
(torch runs every op on the calling thread) the thread's CPU time is all of a step's host work.

`--fake-forward` replaces the model forward by random logits of the right shape: the host work
measured is unchanged (the sampler, the D2H copy and everything around them still run), but a
CPU run of 64 x 2000 tokens then takes minutes instead of hours. Results say which was used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# This checkout's package, not whatever an editable install elsewhere points at.
# Appended, not prepended: a tree on PYTHONPATH (an A/B's old one) is the mlaserve imported.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from mlaserve.config import EngineConfig
from mlaserve.llm_engine import LLMEngine
from mlaserve.sampling_params import RequestOutputKind, SamplingParams

KINDS = {"delta": RequestOutputKind.DELTA, "cumulative": RequestOutputKind.CUMULATIVE}


PHASES = ("schedule", "build_host_batch", "make_batch", "postprocess")


class _Clock:
    """Accumulates the time spent in wrapped callables during one step."""

    def __init__(self, device: torch.device, now: Callable[[], float]) -> None:
        self.device = device
        self.now = now
        self.device_s = 0.0
        self.phase_s = dict.fromkeys(PHASES, 0.0)

    def phase(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = self.now()
            out = fn(*args, **kwargs)
            self.phase_s[name] += self.now() - t0
            return out

        return timed

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t0 = self.now()
            out = fn(*args, **kwargs)
            self.sync()
            self.device_s += self.now() - t0
            return out

        return timed


def run(
    engine: LLMEngine,
    kind: RequestOutputKind,
    streams: int,
    output_len: int,
    fake_forward: bool,
    now: Callable[[], float],
    greedy: bool = False,
) -> dict:
    clock = _Clock(engine.runner.device, now)
    runner = engine.runner
    vocab = engine.model_config.vocab_size
    # Bench-only instrumentation: time the device work; what is left of a step is host work.
    sampler = runner.sampler
    forward = type(runner).forward_with_hidden.__get__(runner)
    if fake_forward:
        gen = torch.Generator(device=runner.device).manual_seed(0)
        hidden_size = engine.model_config.hidden_size

        def forward(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            rows = batch.logits_indices.shape[0]
            logits = torch.randn(rows, vocab, generator=gen, device=runner.device) * 4
            return logits, torch.zeros(batch.num_tokens, hidden_size, device=runner.device)

    # Every forward goes through forward_with_hidden (forward and the graph runner call it).
    runner.forward_with_hidden = clock.wrap(forward)
    runner.sampler = clock.wrap(sampler)
    scheduler = engine.scheduler
    scheduler.schedule = clock.phase("schedule", type(scheduler).schedule.__get__(scheduler))
    runner.build_host_batch = clock.phase(
        "build_host_batch", type(runner).build_host_batch.__get__(runner)
    )
    runner.make_batch = clock.phase("make_batch", type(runner).make_batch.__get__(runner))
    engine._postprocess = clock.phase("postprocess", type(engine)._postprocess.__get__(engine))
    phases: list[dict[str, float]] = []
    if greedy:
        params = SamplingParams(
            max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind=kind
        )
    else:
        params = SamplingParams(
            max_tokens=output_len, temperature=0.8, seed=1, ignore_eos=True, logprobs=1,
            stop=["\x00never\x00"], output_kind=kind,
        )  # fmt: skip
    for i in range(streams):
        engine.add_request(
            f"{kind.name}-{i}", [(7 * i + 13 * j) % vocab for j in range(32)], params
        )
    host_ms: list[float] = []  # per step, after the prefill
    lengths: list[int] = []
    while engine.has_unfinished_requests():
        clock.device_s = 0.0
        clock.phase_s = dict.fromkeys(PHASES, 0.0)
        clock.sync()
        t0 = now()
        outputs = engine.step()
        clock.sync()
        total = now() - t0
        if outputs:
            host_ms.append((total - clock.device_s) * 1e3)
            phases.append({k: v * 1e3 for k, v in clock.phase_s.items()})
            lengths.append(max(o.metrics.num_generation_tokens for o in outputs))
            if len(host_ms) % 250 == 0:
                print(f"  {kind.name.lower()}: step {len(host_ms)}", file=sys.stderr, flush=True)
    del runner.forward_with_hidden, runner.build_host_batch, runner.make_batch  # the class's
    del scheduler.schedule, engine._postprocess
    runner.sampler = sampler
    early = [ms for ms, n in zip(host_ms, lengths, strict=True) if 6 <= n <= 15]
    late = host_ms[-10:]
    e, lt = statistics.median(early), statistics.median(late)
    early_steps = [i for i, n in enumerate(lengths) if 6 <= n <= 15]

    def phase_ms(steps: list[int]) -> dict[str, float]:
        return {k: round(statistics.median(phases[i][k] for i in steps), 3) for k in PHASES}

    return {"kind": kind.name.lower(), "host_ms_at_10": round(e, 3),
            f"host_ms_at_{output_len}": round(lt, 3), "growth_pct": round(100 * (lt / e - 1), 1),
            "steps": len(host_ms), "phases_ms_at_10": phase_ms(early_steps),
            f"phases_ms_at_{output_len}": phase_ms(list(range(len(host_ms) - 10, len(host_ms))))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the shipped model")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=2000)
    parser.add_argument(
        "--kinds", nargs="+", choices=sorted(KINDS), default=["delta", "cumulative"]
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--clock", choices=["wall", "thread"], default="wall", help="wall or thread CPU time"
    )
    parser.add_argument("--fake-forward", action="store_true", help="random logits, no model")
    parser.add_argument(
        "--params", choices=["sampled", "greedy"], default="sampled", help="see the docstring"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs: dict[str, Any] = {"device": args.device, "max_num_seqs": args.streams,
                              "max_model_len": args.output_len + 64}  # fmt: skip
    if args.model:
        kwargs["model"] = args.model
    engine = LLMEngine(EngineConfig(**kwargs))
    engine.warmup()
    # Logprob entries decode each sampled token once (Tokenizer.id_to_piece caches it). Decode
    # the whole vocabulary first: otherwise early steps also pay for first-seen tokens, which
    # late steps do not, and the growth reads lower than it is.
    for token in range(engine.model_config.vocab_size):
        engine.tokenizer.id_to_piece(token)
    now = time.thread_time if args.clock == "thread" else time.perf_counter
    greedy = args.params == "greedy"
    rows = [
        run(engine, KINDS[k], args.streams, args.output_len, args.fake_forward, now, greedy)
        for k in args.kinds
    ]
    n = args.output_len
    forward = "fake (random logits)" if args.fake_forward else "the model"
    print(f"host time per step ({args.clock} clock), {args.streams} streams, {args.params} "
          f"params, device {engine.runner.device}, forward: {forward}")  # fmt: skip
    print(f"{'kind':<12}{'at 10 (ms)':>12}{f'at {n} (ms)':>14}{'growth':>9}")
    for r in rows:
        at_n = r[f"host_ms_at_{n}"]
        print(f"{r['kind']:<12}{r['host_ms_at_10']:>12.3f}{at_n:>14.3f}{r['growth_pct']:>8.1f}%")
        for phase in PHASES:
            a, b = r["phases_ms_at_10"][phase], r[f"phases_ms_at_{n}"][phase]
            print(f"  {phase:<18}{a:>8.3f}{b:>14.3f}")
    print(json.dumps({"bench": "host_overhead", "streams": args.streams, "output_len": n,
                      "device": str(engine.runner.device), "fake_forward": args.fake_forward,
                      "clock": args.clock, "params": args.params,
                      "results": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
