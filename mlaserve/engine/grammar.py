"""Structured output through xgrammar: per request a grammar matcher, per step a token bitmask.

A request with `SamplingParams.structured_outputs` gets a `GrammarMatcher` when it is added
(the schema is compiled then; a bad schema is the request's error). Each step that samples such
requests, their matchers fill one row each of a host bitmask ([rows, ceil(V / 32)] int32, bit
t set = token t allowed), which is copied to the device and applied to the logits there
(`xgrammar.apply_token_bitmask_inplace`: disallowed logits become -inf) before the sampler
runs. After sampling, the matcher accepts the chosen token. Once the grammar is complete only
the stop tokens (EOS) stay allowed, so the request ends as any other does.

Steps without such requests pay nothing (no bitmask, no copy). xgrammar is imported on first
use, so the engine runs without it until a request asks for structured output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mlaserve.sampling_params import StructuredOutputsParams
    from mlaserve.tokenizer import Tokenizer

__all__ = ["GrammarBackend", "GrammarError"]

ANY_OBJECT = '{"type": "object"}'


class GrammarError(ValueError):
    """The request's grammar cannot be used (bad schema, or xgrammar missing)."""


class GrammarBackend:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        try:
            import xgrammar as xgr
        except ImportError as e:
            raise GrammarError(
                "structured output needs xgrammar (pip install 'mlaserve[structured]')"
            ) from e
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # grown on demand

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher for one request (compiled grammars are cached by the compiler)."""
        try:
            if so.structural_tag is not None:
                compiled = self.compiler.compile_structural_tag(so.structural_tag)
            else:
                if so.json_object:
                    schema = ANY_OBJECT  # OpenAI's json_object: an object, not any JSON value
                else:
                    schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                # No free whitespace: a model could otherwise pad forever.
                compiled = self.compiler.compile_json_schema(schema, any_whitespace=False)
        except (RuntimeError, ValueError) as e:
            # xgrammar's C++ errors start with "[time] file.cc:line: "; keep the reason.
            reason = re.sub(r"^\[[^\]]*\] \S+: ", "", str(e).strip().splitlines()[0])
            raise GrammarError(f"invalid JSON schema: {reason}") from None
        return self._xgr.GrammarMatcher(compiled)

    def apply(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """Mask `logits` ([n, V] on its device) in place for the rows that have a matcher."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        n = len(matchers)
        if self._bitmask.shape[0] < n:
            self._bitmask = self._xgr.allocate_token_bitmask(n, self.vocab_size)
        bitmask = self._bitmask[:n]
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        device_mask = bitmask.to(logits.device, non_blocking=True)
        self._xgr.apply_token_bitmask_inplace(
            logits, device_mask, vocab_size=self.vocab_size, indices=rows
        )
