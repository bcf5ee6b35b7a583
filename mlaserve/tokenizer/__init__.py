"""Text side of the server: the HF tokenizer wrapper, incremental detokenization for streaming,
and stop-string matching."""

from mlaserve.tokenizer.detokenizer import IncrementalDetokenizer
from mlaserve.tokenizer.stop import find_stop, stop_holdback
from mlaserve.tokenizer.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "find_stop", "stop_holdback"]
