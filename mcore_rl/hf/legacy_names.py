"""The reference classes under the names exports carried before they got neutral ones.

The classes were once called `McoreRLQwen3Config` (model_type `mcore_rl_qwen3`),
`Qwen3ReferenceModel` and `Qwen3ReferenceForCausalLM`, though they serve every family here (Llama 3,
Qwen2, Mistral, DeepSeek-V3, LatentMoE, AttnRes). A checkpoint exported then has that model_type and
those class names in its `config.json`; registering these subclasses with the Auto classes
(`hf/__init__.py`) lets the converter, the engine and `AutoModelForCausalLM` read it without remote
code. Its own remote-code files load it as before. Nothing new is written under these names.
"""

from __future__ import annotations

from .configuration import OWN_MODEL_TYPES, McoreRLConfig
from .modeling import McoreRLForCausalLM, McoreRLModel


class McoreRLQwen3Config(McoreRLConfig):
    """`McoreRLConfig` read from a `model_type: mcore_rl_qwen3` config.json."""

    model_type = OWN_MODEL_TYPES[1]


class Qwen3ReferenceModel(McoreRLModel):
    config_class = McoreRLQwen3Config


class Qwen3ReferenceForCausalLM(McoreRLForCausalLM):
    config_class = McoreRLQwen3Config
