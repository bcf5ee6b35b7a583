"""The files that make a folder a tokenizer folder: one module of its own, so that the server's
preflight checks for them without importing transformers (`tokenizer.py` does)."""

__all__ = ["TOKENIZER_FILES"]

# A folder holding none of these has no tokenizer (e.g. a `--load-format dummy` folder of only
# config.json); transformers' own error for it speaks of sentencepiece and slow tokenizers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
