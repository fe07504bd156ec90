"""Greedy decoding with the reference model's KV cache (evaluation of small demos and tests).

The embedded inference engine does the real serving; this is the shortest correct loop for when
a trainer needs to look at what its model writes.
"""

from __future__ import annotations

import torch

from mcore_rl.hf.modeling import McoreRLForCausalLM


@torch.no_grad()
def greedy_generate(
    model: McoreRLForCausalLM, prompts: list[list[int]], max_new_tokens: int, eos_id: int
) -> list[list[int]]:
    """Continue equal-length prompts greedily; each completion stops at (and excludes) eos."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("greedy_generate batches prompts of one length; group them first")
    model.eval()
    input_ids = torch.tensor(prompts)
    out = model(input_ids, use_cache=True)
    completions: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(max_new_tokens):
        next_ids = out.logits[:, -1].argmax(-1)
        for i, token in enumerate(next_ids.tolist()):
            if not done[i]:
                if token == eos_id:
                    done[i] = True
                else:
                    completions[i].append(token)
        if bool(done.all()):
            break
        out = model(next_ids[:, None], past_key_values=out.cache, use_cache=True)
    return completions
