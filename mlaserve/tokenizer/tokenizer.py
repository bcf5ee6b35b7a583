"""A thin, typed wrapper over a Hugging Face tokenizer loaded from local files.

The wrapper pins down the choices the server depends on: no network, no remote code, no
"clean up tokenization spaces" (so incremental and full decodes agree), and chat templates are
rendered to text first and then encoded without extra special tokens (the template writes BOS
itself), as vLLM does.

Decoding without transformers (`defer_transformers=True`, the engine's): the engine process
only decodes (the server tokenizes), and transformers' import is 1.5 s of its start (issue 44).
A folder that loads as the generic fast class then decodes through the `tokenizers` library
straight from tokenizer.json, which is what transformers' fast decode calls, and the special
tokens' ids come from tokenizer_config.json; transformers is imported at the first use that
needs it (`hf`: encoding, chat templates, xgrammar). Only where the files leave transformers
nothing to change: every special token the config names is a special added token of
tokenizer.json, and its `added_tokens_decoder` agrees with tokenizer.json's (else it loads at
once, as without the option). tests/tokenizer checks both ways agree.

NOTE: HF fast tokenizers are not safe to call from several threads at once (the Rust side
raises "Already borrowed"); keep one Tokenizer per thread or serialise calls.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from mlaserve.tokenizer.tokenizer_files import TOKENIZER_FILES, remote_code_class

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TOKENIZER_FILES", "ChatTemplateError", "Tokenizer"]

# transformers' special-token attributes (SPECIAL_TOKENS_ATTRIBUTES), and its lists of more
_SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
_SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: no chat template, or the template rejected them."""


@dataclass(frozen=True)
class _Deferred:
    """A folder decoded without transformers until `hf` is first used (module doc)."""

    load: Callable[[], PreTrainedTokenizerBase]  # transformers' tokenizer for the folder
    backend: tokenizers.Tokenizer  # tokenizer.json, as transformers' fast class would hold it
    special_ids: dict[str, int | None]  # "eos_token" -> id (None: the folder names none)


class Tokenizer:
    def __init__(
        self,
        hf: PreTrainedTokenizerBase | None,
        name: str = "",
        *,
        deferred: _Deferred | None = None,
    ) -> None:
        """`hf` loaded, or None with `deferred` (`from_pretrained(defer_transformers=True)`)."""
        if (hf is None) == (deferred is None):
            raise ValueError("Tokenizer: give a transformers tokenizer or a deferred load")
        self._hf = hf
        self._deferred = deferred
        self._hf_lock = threading.Lock()
        self._backend: tokenizers.Tokenizer | None = (
            deferred.backend if deferred is not None else getattr(hf, "backend_tokenizer", None)
        )
        self.name = name or getattr(hf, "name_or_path", "")
        self._piece_cache: dict[int, str] = {}
        self._max_piece_chars: int | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        trust_remote_code: bool = False,
        defer_transformers: bool = False,
    ) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json from a local directory. A folder whose
        tokenizer class is Python code it ships (tokenizer_config.json's `auto_map`, e.g.
        Kimi-K2's tiktoken tokenizer) loads only with `trust_remote_code`; without it, a
        `ValueError` names the class and the flag. `defer_transformers`: decode without
        importing transformers where the folder allows it (module doc)."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer path {path} is not a directory")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise FileNotFoundError(
                f"tokenizer path {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                "copy the model's tokenizer there or name its folder with `tokenizer`"
            )
        custom = remote_code_class(path, trust_remote_code)  # ValueError: refused
        generic = custom is None and _takes_generic_fast_class(path)

        def load() -> PreTrainedTokenizerBase:
            return _load_transformers(path, generic, trust_remote_code)

        if generic and defer_transformers:
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
            special_ids = _special_token_ids(path, backend)
            if special_ids is not None:
                return cls(None, name=str(path), deferred=_Deferred(load, backend, special_ids))
        return cls(load(), name=str(path))

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (imported and loaded here on first use when deferred)."""
        hf = self._hf
        if hf is None:
            with self._hf_lock:
                if self._hf is None and self._deferred is not None:
                    self._hf = self._deferred.load()
                hf = self._hf
        if hf is None:
            raise RuntimeError(f"tokenizer {self.name!r}: no transformers tokenizer")
        return hf

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
        return self._backend

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._deferred is not None:  # what transformers' fast decode calls
            return self._deferred.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Raw vocabulary pieces (byte-level BPE shows a space as "Ġ")."""
        if self._deferred is not None:
            return [self._deferred.backend.id_to_token(i) for i in ids]
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
        import jinja2  # here: a decoding-only engine process never renders

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

    def _special_id(self, key: str) -> int | None:
        """`key`'s ("eos_token") id: read from the folder when deferred, else transformers'."""
        if self._deferred is not None:
            return self._deferred.special_ids[key]
        return getattr(self.hf, f"{key}_id")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.hf.all_special_ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (the model's logits
        may be wider: checkpoints pad the embedding)."""
        if self._deferred is not None:  # what a fast tokenizer's len() counts
            return self._deferred.backend.get_vocab_size(with_added_tokens=True)
        return len(self.hf)


def _load_transformers(
    path: Path, generic: bool, trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if generic:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), **kwargs)
    # Imported here: transformers' auto classes import its modelling and generation code (4.5 s
    # of an engine process's start on the GPU host, transformers 5.17).
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), **kwargs)


def _special_token_ids(path: Path, backend: tokenizers.Tokenizer) -> dict[str, int | None] | None:
    """The special tokens' ids as transformers resolves them for this folder (each named token
    -> its id, None where the config names none), read without transformers; None where
    transformers could change what decoding skips: a named token that is not a special added
    token of tokenizer.json, an `added_tokens_decoder` disagreeing with tokenizer.json's, the
    config and special_tokens_map.json naming a token differently, or a form not recognised."""
    config = _read_json(path / "tokenizer_config.json")
    if config.get("from_slow"):
        return None
    named = dict(config)
    for key, value in _read_json(path / "special_tokens_map.json").items():
        if key in named and named[key] is not None and named[key] != value:
            return None
        named[key] = value
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        token = added.get(int(key)) if str(key).isdigit() else None
        if (
            token is None
            or not isinstance(entry, dict)
            or token.content != entry.get("content")
            or token.special != bool(entry.get("special"))
        ):
            return None
    special = {t.content: i for i, t in added.items() if t.special}

    def token_id(value: object) -> int | None:
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str) or content not in special:
            raise LookupError(content)
        return special[content]

    ids: dict[str, int | None] = {}
    try:
        for key in _SPECIAL_KEYS:
            ids[key] = None if named.get(key) is None else token_id(named[key])
        for key in _SPECIAL_LISTS:
            more = named.get(key) or []
            if isinstance(more, dict):  # transformers 5's extra_special_tokens: name -> token
                more = list(more.values())
            if not isinstance(more, list):
                return None
            for value in more:
                token_id(value)
    except LookupError:
        return None
    return ids


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
