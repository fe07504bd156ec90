"""The stock `transformers` model types that are the GQA decoder with fields set, one record each.

The shared config translation (`configuration.py`) and the converter read what a stock config
implies from these records; adding such a model type is its record here (and, where it exports to
a stock class of its own, the choice in `configuration.to_stock_hf_config`). Registered in
`families.py: STOCK_DECODERS`.

Part of the remote-code modeling files (imports only its sibling).
"""

from __future__ import annotations

from .family import StockDecoder

QWEN3 = StockDecoder("qwen3", "Qwen3ForCausalLM", qk_norm=True)
QWEN3_MOE = StockDecoder("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, layer_pattern_keys=True)
LLAMA = StockDecoder("llama", "LlamaForCausalLM", qk_norm=False)  # Llama 3.x (RoPE scaling: rope.py)
QWEN2 = StockDecoder("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True)  # Qwen2, Qwen2.5
QWEN2_MOE = StockDecoder(
    "qwen2_moe", "Qwen2MoeForCausalLM", qk_norm=False, shared_expert_gate=True, layer_pattern_keys=True
)
MISTRAL = StockDecoder("mistral", "MistralForCausalLM", qk_norm=False, windowed=True)
