"""Task accuracy of the model being trained, for the synthetic demo task.

Loss says the model fits its data; accuracy on problems it never saw says it learned the task. The
megatron-core weights are gathered, mapped to HF names (the same mapping the exporter and weight
sync use) and loaded into the reference model, which decodes greedily.
"""

from __future__ import annotations

import torch

from mcore_rl.config.schema import DataConfig, ModelConfig
from mcore_rl.data.synthetic import make_addition_examples, verify_addition
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.hf import Qwen3ReferenceForCausalLM, hf_config_from_model_config
from mcore_rl.hf.generation import greedy_generate
from mcore_rl.hf.weight_map import full_megatron_to_hf
from mcore_rl.models.shards import gather_full_state_dict

HELD_OUT_SEED_OFFSET = 1_000_003


def reference_model_from_chunks(chunks: list[torch.nn.Module], mc: ModelConfig) -> Qwen3ReferenceForCausalLM:
    """The reference model holding the trainer's current weights (collective over all ranks)."""
    hf_state = full_megatron_to_hf(gather_full_state_dict(chunks), mc)
    model = Qwen3ReferenceForCausalLM(hf_config_from_model_config(mc)).float()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in hf_state.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if mc.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return model


def addition_accuracy(
    chunks: list[torch.nn.Module], mc: ModelConfig, data: DataConfig, tokenizer: Tokenizer,
    seed: int, num_problems: int = 200,
) -> float:
    """Greedy accuracy on freshly drawn addition problems (collective; same value on every rank)."""
    model = reference_model_from_chunks(chunks, mc)
    problems = make_addition_examples(num_problems, seed + HELD_OUT_SEED_OFFSET, data.synthetic_max_digits)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    prompts = [bos + tokenizer.encode(p["prompt"]) for p in problems]
    outputs = greedy_generate(model, prompts, data.synthetic_max_digits + 2, tokenizer.eos_id)
    scores = [verify_addition(p["prompt"], tokenizer.decode(o)) for p, o in zip(problems, outputs)]
    return sum(scores) / len(scores)
