"""Write a bf16/fp32 DeepSeek-V2/V3 checkpoint in the published FP8 block format.

    python3 tools/fp8_checkpoint.py SRC DST [--scale-name weight_scale_inv|scale] [--device cuda]

    from tools.fp8_checkpoint import quantize_checkpoint_fp8_block
    quantize_checkpoint_fp8_block(src_dir, dst_dir)

What DeepSeek-V3 / R1 / Kimi-K2 ship: every linear weight of the decoder layers (attention
q_a/q_b/q/kv_a/kv_b/o projections; dense, shared and routed expert gate/up/down) becomes
float8_e4m3fn with one fp32 `weight_scale_inv` per 128 x 128 block ([ceil(N/128), ceil(K/128)],
W = W_fp8 * scale, amax / 448 per block); embeddings, LM head, norms, the router (`mlp.gate`)
and MTP's `eh_proj` / `shared_head.head` stay as they are. config.json gets
`quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128],
activation_scheme: dynamic}`. Shards map one to one (a sharded source stays sharded, with an
index); other files (tokenizer, generation config) are copied. `--device cuda` quantises on the
GPU (a V2-Lite-sized checkpoint in seconds instead of minutes).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["QUANTIZED_KEY", "dequantize_checkpoint", "quantize_checkpoint_fp8_block"]

QUANTIZED_KEY = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj"
    r"|o_proj)|mlp\.(?:shared_experts\.|experts\.\d+\.)?(?:gate_proj|up_proj|down_proj))\.weight$"
)
# transformers' fused experts ([E, 2I, H] gate|up, [E, H, I] down), written out per expert.
FUSED_EXPERTS_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
_FP8_MAX = 448.0


def _quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> ([N, K] e4m3, [ceil(N/128), ceil(K/128)] fp32). Self-contained (no
    mlaserve import) so the format written does not depend on the code that reads it."""
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = w.new_zeros(nb * block, kb * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, block, kb, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-10) / _FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nb * block, kb * block)[:n, :k].contiguous(), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    s = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.float() * s


def _shards(path: Path) -> tuple[list[str], dict | None]:
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        return sorted(set(index["weight_map"].values())), index
    return [p.name for p in sorted(path.glob("*.safetensors"))], None


def _rewrite(
    src_dir: str | Path,
    dst_dir: str | Path,
    convert,  # (key, tensor, shard tensors) -> {key: tensor}
    config_edit,
) -> Path:
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    files, index = _shards(src)
    weight_map: dict[str, str] = {}
    for name in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(src / name, framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        for key, tensor in tensors.items():
            out.update(convert(key, tensor, tensors))
        save_file(out, dst / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, name))
        del tensors, out
    if index is not None:
        index = {"metadata": index.get("metadata", {}), "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for item in src.iterdir():
        if (
            item.is_file()
            and not item.name.endswith(".safetensors")
            and item.name
            not in (
                "model.safetensors.index.json",
                "config.json",
            )
        ):
            shutil.copy2(item, dst / item.name)
    config = json.loads((src / "config.json").read_text())
    config_edit(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def quantize_checkpoint_fp8_block(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    scale_name: str = "weight_scale_inv",
    device: str | torch.device = "cpu",
) -> Path:
    """bf16/fp32 checkpoint at src_dir -> the published FP8 block format at dst_dir (returned).
    `scale_name`: "weight_scale_inv" (DeepSeek's) or "scale" (`X.scale` instead of
    `X.weight_scale_inv`, as some re-exports write it)."""
    if scale_name not in ("weight_scale_inv", "scale"):
        raise ValueError(f"scale_name: expected 'weight_scale_inv' or 'scale', got {scale_name!r}")

    def quantized(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = _quantize(tensor.to(device))
        return {key: q.cpu(), key.removesuffix("weight") + scale_name: s.cpu()}

    def convert(key: str, tensor: torch.Tensor, _: dict) -> dict[str, torch.Tensor]:
        fused = FUSED_EXPERTS_KEY.match(key)
        if fused and tensor.dim() == 3:  # transformers' in-memory layout -> published per-expert
            base, proj = fused.group(1), fused.group(2)
            out: dict[str, torch.Tensor] = {}
            for e, w in enumerate(tensor):
                if proj == "down_proj":
                    out.update(quantized(f"{base}.{e}.down_proj.weight", w))
                else:
                    gate, up = w.chunk(2, dim=0)
                    out.update(quantized(f"{base}.{e}.gate_proj.weight", gate))
                    out.update(quantized(f"{base}.{e}.up_proj.weight", up))
            return out
        return quantized(key, tensor) if QUANTIZED_KEY.match(key) else {key: tensor}

    def edit(config: dict) -> None:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)

    return _rewrite(src_dir, dst_dir, convert, edit)


def dequantize_checkpoint(
    src_dir: str | Path, dst_dir: str | Path, dtype: torch.dtype = torch.float32
) -> Path:
    """The FP8 checkpoint at src_dir with every FP8 weight multiplied out (W_fp8 * scale) in
    `dtype` and no quantization_config: what the FP8 checkpoint means, as a plain checkpoint."""

    def convert(key: str, tensor: torch.Tensor, shard: dict) -> dict[str, torch.Tensor]:
        if key.endswith(("weight_scale_inv", ".scale")):
            return {}
        if tensor.dtype != torch.float8_e4m3fn:
            return {key: tensor}
        base = key.removesuffix("weight")
        scale = shard.get(base + "weight_scale_inv", shard.get(base + "scale"))
        return {key: _dequantize(tensor, scale.float()).to(dtype)}

    def edit(config: dict) -> None:
        config.pop("quantization_config", None)

    return _rewrite(src_dir, dst_dir, convert, edit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--scale-name", default="weight_scale_inv")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    out = quantize_checkpoint_fp8_block(
        args.src, args.dst, scale_name=args.scale_name, device=args.device
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
