"""Tensor-parallel greedy agreement against TP1, on the GPU host (issue 42, "Correctness").

    python3 bench/tp_agreement.py                                    # the default model
    python3 bench/tp_agreement.py --model /tmp/v3lite                # bench/make_checkpoint.py
    python3 bench/tp_agreement.py --model /tmp/v3lite --load-format dummy   # within TP2 only

Per model: `--prompts` greedy prompts (bench/soak.py's word mix) x `--max-tokens` tokens at TP1,
then TP2 (and TP4 when 4 GPUs are visible), in the served configuration (bf16, FP8 KV, CUDA
graphs with the collectives inside, piecewise prefill graphs, overlap scheduling). Also TP2
eager (no graphs) against TP2 with graphs, and TP2 with MTP speculation (`--spec K`, when the
checkpoint has an MTP layer) against TP2 without. Each variant runs in a fresh process, as a
server would: one tensor-parallel engine per process.

Reported per variant against its reference: how many completions are identical, where the others
first part (token position), the reference's top-1 minus top-2 logprob there (a near-tie that
bf16 reduction order may flip is small; a wrong token would part at a large margin), and the
first-step logits' max |diff| over every prompt (the first sampled position, whole vocabulary, fp32
logits as the sampler sees them). A printed table and a JSON line. Not a test.

`--deterministic`: every variant in the deterministic mode (`deterministic_inference`: batch-
and TP-invariant kernels, every split sum in one fixed tree): TP-N must then equal TP1 bit for
bit, so every completion is identical and the first-step logits differ by 0. Its prefill
attention is quadratic in the prompt (each row re-reads its prefix): `--prompt-words 40 400`
keeps the run to minutes.

`--dtype float32`: every variant in float32 (weights, activations and KV; the reference
attention backend, eager): the reduction-order differences between 1 and N ranks shrink from
bf16's ~1e-2 to ~1e-6, so the near-ties they flip in bf16 mostly stop flipping. What still parts
is then a near-tie at fp32's scale, or a sharding bug.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import _text  # the soak's prompt words

from mlaserve import LLM, SamplingParams
from mlaserve.config import ModelConfig


def _first_logits(llm: LLM) -> dict[str, torch.Tensor]:
    """Record each request's first sampled logits row (fp32, on the host) as the engine samples
    it: `ModelRunner.sample_async` wrapped (measurement only)."""
    runner, seen = llm.engine.runner, {}
    sample_async = runner.sample_async

    def recording(logits, sched, *args, **kwargs):
        for i, r in enumerate(sched.sampled_requests):
            if r.request_id not in seen:
                seen[r.request_id] = logits[i].float().cpu()
        return sample_async(logits, sched, *args, **kwargs)

    runner.sample_async = recording
    return seen


def run(name: str, engine_kwargs: dict, prompts: list[str], args, margins: bool) -> dict:
    t0 = time.time()
    llm = LLM(model=args.model, load_format=args.load_format, num_pages=args.num_pages,
              max_model_len=args.max_model_len, device=args.device,
              enable_prefix_caching=False,  # each run prefills its prompts (runs are compared)
              **engine_kwargs)  # fmt: skip
    engine = llm.engine
    first = _first_logits(llm) if "num_speculative_tokens" not in engine_kwargs else None
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    row = {
        "variant": name,
        "ids": [list(o.outputs[0].token_ids) for o in outs],
        "first": [first[o.request_id] for o in outs] if first is not None else None,
        "graph_replays": engine.get_stats().num_graph_replays,
        "max_in_flight": engine.ledger.max_in_flight,
    }
    if margins:  # the reference's top-1 minus top-2 logprob at every position
        scored = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                logprobs=2)  # fmt: skip
        again = llm.generate(prompts, scored, use_tqdm=False)
        row["margins_ids"] = [list(o.outputs[0].token_ids) for o in again]
        row["margins"] = [
            [
                (lambda t: t[0] - t[1])(sorted((x.logprob for x in d.values()), reverse=True))
                for d in o.outputs[0].logprobs
            ]
            for o in again
        ]
    llm.shutdown()
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    row["s"] = round(time.time() - t0, 1)
    return row


def compare(got: dict, ref: dict) -> dict:
    firsts = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        for a, b in zip(got["ids"], ref["ids"], strict=True)
    ]
    parted = [(k, i) for k, i in enumerate(firsts) if i is not None]
    gaps = []
    for k, i in parted:  # the reference's margin where it parts (if its scored run agrees there)
        if "margins" in ref and ref["margins_ids"][k][: i + 1] == ref["ids"][k][: i + 1]:
            gaps.append(round(ref["margins"][k][i], 4))
    out = {
        "variant": got["variant"],
        "reference": ref["variant"],
        "identical": len(firsts) - len(parted),
        "of": len(firsts),
        "identical_pct": round(100 * (len(firsts) - len(parted)) / len(firsts), 1),
        "first_divergence": sorted(i for _, i in parted),
        "ref_top1_top2_gap_there": gaps,
        "graph_replays": got["graph_replays"],
        "max_in_flight": got["max_in_flight"],
        "s": got["s"],
    }
    if got["first"] is not None and ref["first"] is not None:
        diffs = [(a - b).abs().max().item() for a, b in zip(got["first"], ref["first"])]
        out["first_logits_max_abs_diff"] = max(diffs)
        out["first_logits_median_max_abs_diff"] = statistics.median(diffs)
    return out


FLOAT32 = {
    "dtype": "float32",
    "kv_cache_dtype": "auto",
    "attention_backend": "reference",
    "cuda_graph": False,
    "piecewise_cuda_graph": False,
}


# --dtype -> the options every variant adds
DTYPE_OPTIONS = {"auto": {}, "float32": FLOAT32, "bfloat16": {"dtype": "bfloat16"}}


def variant_kwargs(name: str, args) -> dict:
    """The engine options of a variant: tp1, tpN, tp2_eager, tp2_mtpK (+ --dtype's)."""
    extra = dict(DTYPE_OPTIONS[args.dtype])
    if args.deterministic:
        extra["deterministic_inference"] = True
    if name == "tp2_eager":
        return {"tensor_parallel_size": 2, "cuda_graph": False, "piecewise_cuda_graph": False,
                **extra}  # fmt: skip
    if name.startswith("tp2_mtp"):
        k = int(name[len("tp2_mtp") :])
        return {"tensor_parallel_size": 2, "num_speculative_tokens": k, **extra}
    n = int(name[2:])
    return {"tensor_parallel_size": n, **extra} if n > 1 else dict(extra)


def isolated(name: str, margins: bool, args) -> dict:
    """Run one variant in a fresh process (one tensor-parallel engine per process, as served: a
    second group in one process would fall back to NCCL, custom_all_reduce.py; and each variant
    frees its GPUs on exit)."""
    with tempfile.TemporaryDirectory(prefix="tp-agreement-") as tmp:
        out = Path(tmp) / "row.pt"
        cmd = [sys.executable, __file__, "--run", name, "--out", str(out),
               "--load-format", args.load_format, "--prompts", str(args.prompts),
               "--max-tokens", str(args.max_tokens), "--num-pages", str(args.num_pages),
               "--seed", str(args.seed), "--device", args.device, "--dtype", args.dtype,
               "--prompt-words", *map(str, args.prompt_words)]  # fmt: skip
        cmd += ["--deterministic"] if args.deterministic else []
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
        cmd += ["--margins"] if margins else []
        subprocess.run(cmd, check=True)
        return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the shipped one)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", type=int, default=2, help="MTP draft tokens for the spec variant")
    ap.add_argument("--tp", type=int, nargs="*", default=None, help="default: 2, and 4 if visible")
    ap.add_argument("--num-pages", type=int, default=2000, help="a fixed KV pool per rank")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the engine's")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (gloo)")
    ap.add_argument("--dtype", default="auto", choices=list(DTYPE_OPTIONS),
                    help="float32: every variant in fp32 (docstring); bfloat16: the CPU's "
                    "torch path in bf16 (auto is fp32 there)")  # fmt: skip
    ap.add_argument("--deterministic", action="store_true",
                    help="every variant with deterministic_inference (docstring)")  # fmt: skip
    ap.add_argument("--prompt-words", type=int, nargs=2, default=(40, 4000),
                    metavar=("LO", "HI"), help="each prompt's words, uniform in [LO, HI]")  # fmt: skip
    ap.add_argument("--run", help=argparse.SUPPRESS)  # internal: one variant, in this process
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--margins", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [_text(rng, rng.randint(*args.prompt_words)) for _ in range(args.prompts)]
    if args.run:
        row = run(args.run, variant_kwargs(args.run, args), prompts, args, args.margins)
        torch.save(row, args.out)
        return
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    sizes = args.tp or [n for n in (2, 4) if n <= gpus]
    device_name = torch.cuda.get_device_name() if gpus else args.device
    mc = ModelConfig.from_pretrained(args.model) if args.model else None
    has_mtp = mc is None or mc.num_nextn_predict_layers > 0
    # Dummy weights are drawn per rank from each shard's own shape (model/dummy_weights.py), so
    # a TP-N dummy model is not TP1's model split: only the comparisons within one TP size hold.
    same_model = args.load_format != "dummy"
    if not same_model:
        print("load format dummy: TP-N and TP1 draw different weights; tpN vs tp1 not compared")
    runs = {"tp1": isolated("tp1", True, args)} if same_model else {}
    rows = []
    for n in sizes:
        runs[f"tp{n}"] = isolated(f"tp{n}", False, args)
        if same_model:
            rows.append(compare(runs[f"tp{n}"], runs["tp1"]))
    if 2 in sizes:
        rows.append(compare(isolated("tp2_eager", False, args), runs["tp2"]))
        if has_mtp and args.spec:
            rows.append(compare(isolated(f"tp2_mtp{args.spec}", False, args), runs["tp2"]))
    print(f"model {args.model or 'default'} ({args.load_format}), {device_name}"
          f" x{gpus}, {args.prompts} prompts x {args.max_tokens} tokens, greedy, dtype "
          f"{args.dtype}{', deterministic' if args.deterministic else ''}, prompts of "
          f"{args.prompt_words[0]}-{args.prompt_words[1]} words")  # fmt: skip
    print(f"{'variant':>10} {'vs':>5} {'identical':>10} {'first part (min/med)':>21} "
          f"{'max gap there':>13} {'logits max|d|':>13} {'replays':>8} {'s':>6}")  # fmt: skip
    for r in rows:
        fd = r["first_divergence"]
        where = f"{fd[0]}/{statistics.median(fd):.0f}" if fd else "-"
        gap = f"{max(r['ref_top1_top2_gap_there']):.3f}" if r["ref_top1_top2_gap_there"] else "-"
        lg = r.get("first_logits_max_abs_diff")
        print(f"{r['variant']:>10} {r['reference']:>5} {r['identical']:>4}/{r['of']:<3} "
              f"({r['identical_pct']:5.1f}%) {where:>14} {gap:>13} "
              f"{'-' if lg is None else f'{lg:.3g}':>13} {r['graph_replays']:>8} {r['s']:>6}")  # fmt: skip
    print(json.dumps({
        "bench": "tp_agreement", "model": args.model or "default", "load_format": args.load_format,
        "dtype": args.dtype, "deterministic": args.deterministic,
        "prompt_words": list(args.prompt_words), "device": device_name, "gpus": gpus,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens, "tp1_s": runs["tp1"]["s"] if same_model else None, "rows": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
