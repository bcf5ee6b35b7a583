"""Pieces shared by `train_default_model.py` and `eval_default_model.py`.

The default model is a tiny DeepSeek-V3 (MLA + MoE + one MTP module) trained on the Python
standard library. This module holds what both scripts must agree on: the corpus split, the token
stream layout, the MTP module, the checkpoint format and the metrics. The scripts run from
`tools/`, so Python puts this directory on `sys.path` and a plain import finds this file.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3MoE,
    DeepseekV3RMSNorm,
)

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
# Listed first so they get ids 0, 1, 2: bos 0 and eos 1 are DeepSeek-V3's config defaults.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# One file in 50 (2%) is held out, chosen by a hash of its path relative to the stdlib root, so
# the split does not move when files are added or removed elsewhere in the tree.
HELDOUT_MODULUS = 50
# Directories under the stdlib root that hold third-party code rather than the standard library.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# Prompts of the greedy samples printed by both scripts and quoted in the model card.
SAMPLE_PROMPTS = ("def fibonacci(n):", "class Stack:", "import os\n\n\ndef list_files(path):")

# Chat turns are rendered as Python comments, a form the model saw throughout training, so a chat
# request gets a comment-like continuation rather than noise (the model follows no instructions).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '# ' + message['role'] + ':\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    path: str  # POSIX path relative to the stdlib root
    text: str


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter (the base one inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0


def list_sources(root: Path) -> list[str]:
    """Sorted relative paths of every `.py` file under `root`, third-party directories excluded."""
    paths = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts) and path.is_file():
            paths.append(rel.as_posix())
    return sorted(paths)


def read_corpus(root: Path) -> tuple[list[Document], list[Document], list[str]]:
    """Returns (train documents, held-out documents, skipped paths).

    A few test files are deliberately not UTF-8 (they test source-encoding declarations); they
    are skipped rather than decoded with a guess.
    """
    train: list[Document] = []
    heldout: list[Document] = []
    skipped: list[str] = []
    for rel in list_sources(root):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        (heldout if is_heldout(rel) else train).append(Document(rel, text))
    return train, heldout, skipped


def write_documents(path: Path, docs: list[Document]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 keeps the gzip bytes identical from run to run.
    with path.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps({"path": doc.path, "text": doc.text}) + "\n").encode("utf-8"))


def read_documents(path: Path) -> list[Document]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Document(**json.loads(line)) for line in f]


def pack_documents(token_lists: list[list[int]], bos_id: int, eos_id: int) -> torch.Tensor:
    """Concatenates documents into one stream, each as `<bos> tokens <eos>` (as served prompts
    start with `<bos>`)."""
    stream: list[int] = []
    for tokens in token_lists:
        stream.append(bos_id)
        stream.extend(tokens)
        stream.append(eos_id)
    return torch.tensor(stream, dtype=torch.long)


def split_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of `seq_len + 1` tokens (inputs plus the shifted targets) that
    tile the stream with stride `seq_len`: shape (n, seq_len + 1)."""
    n = (stream.numel() - 1) // seq_len
    index = torch.arange(n)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
    return stream[index]


def subsample(windows: torch.Tensor, max_windows: int) -> torch.Tensor:
    """At most `max_windows` windows, evenly spaced over the stream (deterministic)."""
    if windows.shape[0] <= max_windows:
        return windows
    index = torch.linspace(0, windows.shape[0] - 1, max_windows).round().long()
    return windows[index]


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def make_config(
    vocab_size: int, max_position_embeddings: int, experts_implementation: str = "eager"
) -> DeepseekV3Config:
    """The default model's architecture (v2: 10 decoder layers plus one MTP module).

    The MLA dims the serving kernels see are DeepSeek-V2/V3's own: `kv_lora_rank` 512 and
    `qk_rope_head_dim` 64 make the 576-wide latent cache, and 16 heads. `qk_nope_head_dim` and
    `v_head_dim` never reach a kernel (mlaserve absorbs `kv_b_proj` into the query and the output
    in every mode), so they are shrunk to 16 each: that cuts a layer's attention from 2.98M to
    0.57M parameters (`kv_b_proj` 512 -> 16 x 32 instead of 16 x 256) and buys depth. Depth is
    the point: a draft step runs one decoder layer plus the head, so with 10 layers it costs
    about a tenth of a target step's layer work, close to what MTP costs on DeepSeek-V3.

    `experts_implementation` is transformers' MoE forward for training (not saved: the
    checkpoint loads with any). Parameters stored (bf16, experts split, MTP copies of the
    embedding and head included):
    15,483,664 (30,967,488 bytes of tensors); `train_default_model.py --sizes-only` prints them.
    """
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # the dense first layer
        moe_intermediate_size=64,  # each routed expert and the shared expert
        num_hidden_layers=10,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=64,  # low-rank queries as in V3 (exercises q_a_proj / q_a_layernorm / q_b_proj)
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=16,  # query/key content dims per head (absorbed: no kernel sees it)
        v_head_dim=16,  # 16 heads x 16 = hidden_size, as in a standard transformer
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,  # V3's value, so the serving path applies a non-trivial scale
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,  # DeepSeek's checkpoints use the interleaved (GPT-J style) rotary
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        num_nextn_predict_layers=1,
        attn_implementation="sdpa",
        experts_implementation=experts_implementation,
    )


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: a final norm of its own, then the (shared) output projection."""

    def __init__(self, config: DeepseekV3Config, head: nn.Linear | None) -> None:
        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if head is None:
            head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head = head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden_states))


class DeepseekV3MTPLayer(nn.Module):
    """One DeepSeek-V3 multi-token-prediction module.

    For position i, with h_i the main model's final hidden state (after `model.norm`, i.e. the
    input of `lm_head`) and t_{i+1} the next token:

        h'_i  = eh_proj(cat([enorm(embed(t_{i+1})), hnorm(h_i)]))
        h''   = decoder layer (MLA + MoE, pre-norm residual) over h'_0 .. h'_i at rotary positions
        logit = shared_head.head(shared_head.norm(h''_i))          -> predicts t_{i+2}

    Submodule names are DeepSeek's, so `state_dict()` keys are exactly the checkpoint's
    `model.layers.{num_hidden_layers}.*` names (after splitting the fused expert tensors).
    `embed_tokens` and `shared_head.head` are the main model's modules during training.
    """

    def __init__(
        self,
        config: DeepseekV3Config,
        embed_tokens: nn.Embedding | None = None,
        head: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if config._attn_implementation != "sdpa":
            # forward() passes no mask and relies on sdpa's is_causal path for causality.
            raise ValueError(f"MTP layer needs sdpa attention, got {config._attn_implementation}")
        hidden = config.hidden_size
        eps = config.rms_norm_eps
        if embed_tokens is None:
            embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens = embed_tokens
        self.enorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.self_attn = DeepseekV3Attention(config, layer_idx=config.num_hidden_layers)
        self.post_attention_layernorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.mlp = DeepseekV3MoE(config)
        self.shared_head = SharedHead(config, head)

    def forward(
        self,
        hidden_states: torch.Tensor,
        next_input_ids: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """hidden_states: (B, S, H) main-model h_0..h_{S-1}; next_input_ids: (B, S) tokens
        t_1..t_S; position_embeddings: rotary (cos, sin) for positions 0..S-1.
        Returns logits (B, S, V) where row i predicts t_{i+2}."""
        embeds = self.enorm(self.embed_tokens(next_input_ids))
        x = self.eh_proj(torch.cat([embeds, self.hnorm(hidden_states)], dim=-1))
        attn_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(x),
            position_embeddings=position_embeddings,
            attention_mask=None,
        )
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head(x)


def forward_main_and_mtp(
    model: DeepseekV3ForCausalLM, mtp: DeepseekV3MTPLayer, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids: (B, T). Returns main logits (B, T, V), row i predicting t_{i+1}, and MTP
    logits (B, T-1, V), row i predicting t_{i+2}."""
    hidden = model.model(input_ids=input_ids).last_hidden_state  # post-norm h_0..h_{T-1}
    logits = model.lm_head(hidden)
    seq = input_ids.shape[1] - 1
    positions = torch.arange(seq, device=input_ids.device)[None, :]
    position_embeddings = model.model.rotary_emb(hidden, positions)
    mtp_logits = mtp(hidden[:, :seq], input_ids[:, 1:], position_embeddings)
    return logits, mtp_logits


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForCausalLM,
    mtp: DeepseekV3MTPLayer,
    windows: torch.Tensor,
    batch_size: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Held-out metrics over windows of shape (n, T+1), all tokens of every window scored.

    - loss / perplexity: main-model next-token cross-entropy (nats per token) and its exp;
    - main_top1: main-model next-token accuracy;
    - mtp_loss / mtp_top1: the MTP head's cross-entropy and accuracy on t_{i+2} given the true
      t_{i+1} (teacher forcing);
    - mtp_agreement: how often the MTP argmax equals the main model's argmax at the next
      position, i.e. the greedy acceptance rate of a 1-token MTP draft under teacher forcing.
    """
    device = next(model.parameters()).device
    sums = dict.fromkeys(("nll", "correct", "mtp_nll", "mtp_correct", "mtp_agree"), 0.0)
    main_tokens = mtp_tokens = 0
    for batch in windows.split(batch_size):
        batch = batch.to(device)
        inputs = batch[:, :-1]
        autocast = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            logits, mtp_logits = forward_main_and_mtp(model, mtp, inputs)
        logits, mtp_logits = logits.float(), mtp_logits.float()
        targets, mtp_targets = batch[:, 1:], batch[:, 2:]
        main_pred, mtp_pred = logits.argmax(-1), mtp_logits.argmax(-1)
        sums["nll"] += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        sums["correct"] += (main_pred == targets).sum()
        sums["mtp_nll"] += F.cross_entropy(
            mtp_logits.flatten(0, 1), mtp_targets.flatten(), reduction="sum"
        )
        sums["mtp_correct"] += (mtp_pred == mtp_targets).sum()
        sums["mtp_agree"] += (mtp_pred == main_pred[:, 1:]).sum()
        main_tokens += targets.numel()
        mtp_tokens += mtp_targets.numel()
    values = {key: float(value) for key, value in sums.items()}
    loss = values["nll"] / main_tokens
    return {
        "windows": float(windows.shape[0]),
        "tokens": float(main_tokens),
        "loss": loss,
        "perplexity": float(torch.tensor(loss).exp()),
        "main_top1": values["correct"] / main_tokens,
        "mtp_loss": values["mtp_nll"] / mtp_tokens,
        "mtp_top1": values["mtp_correct"] / mtp_tokens,
        "mtp_agreement": values["mtp_agree"] / mtp_tokens,
    }


# ----------------------------------------------------------------------------------------------
# Checkpoint format
# ----------------------------------------------------------------------------------------------

# Kept in fp32 as in the published DeepSeek-V3 checkpoints (and transformers keeps it fp32).
FP32_SUFFIXES = ("e_score_correction_bias",)


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 fuses the routed experts into 3-D tensors (`experts.gate_up_proj` (E, 2I, H)
    with gate rows first, `experts.down_proj` (E, H, I)); DeepSeek's checkpoints store one
    Linear per expert (`experts.{e}.gate_proj.weight` ...). Converts fused to per-expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def fuse_experts(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Inverse of `split_experts` for one module's state dict (keys relative to the module)."""
    out = {k: v for k, v in state.items() if ".experts." not in f".{k}"}
    prefixes = {k.split("experts.")[0] for k in state if ".experts." in f".{k}"}
    for prefix in prefixes:

        def stack(proj: str, prefix: str = prefix) -> torch.Tensor:
            return torch.stack(
                [state[f"{prefix}experts.{e}.{proj}.weight"] for e in range(num_experts)]
            )

        out[f"{prefix}experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
        out[f"{prefix}experts.down_proj"] = stack("down_proj")
    return out


def checkpoint_state_dict(
    model: DeepseekV3ForCausalLM, mtp: DeepseekV3MTPLayer
) -> dict[str, torch.Tensor]:
    """The DeepSeek-format state dict: main model, then the MTP module under
    `model.layers.{num_hidden_layers}.`, experts split, bf16 except the routing bias."""
    mtp_prefix = f"model.layers.{model.config.num_hidden_layers}."
    state = dict(model.state_dict())
    state.update({mtp_prefix + k: v for k, v in mtp.state_dict().items()})
    out = {}
    for name, tensor in split_experts(state).items():
        dtype = torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16
        # clone: the MTP embedding/head copies share storage with the main model's.
        out[name] = tensor.detach().to("cpu", dtype).contiguous().clone()
    return out


def save_checkpoint(folder: Path, model: DeepseekV3ForCausalLM, mtp: DeepseekV3MTPLayer) -> None:
    """Writes `config.json` and `model.safetensors` in DeepSeek-V3's layout."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        checkpoint_state_dict(model, mtp), str(folder / "model.safetensors"), {"format": "pt"}
    )
    config = model.config.to_diff_dict()
    config.update(
        architectures=["DeepseekV3ForCausalLM"],
        num_nextn_predict_layers=1,
        dtype="bfloat16",
        # The keys below are implied by model_type for transformers but spelled out in DeepSeek's
        # published config.json, which is what other readers (vLLM, SGLang, mlaserve) parse.
        torch_dtype="bfloat16",
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
        rope_theta=config["rope_parameters"]["rope_theta"],
        rope_scaling=None,
    )
    # Runtime switches of this training run, not properties of the checkpoint.
    for key in ("_attn_implementation_autoset", "attn_implementation", "experts_implementation"):
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_mtp_layer(folder: Path, model: DeepseekV3ForCausalLM) -> DeepseekV3MTPLayer:
    """Builds a stand-alone MTP module (own embedding and head copies) from the checkpoint's
    `model.layers.{num_hidden_layers}.*` tensors, in the main model's dtype and device."""
    config = model.config
    prefix = f"model.layers.{config.num_hidden_layers}."
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = [name for name in f.keys() if name.startswith(prefix)]  # noqa: SIM118 (no __iter__)
        state = {name.removeprefix(prefix): f.get_tensor(name) for name in names}
    param = next(model.parameters())
    mtp = DeepseekV3MTPLayer(config)
    mtp.load_state_dict(fuse_experts(state, config.n_routed_experts), strict=True)
    return mtp.to(device=param.device, dtype=param.dtype).eval()
