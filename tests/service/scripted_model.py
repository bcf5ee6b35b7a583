"""A tiny DeepSeek-V3 checkpoint that writes scripted replies, for tool-call and reasoning tests.

The tokenizer carries DeepSeek's own markers (`<｜tool▁calls▁begin｜>`, `<think>`, ...; the
tool and think markers not special, as in the published tokenizer) and every piece of the
scripts below as one token each. The weights make the next token a fixed function of the
current one (a bigram table), so greedy decoding follows a script from whichever token the
prompt ends with:

- every attention `o_proj` and MLP `down_proj` is zero, so the last hidden state is the
  token's embedding;
- the embedding of each scripted token is a one-hot vector (its own dimension);
- `lm_head` maps that dimension to the logit of the token that follows it.

`<｜Assistant｜>` (DeepSeek-V3's generation prompt) starts SCRIPT_V3: content, then one call.
`\\n` (the end of DeepSeek-R1's generation prompt `<｜Assistant｜><think>\\n`) starts SCRIPT_R1:
reasoning, `</think>`, content, then the same call. A forced call opening (tool_choice by name)
ends the prompt inside the call, which the table continues to its end.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_checkpoint

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
THINK, END_THINK = "<think>", "</think>"
MARKERS = [USER, ASSISTANT, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, THINK, END_THINK]

CALL = [
    CALLS_BEGIN, CALL_BEGIN, "function", SEP, "get_weather", "\n```json\n",
    '{"city": ', '"Paris", ', '"unit": "celsius"}', "\n```", CALL_END, CALLS_END, EOS,
]  # fmt: skip
SCRIPT_V3 = [ASSISTANT, "Checking", " the weather.", *CALL]
SCRIPT_R1 = ["\n", "The user", " wants weather.", END_THINK, "\n\n", "Let me check.", *CALL]
ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'

# DeepSeek-V3's layout: BOS, system, then <｜User｜>...<｜Assistant｜>. The tool names go into
# the system part, so a test can see that `tools` reached the template.
CHAT_TEMPLATE_V3 = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}\n{% endif %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "<｜User｜>{{ m['content'] }}{% elif m['role'] == 'assistant' %}<｜Assistant｜>"
    "{{ m['content'] }}<｜end▁of▁sentence｜>{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
CHAT_TEMPLATE_R1 = CHAT_TEMPLATE_V3.replace(
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}",
)
_CORPUS = "What is the weather in Paris? Hello there, tools: get weather now.\n" * 4
LOGIT = 4.0  # x sqrt(hidden_size) after the final RMSNorm: a margin of 32 logits


def make_scripted_checkpoint(root: Path) -> Path:
    path = root / "scripted"
    tokenizer = _make_tokenizer(path)
    vocab = tokenizer.get_vocab()
    ids = {}  # each scripted piece is one token
    for piece in SCRIPT_V3 + SCRIPT_R1:
        (ids[piece],) = tokenizer.encode(piece, add_special_tokens=False).ids
    config = {"vocab_size": len(vocab), "bos_token_id": vocab[BOS], "eos_token_id": vocab[EOS],
              "pad_token_id": vocab[PAD], "num_hidden_layers": 1, "first_k_dense_replace": 1,
              "max_position_embeddings": 1024}  # fmt: skip
    weights = make_checkpoint(root / "weights", "v3_dense", **config)
    for name in ("config.json", "model.safetensors"):
        (weights / name).replace(path / name)
    _force_bigrams(path, ids)
    return path


def _make_tokenizer(path: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer)
    pieces = [p for p in dict.fromkeys(SCRIPT_V3 + SCRIPT_R1) if p not in (EOS, "\n")]
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in MARKERS + pieces])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE_V3
    config_file.write_text(json.dumps(config, indent=2))
    return tok


def _force_bigrams(path: Path, ids: dict[str, int]) -> None:
    table: dict[int, int] = {}
    for script in (SCRIPT_V3, SCRIPT_R1):
        for current, following in itertools.pairwise(script):
            a, b = ids[current], ids[following]
            assert table.setdefault(a, b) == b, f"{current!r} is followed by two tokens"
    weights = load_file(path / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    assert len(table) <= hidden, "more scripted tokens than hidden dimensions"
    embed = torch.zeros_like(weights["model.embed_tokens.weight"])
    head = torch.zeros_like(weights["lm_head.weight"])
    for dim, (current, following) in enumerate(sorted(table.items())):
        embed[current, dim] = 1.0
        head[following, dim] = LOGIT
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")) or name == "model.norm.weight":
            weights[name] = (
                torch.ones_like(weights[name])
                if "norm" in name
                else torch.zeros_like(weights[name])
            )
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
