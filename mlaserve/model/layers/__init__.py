"""Building blocks of the DeepSeek model, one concept per file."""
