"""Incremental detokenization: turn a growing list of output ids into text deltas for streaming.

Decoding token by token is wrong twice over: a byte-level token may hold half of a multi-byte
UTF-8 character (it decodes to U+FFFD), and SentencePiece-style decoders change a token's text
depending on what precedes it. The fix (vLLM's `detokenize_incrementally`, also TGI's and
SGLang's) is to decode a small window twice:

    ids:  | prefix ids    | pending ids (no text emitted yet) |
          '- emitted text -'
    prefix_text = decode(ids[:read])
    new_text    = decode(ids)
    delta       = new_text[len(prefix_text):]

The delta is emitted only when the new text is longer and does not end in U+FFFD (the rest of the
character may still come). Then the window slides: the prefix ids are dropped, the rest becomes
the prefix. The first window is the last few prompt tokens, so the first output token decodes in
context.

A fast (Rust-backed) tokenizer runs exactly this algorithm in `tokenizers.decoders.DecodeStream`,
as vLLM's FastIncrementalDetokenizer does: one Rust call per token instead of two decodes through
the transformers layer (bench/detokenize.py measures both). Other tokenizers take the Python
window above. Both keep the window's ids here, so `flush` can emit a held-back incomplete
character at the end (DecodeStream has no flush).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tokenizers.decoders import DecodeStream

from mlaserve.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

logger = logging.getLogger(__name__)

# Prompt tokens decoded as context for the first output tokens (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET), and how far back a context that starts and ends on
# character boundaries is looked for (DecodeStream rejects a prefix whose text later changes).
_CONTEXT_TOKENS = 5
_MAX_CONTEXT_TOKENS = 24
_REPLACEMENT_CHAR = "\ufffd"
# DecodeStream's error when a new token changed text it had already emitted; the stream is then
# restarted without context (vLLM does the same: vllm-project/vllm#17448).
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        use_decode_stream: bool | None = None,
    ) -> None:
        """use_decode_stream: None = whenever the tokenizer is fast; False = the Python window
        (what a slow tokenizer gets; benchmarks and tests compare the two)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Finalised text, as pieces (joined only when `text` is read), and the output ids.
        self._pieces: list[str] = []
        self._output_ids: list[int] = []
        self._backend = tokenizer.backend_tokenizer if use_decode_stream is not False else None
        if use_decode_stream and self._backend is None:
            raise ValueError(f"use_decode_stream: tokenizer {tokenizer.name!r} is not a fast one")
        # The window: ids[:read] decode to text already emitted, ids[read:] are pending.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_text: str | None = None  # decode(ids[:read]), Python path's cache
        self._stream: DecodeStream | None = None
        if self._backend is not None:
            clean = self._clean_context(prompt_ids)
            # A prompt that ends inside a character (raw ids) has no clean context: its first
            # output tokens complete a character that the output did not start, which the
            # Python window leaves out and DecodeStream would reject. Such a request takes the
            # window.
            if clean is not None:
                self._ids = clean
                self._stream = DecodeStream(ids=clean, skip_special_tokens=skip_special_tokens)
        self._read = len(self._ids)

    def _clean_context(self, prompt_ids: Sequence[int]) -> list[int] | None:
        """The last few prompt ids, widened until their text holds no U+FFFD (a partial
        character at either end: DecodeStream needs a prefix whose text later tokens cannot
        change); None if there is no such window near the end."""
        n = len(prompt_ids)
        for k in range(min(_CONTEXT_TOKENS, n), min(_MAX_CONTEXT_TOKENS, n) + 1):
            ids = list(prompt_ids[n - k :])
            if _REPLACEMENT_CHAR not in self._decode(ids):
                return ids
        return None

    @property
    def text(self) -> str:
        """All output text finalised so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def output_ids(self) -> list[int]:
        return self._output_ids

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids (one, or several after speculative decoding); return the text they
        finalised, possibly "" while a character is incomplete."""
        deltas = []
        for token_id in new_token_ids:
            # One id at a time, so text before an incomplete trailing character is not held.
            self._output_ids.append(token_id)
            self._ids.append(token_id)
            if self._stream is not None:
                delta = self._stream_step(token_id)
            else:
                delta = self._advance(final=False)
            if delta:
                deltas.append(delta)
        return "".join(deltas)

    def flush(self) -> str:
        """At finish: emit whatever was held back (an incomplete character becomes U+FFFD)."""
        return self._advance(final=True)

    def _stream_step(self, token_id: int) -> str:
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if str(e) != _INVALID_PREFIX:
                raise
            logger.warning("incremental detokenization: invalid prefix, restarting the stream")
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._ids, self._read = [token_id], 0
            delta = self._stream.step(self._backend, token_id)
        if delta is None:
            return ""
        self._emit(delta)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        """The Python window step (and, for both paths, the flush)."""
        if self._read == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._emit(delta)
        return delta

    def _emit(self, delta: str) -> None:
        """Slide the window past the emitted text: the pending ids become the prefix."""
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = None
        self._pieces.append(delta)
