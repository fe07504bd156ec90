"""Pure-PyTorch reference models (Hugging Face conventions) and HF config conversions."""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import (
    McoreRLQwen3Config,
    hf_config_from_model_config,
    model_config_from_hf_config,
    to_stock_hf_config,
)
from .modeling import (
    KVCache,
    Qwen3ReferenceCausalLMOutput,
    Qwen3ReferenceForCausalLM,
    Qwen3ReferenceModel,
    Qwen3ReferencePreTrainedModel,
    from_stock_state_dict,
    load_balancing_loss,
    masked_token_loss,
    route,
    to_stock_state_dict,
)

# In-process registration, so AutoConfig / AutoModelForCausalLM resolve "mcore_rl_qwen3" once
# mcore_rl.hf is imported (remote-code `auto_map` export comes with the checkpoint exporter).
AutoConfig.register(McoreRLQwen3Config.model_type, McoreRLQwen3Config, exist_ok=True)
AutoModelForCausalLM.register(McoreRLQwen3Config, Qwen3ReferenceForCausalLM, exist_ok=True)

__all__ = [
    "KVCache",
    "McoreRLQwen3Config",
    "Qwen3ReferenceCausalLMOutput",
    "Qwen3ReferenceForCausalLM",
    "Qwen3ReferenceModel",
    "Qwen3ReferencePreTrainedModel",
    "from_stock_state_dict",
    "hf_config_from_model_config",
    "load_balancing_loss",
    "masked_token_loss",
    "model_config_from_hf_config",
    "route",
    "to_stock_hf_config",
    "to_stock_state_dict",
]
