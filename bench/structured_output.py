"""Per-token cost of structured output (xgrammar): the grammar's host work per sampled token
(fill the row of the bitmask, accept the token) and the mask's application to the logits, and
the end-to-end decode time per token with and without a JSON schema.

    python3 bench/structured_output.py [--model PATH] [--device cpu|cuda] [--vocab-pad N]

The micro-benchmark walks a fixed valid JSON document token by token, so the grammar does the
same work whatever the model would sample. `--vocab-pad` measures the mask on a larger logits
row (e.g. 129280, DeepSeek-V3's vocabulary), since the apply cost scales with V.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mlaserve import LLM, SamplingParams
from mlaserve.engine.grammar import GrammarBackend
from mlaserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "tags", "count"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "quick brown fox", "tags": ["red", "blue"], "count": 42})


def micro(llm: LLM, device: str, vocab: int, rounds: int) -> dict[str, float]:
    tok = llm.get_tokenizer()
    backend = GrammarBackend(tok, vocab, llm.engine.eos_token_ids)
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    logits = torch.randn(1, vocab, device=device)
    fill_s = apply_s = accept_s = 0.0
    for _ in range(rounds):
        matcher = backend.matcher(StructuredOutputsParams(json=SCHEMA))
        for t in ids:
            t0 = time.perf_counter()
            bitmask = backend._bitmask[:1]
            matcher.fill_next_token_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            backend._xgr.apply_token_bitmask_inplace(
                logits, bitmask.to(device), vocab_size=vocab, indices=[0]
            )
            if device == "cuda":
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            assert matcher.accept_token(t), "the document must follow the schema"
            t3 = time.perf_counter()
            fill_s, apply_s, accept_s = fill_s + t1 - t0, apply_s + t2 - t1, accept_s + t3 - t2
    n = rounds * len(ids)
    return {
        "tokens": n,
        "fill_us": 1e6 * fill_s / n,
        "apply_us": 1e6 * apply_s / n,
        "accept_us": 1e6 * accept_s / n,
    }


def end_to_end(llm: LLM, tokens: int, rounds: int) -> dict[str, float]:
    out = {}
    for name, so in (("plain", None), ("json_schema", StructuredOutputsParams(json=SCHEMA))):
        params = SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True, structured_outputs=so
        )
        llm.generate(["def f(x):"], params, use_tqdm=False)  # warm (grammar compiled, cached)
        t0 = time.perf_counter()
        generated = 0
        for _ in range(rounds):
            res = llm.generate(["def f(x):"], params, use_tqdm=False)
            generated += len(res[0].outputs[0].token_ids)
        out[f"{name}_ms_per_token"] = 1e3 * (time.perf_counter() - t0) / generated
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab-pad", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device)
    vocab = max(args.vocab_pad, llm.engine.model_config.vocab_size)
    result = {"device": args.device, "vocab": vocab, **micro(llm, args.device, vocab, args.rounds)}
    result.update(end_to_end(llm, tokens=32, rounds=max(1, args.rounds // 4)))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
