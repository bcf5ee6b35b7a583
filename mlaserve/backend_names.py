"""The attention backends' names: what `attention_backend` accepts besides `auto`.

A leaf (imports nothing from mlaserve) so that config can validate the name without importing
kernels_adapter; `kernels_adapter/registry.py` maps exactly these names to their classes and
refuses to import if the two lists differ.
"""

__all__ = ["ATTENTION_BACKENDS"]

# "invariant" is the deterministic mode's (`deterministic_inference`); `auto` never picks it.
ATTENTION_BACKENDS: tuple[str, ...] = ("flashmla", "invariant", "reference", "tokenspeed", "trtllm")
