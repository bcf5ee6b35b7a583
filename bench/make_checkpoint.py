"""Write a DeepSeek-V2-Lite-shaped checkpoint with random weights, on the machine that benchmarks
it (no download): config.json, safetensors shards, and a word-level tokenizer of the full vocab.

    python3 bench/make_checkpoint.py --out /tmp/v2lite                  # DeepSeek-V2-Lite shape
    python3 bench/make_checkpoint.py --out /tmp/v3lite --arch v3 --mtp  # same sizes, V3 layout
                                                                        # + one MTP layer

Shapes (DeepSeek-V2-Lite's config): 27 layers (the first dense), hidden 2048, 16 heads, MLA
512/64 latent, q without LoRA, 64 routed experts top-6 + 2 shared (moe_intermediate 1408),
vocab 102400: 15.7B parameters, 2.45B active per token. `--arch v3` keeps the sizes but uses
DeepSeek-V3's sigmoid routing with a score-correction bias, and `--mtp` appends one MTP module
(`model.layers.27.*`). Names and shapes come from transformers' own model built on the meta
device, so the checkpoint is laid out exactly as a published one.

Weights are N(0, 0.02) (norms 1), drawn on the GPU when there is one, written in bf16 shards of
about 4 GB. Routing over random gates is close to uniform, which is what the bytes floor of a
decode step assumes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

V2_LITE = {
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
ARCH = {
    "v2": {
        "model_type": "deepseek_v2",
        "architectures": ["DeepseekV2ForCausalLM"],
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
    },
    "v3": {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
    },
}
SHARD_BYTES = 4 << 30
STD = 0.02


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes from transformers' model on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes.update({k: tuple(v.shape) for k, v in model.named_buffers() if "e_score" in k})
    return shapes


def mtp_shapes(shapes: dict[str, tuple[int, ...]], num_layers: int, hidden: int) -> dict:
    """DeepSeek-V3's MTP module as published: a decoder layer shaped like the last (MoE) layer,
    enorm/hnorm/eh_proj, shared_head.norm, and its own embedding and head copies."""
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra = {mtp + k.removeprefix(last): s for k, s in shapes.items() if k.startswith(last)}
    extra[mtp + "enorm.weight"] = (hidden,)
    extra[mtp + "hnorm.weight"] = (hidden,)
    extra[mtp + "eh_proj.weight"] = (hidden, 2 * hidden)
    extra[mtp + "shared_head.norm.weight"] = (hidden,)
    extra[mtp + "embed_tokens.weight"] = shapes["model.embed_tokens.weight"]
    extra[mtp + "shared_head.head.weight"] = shapes["lm_head.weight"]
    return extra


def random_tensor(name: str, shape: tuple[int, ...], device: str, g: torch.Generator):
    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if "e_score_correction_bias" in name:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return (torch.randn(shape, generator=g, device=device) * STD).to(torch.bfloat16)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary: `w0 w1 ...`, specials 0 and 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--arch", choices=sorted(ARCH), default="v2")
    ap.add_argument("--mtp", action="store_true", help="append one MTP module (V3 layout)")
    ap.add_argument("--layers", type=int, default=V2_LITE["num_hidden_layers"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", type=json.loads, default={}, help="config keys, as JSON")
    args = ap.parse_args()
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    config = {**V2_LITE, **ARCH[args.arch], "num_hidden_layers": args.layers, **args.override}
    shapes = tensor_shapes(config)
    if args.mtp:
        shapes.update(mtp_shapes(shapes, args.layers, config["hidden_size"]))
        config["num_nextn_predict_layers"] = 1
    config["torch_dtype"] = "bfloat16"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(args.out, config["vocab_size"])

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(args.seed)
    weight_map, shard, shard_bytes, num_params = {}, {}, 0, 0
    names = sorted(shapes)

    def flush() -> None:
        nonlocal shard, shard_bytes
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, args.out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard, shard_bytes = {}, 0

    for name in names:
        t = random_tensor(name, shapes[name], device, g).cpu()
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        num_params += t.numel()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": num_params * 2}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    print(
        f"wrote {args.out}: {args.arch}{' + MTP' if args.mtp else ''}, {num_params / 1e9:.2f}B "
        f"parameters in {len(set(weight_map.values()))} shards, {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
