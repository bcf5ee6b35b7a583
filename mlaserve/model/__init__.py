"""The DeepSeek-V2/V3 model (MLA + MoE + MTP) and its checkpoint loader.

model = load_model(model_config, path, dtype=torch.bfloat16, device=torch.device("cuda"))
hidden = model(batch)                  # ForwardBatch -> [T, hidden] final-normed
logits = model.compute_logits(hidden)  # [N, hidden] -> [N, vocab] float32
"""

from mlaserve.model.deepseek import DeepseekForCausalLM
from mlaserve.model.loader import WeightLoadError, load_kv_scales, load_model
from mlaserve.model.mtp import DeepseekMTP

__all__ = [
    "DeepseekForCausalLM",
    "DeepseekMTP",
    "WeightLoadError",
    "load_kv_scales",
    "load_model",
]
