"""A tokenizer folder whose class is Python code it ships, as Kimi-K2's and Moonlight's are
(their tokenizer_config.json `auto_map` names `tokenization_kimi.TikTokenTokenizer`): here a
byte tokenizer of our own, so the tests need neither a download nor tiktoken.

`write_remote_code_tokenizer(folder)` writes `tokenization_bytes.py` (the class, a
`PreTrainedTokenizer`: ids 0-2 are <bos> <eos> <pad>, then one id per UTF-8 byte; a larger
model vocabulary's other ids decode to nothing) and a
tokenizer_config.json that maps AutoTokenizer to it, with a chat template. No tokenizer.json:
only the shipped code can load the folder, as with Kimi-K2.
"""

from __future__ import annotations

import json
from pathlib import Path

CLASS = "tokenization_bytes.BytesTokenizer"
NUM_SPECIAL = 3  # <bos> <eos> <pad>
VOCAB_SIZE = NUM_SPECIAL + 256

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)

_MODULE = '''"""One id per UTF-8 byte after three special tokens (a test's stand-in for Kimi's tiktoken
tokenizer: Python code shipped with the checkpoint)."""

from transformers import PreTrainedTokenizer

SPECIAL = ["<bos>", "<eos>", "<pad>"]


class BytesTokenizer(PreTrainedTokenizer):
    vocab_files_names = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self._vocab = {t: i for i, t in enumerate(SPECIAL)}
        self._vocab.update({f"<0x{b:02X}>": len(SPECIAL) + b for b in range(256)})
        self._tokens = {i: t for t, i in self._vocab.items()}
        kwargs.setdefault("bos_token", "<bos>")
        kwargs.setdefault("eos_token", "<eos>")
        kwargs.setdefault("pad_token", "<pad>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        return [f"<0x{b:02X}>" for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token):
        return self._vocab[token]

    def _convert_id_to_token(self, index):
        # ids past the bytes (a model's larger vocabulary) read as nothing
        return self._tokens.get(index, "<unused>")

    def convert_tokens_to_string(self, tokens):
        data = bytes(int(t[3:5], 16) for t in tokens if t.startswith("<0x"))
        return data.decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        ids = [self.bos_token_id] + token_ids_0
        return ids if token_ids_1 is None else ids + token_ids_1

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def write_remote_code_tokenizer(folder: Path) -> Path:
    """Write the tokenizer into `folder` (created if needed); -> `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenization_bytes.py").write_text(_MODULE)
    config = {
        "auto_map": {"AutoTokenizer": [CLASS, None]},
        "tokenizer_class": "BytesTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder
