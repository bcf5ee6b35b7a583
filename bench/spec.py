"""Speculative decoding on the GPU: what it buys end to end, and what one speculative step costs.

    python3 bench/spec.py [--v3lite /tmp/v3lite]     (make it: bench/make_checkpoint.py --arch v3
                                                     --mtp --out /tmp/v3lite)
                          [--default-model-costs]    (part 2 on the default model too)

Part 1, the default model (its trained MTP layer, real prompts, real accept lengths): time per
output token through `LLMEngine.step()` (all graphed) with speculation off and on (k = 1, 2, 3),
at batch sizes 1, 4, 16, 32. "on" is what the engine does (the cost policy decides per step);
"forced" overrides the policy (FORCED_SPEC) on an engine of its own per k, so every decode step
speculates and the "on" engine's policy learns only from its own steps. Each round runs,
per k, an off run and an on run back to back (which goes first alternates), then a forced one;
the on/off and forced/off ratios are medians over rounds of each round's ratio to its own off
run (the host's speed drifts between runs far apart by more than the 3% the policy is held
to), the TPOT columns medians of the runs. TPOT is per request, averaged over the batch:
(last token time - first token time) / (tokens - 1), as vLLM and SGLang report it; the batch
column is the batch's decode-phase wall time per token, which waits for the request whose drafts
were accepted least. Each (bs, k) first runs once "on" unmeasured (the policy's estimate starts
at its prior and learns from its first verified requests; that run's TPOT is printed). Each
round also runs an A/A pair: a second engine without speculation ("off2", built alike) beside
"off". Its ratio is what two identical engines differ by in this harness, against which an
on/off ratio of a policy that decided every step plain is read.

Part 2, a V2-Lite-sized DeepSeek-V3-architecture checkpoint with one MTP layer (random weights,
so accept lengths mean nothing there): per captured batch size, on the rows of real requests
(random 64-token prompts, each row its own token and position, so each routes on its own;
`step_timer.replay_step_times`), the device time of
  decode  = DECODE graph, its greedy argmax inside (a plain step: an engine without
            speculation, and a step of a speculative engine whose policy says no: it does no
            draft work),
  spec    = VERIFY graph (k+1 rows: the requests' next VERIFY batch, last token + k drafts)
            + argmax (greedy acceptance's) + DRAFT_EXTEND graph (on the argmax tokens) + DRAFT
            graph (k tokens),
  draft   = the DRAFT graph alone (top-1 + k-1 chain steps), per draft token,
the break-even accept length spec / decode (device) and the policy's (engine steps, wall time,
host work included), and each step's bytes floor: every non-expert weight
once + the routed experts its tokens touch (expected distinct experts under uniform routing,
n (1 - (1 - topk/n)^tokens), per MoE layer) over the device copy bandwidth. A verify step's
target touches experts for bs*(k+1) tokens; the draft reads the MTP layer (its experts for its
rows) once in DRAFT_EXTEND and k-1 times in the chain, and its LM head k times.

Prints a table per part and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import copy_bandwidth

from mlaserve import LLM, SamplingParams
from mlaserve.spec.spec_policy import FORCED_SPEC
from mlaserve.spec.step_timer import replay_step_times

BATCH_SIZES = (1, 4, 16, 32)
TEXTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "class Stack:\n    def __init__(self):",
    "Once upon a time,",
    "SELECT name FROM users WHERE",
    "for i in range(10):",
    "The quick brown fox",
]


def prompts_for(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.tokenizer
    return [[*tok.encode(TEXTS[i % len(TEXTS)]), 100 + i] for i in range(n)]


def tpot_ms(llm: LLM, bs: int, new_tokens: int) -> tuple[float, float, float | None]:
    """-> (mean over requests of each one's ms per output token after its first, the batch's
    decode-phase wall time per output token, mean accept length of this run or None).

    The first is TPOT as vLLM and SGLang report it (per request, then averaged); the second
    waits for the slowest request, which with speculation is the one whose drafts were accepted
    least (every request's tokens are `new_tokens`, its steps are not)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    stats0 = engine.get_stats()
    for i, p in enumerate(prompts_for(llm, bs)):
        engine.add_request(f"b{bs}-{i}-{time.monotonic_ns()}", p, params)
    engine.step()  # the prefill (and its drafts)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    per_request = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            m = out.metrics
            if out.finished and m is not None and m.num_generation_tokens > 1:
                span = m.last_token_time - m.first_token_time
                per_request.append(span / (m.num_generation_tokens - 1) * 1e3)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    stats = engine.get_stats()
    drafts = stats.spec_num_drafts - stats0.spec_num_drafts
    accept = None
    if drafts:
        emitted = sum(n * c for n, c in stats.spec_accept_lengths.items()) - sum(
            n * c for n, c in stats0.spec_accept_lengths.items()
        )
        accept = emitted / drafts
    return statistics.mean(per_request), elapsed / (new_tokens - 1) * 1e3, accept


def _window_summary(policy, kind: str, bs: int) -> str:
    """The start-up figure and the served steps behind the policy's current `kind` cost."""
    startup = policy.startup_costs
    size = startup.size_for(bs)
    first = (startup.spec_s if kind == "spec" else startup.plain_s)[size]
    now = (policy.costs.spec_s if kind == "spec" else policy.costs.plain_s)[size]
    served = policy.served_steps(kind, bs)
    seen = f"now {now * 1e3:.3f}, served n={len(served)}"
    if served:
        seen += f" median {statistics.median(served) * 1e3:.3f} max {max(served) * 1e3:.3f}"
    return f"{kind} start-up {first * 1e3:.3f} ms, {seen}"


def _ratios(run: tuple, off: tuple) -> tuple[float, float]:
    """(per-request TPOT ratio, batch TPOT ratio) of a run over the off run beside it."""
    return run[0] / off[0], run[1] / off[1]


def part1(new_tokens: int, rounds: int) -> list[dict]:
    kw = {"max_num_seqs": 32, "num_pages": 1024, "cuda_graph_batch_sizes": BATCH_SIZES}
    rows = []
    # "off2": a second engine without speculation, built like "off": an A/A pair per round
    # (off2 over off) measures what two identical engines differ by in this harness, the
    # yardstick for the 3% the policy is held to
    engines = {"off": LLM(**kw), "off2": LLM(**kw)}
    forced_engines = {}
    for k in (1, 2, 3):
        engines[k] = LLM(num_speculative_tokens=k, **kw)
        # Forced runs have an engine of their own: the policy of the "on" engine then sees what
        # a serving engine's does (its own steps, probes), not the forced runs' step costs and
        # accept lengths, taken at other moments of a host whose speed drifts between runs
        forced_engines[k] = LLM(num_speculative_tokens=k, **kw)
        forced_engines[k].engine.spec_decoder.policy.forced = FORCED_SPEC  # every step
    for bs in BATCH_SIZES:
        # rounds interleaved (per k: off and on in a pair, then forced), so host noise hits
        # all alike; each run -> (per-request TPOT, batch TPOT, accept length)
        off, on, forced = [], {k: [] for k in (1, 2, 3)}, {k: [] for k in (1, 2, 3)}
        # per round, each "on" and "forced" run over the "off" run next to it (per request
        # TPOT, then batch): the host's speed drifts by more than the 3% asked between runs
        # far apart, so ratios are taken within a pair and their median reported
        paired: dict[str, dict[int, list[tuple[float, float]]]] = {
            "on": {k: [] for k in (1, 2, 3)},
            "forced": {k: [] for k in (1, 2, 3)},
        }
        decided: dict[int, Counter] = {k: Counter() for k in (1, 2, 3)}  # the "on" runs'
        aa: list[tuple[float, float]] = []  # per round: off2 over the off run beside it
        # One unmeasured "on" run per k first: the policy's estimate is per engine and learns
        # over its first verified requests (from the prior; see spec_policy.py); what is
        # measured is the steady state. The first run's TPOT is printed, for the transient.
        for k in (1, 2, 3):
            first = tpot_ms(engines[k], bs, new_tokens)[0]
            print(f"bs {bs} k {k} first on-run (learning): TPOT {first:.3f} ms", flush=True)
        for r in range(rounds):
            # the A/A pair (which of the two runs first alternates)
            order = ("off", "off2") if r % 2 == 0 else ("off2", "off")
            runs = {name: tpot_ms(engines[name], bs, new_tokens) for name in order}
            aa.append(_ratios(runs["off2"], runs["off"]))
            for k in (1, 2, 3):
                llm = engines[k]
                policy = llm.engine.spec_decoder.policy
                before = Counter(policy.decisions)
                if (r + k) % 2:  # alternate which of the pair runs first
                    on[k].append(tpot_ms(llm, bs, new_tokens))
                    off.append(tpot_ms(engines["off"], bs, new_tokens))
                else:
                    off.append(tpot_ms(engines["off"], bs, new_tokens))
                    on[k].append(tpot_ms(llm, bs, new_tokens))
                decided[k].update(policy.decisions - before)
                paired["on"][k].append(_ratios(on[k][-1], off[-1]))
                if policy.costs is not None:  # what the decisions were made from
                    print(
                        f"bs {bs} k {k} on-run: accept estimate "
                        f"{policy.accept_length_estimate:.3f}, break-even "
                        f"{policy.costs.break_even(bs):.3f} ("
                        f"{_window_summary(policy, 'spec', bs)}; "
                        f"{_window_summary(policy, 'plain', bs)}), "
                        f"accept this run {on[k][-1][2]}",
                        flush=True,
                    )
                forced[k].append(tpot_ms(forced_engines[k], bs, new_tokens))
                paired["forced"][k].append(_ratios(forced[k][-1], off[-1]))

        def med(runs: list[tuple], i: int) -> float:
            return round(statistics.median(r[i] for r in runs), 4)

        def span(pairs: list[tuple[float, float]]) -> list[float]:
            """[min, max] of the per-request ratios of per-round pairs"""
            return [round(min(a for a, _ in pairs), 4), round(max(a for a, _ in pairs), 4)]

        print(f"bs {bs} A/A (off2/off) per round: " + " ".join(f"{a:.3f}" for a, _ in aa))
        for k in (1, 2, 3):
            print(
                f"bs {bs} k {k} on/off per round: "
                + " ".join(f"{a:.3f}" for a, _ in paired["on"][k]),
                flush=True,
            )

        for k in (1, 2, 3):
            costs = engines[k].engine.spec_decoder.policy.costs
            acc = [a for _, _, a in forced[k] if a is not None]
            rows.append(
                {
                    "bs": bs,
                    "k": k,
                    "tpot_off_ms": med(off, 0),
                    "tpot_on_ms": med(on[k], 0),
                    "tpot_forced_ms": med(forced[k], 0),
                    # medians of the per-round paired ratios (per request, batch)
                    "on_over_off": med(paired["on"][k], 0),
                    "forced_over_off": med(paired["forced"][k], 0),
                    "batch_on_over_off": med(paired["on"][k], 1),
                    "batch_forced_over_off": med(paired["forced"][k], 1),
                    # the A/A control at this batch size: two engines without speculation
                    "aa_over_off": med(aa, 0),
                    "aa_range": span(aa),
                    "on_range": span(paired["on"][k]),
                    "batch_tpot_off_ms": med(off, 1),
                    "batch_tpot_on_ms": med(on[k], 1),
                    "batch_tpot_forced_ms": med(forced[k], 1),
                    "accept_length": round(statistics.mean(acc), 3) if acc else None,
                    "break_even": round(costs.break_even(bs), 3) if costs else None,
                    # the policy's decisions over the "on" runs, "spec:pays" style keys
                    "on_decisions": {
                        f"{'spec' if spec else 'plain'}:{why}": n
                        for (spec, why), n in sorted(decided[k].items())
                    },
                }
            )
    print(
        "\ndefault model: TPOT (ms, per request, averaged) speculation off / on (policy) / "
        "forced, medians over rounds; the ratios are medians of each round's ratio to the off "
        "run beside it; batch = the batch's wall time per token (waits for its slowest request);"
        " A/A = a second engine without speculation over the first (the harness's own spread),"
        " with the per-round ranges of A/A and on/off"
    )
    print(
        " bs  k    off      on   forced  on/off forced/off | batch on/off forced/off |"
        "  A/A  A/A range   on/off range | accept  break-even  policy decisions (on runs)"
    )
    for r in rows:
        decisions = " ".join(f"{key}={n}" for key, n in r["on_decisions"].items())
        print(
            f"{r['bs']:3d} {r['k']:2d} {r['tpot_off_ms']:7.3f} {r['tpot_on_ms']:7.3f} "
            f"{r['tpot_forced_ms']:7.3f} {r['on_over_off']:6.3f}x "
            f"{r['forced_over_off']:9.2f}x |"
            f" {r['batch_on_over_off']:11.3f}x {r['batch_forced_over_off']:9.2f}x |"
            f" {r['aa_over_off']:5.3f} {r['aa_range'][0]:.3f}-{r['aa_range'][1]:.3f}"
            f" {r['on_range'][0]:.3f}-{r['on_range'][1]:.3f}"
            f" | {r['accept_length'] or 0:6.2f} {r['break_even'] or 0:11.2f}  {decisions}"
        )
    return rows


def _bytes(module: torch.nn.Module, skip=()) -> tuple[int, int]:
    """(bytes of non-routed-expert weights, bytes of routed-expert weights) of `module`."""
    dense = experts = 0
    for name, p in module.named_parameters():
        if any(s in name for s in skip) or "embed_tokens" in name:
            continue
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            experts += nbytes
        else:
            dense += nbytes
    return dense, experts


def floors_ms(llm: LLM, bs: int, k: int, bandwidth: float) -> dict[str, float]:
    mc = llm.engine.model_config
    model = llm.engine.runner.model
    n, topk = mc.n_routed_experts, mc.num_experts_per_tok
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_hidden_layers))
    t_dense, t_experts = _bytes(model, skip=("mtp.",))
    per_expert = t_experts / (moe_layers * n)
    mtp = model.mtp
    head = mtp.shared_head.head.weight
    head_bytes = head.numel() * head.element_size()
    m_dense, m_experts = _bytes(mtp)
    m_dense -= head_bytes
    m_per_expert = m_experts / n

    def touched(tokens: int) -> float:
        return n * (1 - (1 - topk / n) ** tokens)

    def target(tokens: int) -> float:
        return t_dense + touched(tokens) * per_expert * moe_layers

    def mtp_layer(tokens: int) -> float:
        return m_dense + touched(tokens) * m_per_expert

    decode = target(bs)
    spec = target(bs * (k + 1)) + mtp_layer(bs * (k + 1)) + k * head_bytes
    spec += (k - 1) * mtp_layer(bs)
    draft = (head_bytes + (k - 1) * (mtp_layer(bs) + head_bytes)) / k
    return {
        name: b / bandwidth * 1e3
        for name, b in (("decode", decode), ("spec", spec), ("draft", draft))
    }


def part2(path: str | None, k: int, iters: int, label: str) -> list[dict]:
    llm = LLM(
        path,
        num_speculative_tokens=k,
        max_num_seqs=32,
        num_pages=512,
        cuda_graph_batch_sizes=BATCH_SIZES,
    )
    engine = llm.engine
    bandwidth = copy_bandwidth(engine.runner.device)
    rows = []
    for size in BATCH_SIZES:
        t = replay_step_times(engine, size, iters)
        t["draft"] /= k  # per draft token
        costs = engine.spec_costs
        floor = floors_ms(llm, size, k, bandwidth)
        rows.append(
            {
                "bs": size,
                "k": k,
                **{f"{n}_ms": round(v * 1e3, 4) for n, v in t.items()},
                **{f"{n}_floor_ms": round(v, 4) for n, v in floor.items()},
                "break_even_device": round(t["spec"] / t["decode"], 3),
                "break_even_wall": round(costs.break_even(size), 3) if costs else None,
                "spec_over_floor": round(t["spec"] * 1e3 / floor["spec"], 3),
                "draft_step_over_decode": round(t["draft"] / t["decode"], 3),
            }
        )
    print(f"\n{label}, k={k}: device ms per step, floors, break-even")
    print(
        " bs  decode    spec  d-ext draft/tok draft/dec | floor: decode   spec | spec/floor"
        "  break-even: device  engine wall"
    )
    for r in rows:
        print(
            f"{r['bs']:3d} {r['decode_ms']:7.3f} {r['spec_ms']:7.3f} {r['draft_extend_ms']:6.3f} "
            f"{r['draft_ms']:6.3f} {r['draft_step_over_decode']:9.1%} "
            f"| {r['decode_floor_ms']:12.3f} {r['spec_floor_ms']:6.3f} "
            f"| {r['spec_over_floor']:9.2f}   {r['break_even_device']:12.2f} "
            f"{r['break_even_wall'] or 0:12.2f}"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--v3lite", default=None, help="bench/make_checkpoint.py --arch v3 --mtp")
    ap.add_argument(
        "--default-model-costs",
        action="store_true",
        help="also part 2 (step costs) on the default model: its draft step vs its decode step",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name()}
    if args.v3lite:  # first: the issue's step-cost targets
        label = "V3-lite (random weights, 1 MTP layer)"
        result["v3lite"] = part2(args.v3lite, args.k, iters=20, label=label)
        gc.collect()
        torch.cuda.empty_cache()
    if args.default_model_costs:
        label = "default model (trained, 1 MTP layer)"
        result["default_model_costs"] = part2(None, args.k, iters=20, label=label)
        gc.collect()
        torch.cuda.empty_cache()
    result["default_model"] = part1(args.new_tokens, args.rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
