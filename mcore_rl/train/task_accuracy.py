"""Greedy task accuracy of the model being trained, measured without an inference engine (SFT).

Loss says the model fits its data; accuracy on problems it never saw says it learned the task. The
megatron-core weights are gathered, mapped to HF names (the same mapping the exporter and weight
sync use) and loaded into the reference model, which decodes greedily.
"""

from __future__ import annotations

import torch

from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.prompts import HELD_OUT_SEED_OFFSET
from mcore_rl.data.tasks import Task
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.hf.generation import greedy_generate
from mcore_rl.hf.weight_map import full_megatron_to_hf
from mcore_rl.models.shards import gather_full_state_dict


def reference_model_from_chunks(chunks: list[torch.nn.Module], mc: ModelConfig) -> McoreRLForCausalLM:
    """The reference model holding the trainer's current weights (collective over all ranks)."""
    hf_state = full_megatron_to_hf(gather_full_state_dict(chunks), mc)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float()
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in hf_state.items()}, strict=False)
    allowed_missing = {"lm_head.weight"} if mc.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}")
    return model


def greedy_task_accuracy(
    chunks: list[torch.nn.Module],
    mc: ModelConfig,
    task: Task,
    tokenizer: Tokenizer,
    seed: int,
    num_problems: int = 200,
) -> float:
    """Greedy accuracy on freshly drawn problems of `task` (collective; same value on every rank)."""
    model = reference_model_from_chunks(chunks, mc)
    problems = task.examples(num_problems, seed + HELD_OUT_SEED_OFFSET)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    prompts = [bos + tokenizer.encode(prompt) for prompt, _ in problems]
    outputs = greedy_generate(model, prompts, task.max_answer_tokens(), tokenizer.eos_id)
    scores = [task.score(prompt, tokenizer.decode(o)) for (prompt, _), o in zip(problems, outputs)]
    return sum(scores) / len(scores)
