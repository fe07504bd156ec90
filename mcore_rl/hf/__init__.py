"""Pure-PyTorch reference models (Hugging Face conventions) and HF config conversions."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import (
    OWN_MODEL_TYPES,
    McoreRLConfig,
    hf_config_from_model_config,
    model_config_from_hf_config,
    to_stock_hf_config,
)
from .modeling import (
    KVCache,
    McoreRLCausalLMOutput,
    McoreRLForCausalLM,
    McoreRLModel,
    McoreRLPreTrainedModel,
    from_stock_state_dict,
    load_balancing_loss,
    masked_token_loss,
    route,
    to_stock_state_dict,
)

from .legacy_names import McoreRLQwen3Config, Qwen3ReferenceForCausalLM, Qwen3ReferenceModel

# In-process registration, so AutoConfig / AutoModel(ForCausalLM) resolve our model_types (today's and
# the one of exports before the rename) once mcore_rl.hf is imported (remote-code `auto_map` export
# comes with the checkpoint exporter).
for _config, _base, _lm in (
    (McoreRLConfig, McoreRLModel, McoreRLForCausalLM),
    (McoreRLQwen3Config, Qwen3ReferenceModel, Qwen3ReferenceForCausalLM),
):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _base, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

__all__ = [
    "KVCache",
    "McoreRLConfig",
    "OWN_MODEL_TYPES",
    "McoreRLCausalLMOutput",
    "McoreRLForCausalLM",
    "McoreRLModel",
    "McoreRLPreTrainedModel",
    "from_stock_state_dict",
    "hf_config_from_model_config",
    "load_balancing_loss",
    "masked_token_loss",
    "model_config_from_hf_config",
    "route",
    "to_stock_hf_config",
    "to_stock_state_dict",
]
