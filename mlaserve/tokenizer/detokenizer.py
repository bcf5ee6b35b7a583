"""Incremental detokenization: turn a growing list of output ids into text deltas for streaming.

Decoding token by token is wrong twice over: a byte-level token may hold half of a multi-byte
UTF-8 character (it decodes to U+FFFD), and SentencePiece-style decoders change a token's text
depending on what precedes it. The fix (vLLM's `detokenize_incrementally`, also TGI's and
SGLang's) is to decode a small window twice:

    ids:  ... | prefix_offset ... read_offset | ... new ids
              '--- already emitted text ---'
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]

The delta is emitted only when the new text is longer and does not end in U+FFFD (the rest of the
character may still come). Then the window slides: prefix_offset <- read_offset <- len(ids).
The first window is the last few prompt tokens, so the first output token decodes in context.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlaserve.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens decoded as context for the first output tokens (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Finalised text, as pieces: `str +=` on an attribute copies the whole text every step,
        # O(length) per token; the pieces are joined only when `text` is read.
        self._pieces: list[str] = []
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._num_context = len(context)
        self._ids = context  # context + output ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached until it moves

    @property
    def text(self) -> str:
        """All output text finalised so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids (one, or several after speculative decoding); return the text they
        finalised, possibly "" while a character is incomplete."""
        deltas = []
        for token_id in new_token_ids:
            # One id at a time, so text before an incomplete trailing character is not held.
            self._ids.append(token_id)
            deltas.append(self._advance(final=False))
        return "".join(deltas)

    def flush(self) -> str:
        """At finish: emit whatever was held back (an incomplete character becomes U+FFFD)."""
        return self._advance(final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = None
        self._pieces.append(delta)
        return delta
