"""A thin, typed wrapper over a Hugging Face tokenizer loaded from local files.

The wrapper pins down the choices the server depends on: no network, no remote code, no
"clean up tokenization spaces" (so incremental and full decodes agree), and chat templates are
rendered to text first and then encoded without extra special tokens (the template writes BOS
itself), as vLLM does.

NOTE: HF fast tokenizers are not safe to call from several threads at once (the Rust side
raises "Already borrowed"); keep one Tokenizer per thread or serialise calls.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from mlaserve.tokenizer.tokenizer_files import TOKENIZER_FILES, remote_code_class

__all__ = ["TOKENIZER_FILES", "ChatTemplateError", "Tokenizer"]


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no chat template, or the template rejected them."""


class Tokenizer:
    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, name: str = "") -> None:
        self.hf = hf_tokenizer
        self.name = name or getattr(hf_tokenizer, "name_or_path", "")
        self._piece_cache: dict[int, str] = {}
        self._max_piece_chars: int | None = None

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], trust_remote_code: bool = False
    ) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json from a local directory. A folder whose
        tokenizer class is Python code it ships (tokenizer_config.json's `auto_map`, e.g.
        Kimi-K2's tiktoken tokenizer) loads only with `trust_remote_code`; without it, a
        `ValueError` names the class and the flag."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer path {path} is not a directory")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"tokenizer path {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                "copy the model's tokenizer there or name its folder with `tokenizer`"
            )
        custom = remote_code_class(path, trust_remote_code)  # ValueError: refused
        kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
        if custom is None and _takes_generic_fast_class(path):
            hf = PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
        else:
            # Imported here: transformers' auto classes import its modelling and generation
            # code (4.5 s of an engine process's start on the GPU host, transformers 5.17).
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(path), **kwargs)
        return cls(hf, name=str(path))

    # ---- ids <-> text ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, in O(1): for refusing a prompt that cannot
        fit before paying for tokenizing it (seconds for megabytes).

        Every token covers at most `max_piece_chars` characters of the text the model sees, so a
        text of n characters needs at least n / max_piece_chars tokens. A byte-level piece covers
        one byte per character (never fewer characters than bytes), a byte-fallback piece
        ("<0x41>") fewer characters than it spells: the bound holds for both. It needs the
        text to reach the model unshortened, so a tokenizer with a normalizer (which may drop
        or merge characters) gets the trivial bound 0.
        """
        if self.max_piece_chars == 0:
            return 0
        return -(-len(text) // self.max_piece_chars)

    @property
    def max_piece_chars(self) -> int:
        """Longest vocabulary piece (added tokens included), in characters; 0 when
        `min_num_tokens` cannot bound anything. Computed once (a pass over the vocabulary)."""
        if self._max_piece_chars is None:
            backend = self.backend_tokenizer
            if backend is None or backend.normalizer is not None:
                self._max_piece_chars = 0
            else:
                pieces = backend.get_vocab(with_added_tokens=True)
                self._max_piece_chars = max(map(len, pieces), default=0)
        return self._max_piece_chars

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer | None:
        """The Rust `tokenizers.Tokenizer` behind a fast tokenizer (None for others). Its
        `decode` is `self.decode` without the transformers layer (which never cleans up spaces
        here)."""
        return getattr(self.hf, "backend_tokenizer", None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary pieces (byte-level BPE shows a space as "Ġ")."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def id_to_piece(self, token_id: int) -> str:
        """Decoded text of one token, for logprob display. A token holding part of a multi-byte
        character decodes to U+FFFD, as in vLLM."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self.decode([token_id], skip_special_tokens=False)
            self._piece_cache[token_id] = piece
        return piece

    # ---- chat ----

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the tokenizer's own chat template (or `chat_template`, the server's
        --chat-template) makes of `messages`. Extra keyword arguments reach the template (e.g.
        `tools=...`, or `thinking=True` for DeepSeek-V3.1)."""
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        elif not self.hf.chat_template:
            raise ChatTemplateError(
                f"the tokenizer at {self.name!r} has no chat template; use the completions API "
                "or add a chat_template to its tokenizer_config.json"
            )
        _check_messages(messages)
        try:
            text = self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.TemplateError as e:  # the template's own raise_exception(...) lands here
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        text = self.render_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---- special tokens ----

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (the model's logits
        may be wider: checkpoints pad the embedding)."""
        return len(self.hf)


def _takes_generic_fast_class(path: Path) -> bool:
    """Whether the folder loads as `PreTrainedTokenizerFast` (tokenizer.json as written).

    - It declares that class (the shipped default model), or transformers 5's name for it,
      "TokenizersBackend" (what its `save_pretrained` writes for a tokenizers-backed folder):
      AutoTokenizer would pick it too.
    - DeepSeek V2/V3 declare "LlamaTokenizerFast" but ship a ByteLevel tokenizer.json. Several
      transformers 5.x releases rebuild such tokenizers with Llama's Metaspace pre-tokenizer,
      which silently drops every space (transformers#45488); the generic class does not.
    """
    if not (path / "tokenizer.json").is_file():
        return False
    config = _read_json(path / "tokenizer_config.json")
    declared = str(config.get("tokenizer_class") or "")
    if declared in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        return True
    if declared.removesuffix("Fast") != "LlamaTokenizer":
        return False
    spec = _read_json(path / "tokenizer.json")
    return '"ByteLevel"' in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages: must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}]: must be an object with a string 'role'")
