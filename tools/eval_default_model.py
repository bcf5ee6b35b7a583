"""Held-out perplexity and MTP top-1 accuracy of the default model, on CPU in fp32.

    python tools/eval_default_model.py \
        --model mlaserve/assets/default-model \
        --heldout tools/data/default_model_heldout.jsonl.gz

The held-out files are the ones `train_default_model.py` set aside (2% of the stdlib by a hash of
the path) and wrote out, because the interpreter running this script may have a different
stdlib than the one the model was trained on. They are packed as in training (`<bos> file <eos>`,
concatenated) and cut into non-overlapping windows of `--seq-len` + 1 tokens; when there are
more than `--max-windows`, that many are taken evenly spaced over the stream. Every token of a
chosen window is scored.

The main model is `transformers.DeepseekV3ForCausalLM.from_pretrained(folder)`; the MTP module
is `default_model_common.DeepseekV3MTPLayer`, loaded from the checkpoint's
`model.layers.{num_hidden_layers}.*` tensors (its own embedding and head copies included).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import transformers
from default_model_common import (
    SAMPLE_PROMPTS,
    evaluate,
    load_mtp_layer,
    pack_documents,
    read_documents,
    split_windows,
    subsample,
)
from transformers import AutoTokenizer, DeepseekV3ForCausalLM


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("mlaserve/assets/default-model"))
    p.add_argument(
        "--heldout", type=Path, default=Path("tools/data/default_model_heldout.jsonl.gz")
    )
    p.add_argument("--seq-len", type=int, default=1024, help="the training window length")
    p.add_argument("--max-windows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64, help="length of the greedy samples")
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    docs = read_documents(args.heldout)
    token_lists = tokenizer([d.text for d in docs], add_special_tokens=False, verbose=False)
    stream = pack_documents(
        token_lists["input_ids"], tokenizer.bos_token_id, tokenizer.eos_token_id
    )
    all_windows = split_windows(stream, args.seq_len)
    windows = subsample(all_windows, args.max_windows)

    model = DeepseekV3ForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    mtp = load_mtp_layer(args.model, model)
    metrics = evaluate(model, mtp, windows, args.batch_size)

    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        samples[prompt] = tokenizer.decode(out[0], skip_special_tokens=True)

    report = {
        "model": str(args.model),
        "heldout_files": len(docs),
        "heldout_tokens": stream.numel(),
        "windows_total": all_windows.shape[0],
        "seq_len": args.seq_len,
        "metrics": metrics,
        "samples": samples,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seconds": round(time.perf_counter() - start, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
