"""A tiny byte-level BPE tokenizer, trained in the tests so they need no download."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "héllo wörld 你好 🙂",
    "hello world, hello there",
    "the quick brown fox jumps over the lazy dog",
    "你好 世界 你好",
    "naïve café crème brûlée",
    "🙂🙂 emoji 🙂",
] * 5

SPECIAL_TOKENS = ["<bos>", "<eos>", "<pad>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(directory: Path, tokenizer_class: str, chat_template: str | None) -> Path:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    bos = raw.token_to_id("<bos>")
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / "tokenizer.json"))
    config: dict = {
        "tokenizer_class": tokenizer_class,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that ByteLevel vocabularies are written in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
