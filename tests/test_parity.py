"""megatron-core models in every parallel layout vs the pure-torch reference model on one rank.

Same weights, same global batch: the loss must agree to fp32 rtol 1e-5 and every gradient, gathered
from its TP/EP/PP shards, must agree with the reference gradient.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_rl.config.schema import ModelConfig, ParallelConfig
from tests.world import run_world
from tests.helpers import DENSE, P, _check_layout, _global_batch

pytestmark = pytest.mark.slow

MOE = ModelConfig(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_aux_loss_coeff=0.01,
)
MOE_SHARED = dataclasses.replace(MOE, moe_shared_expert_intermediate_size=96, moe_norm_topk_prob=False)


def _reference(mc: ModelConfig, batches: list[dict[str, torch.Tensor]]):
    """Loss and HF-named gradients of the objective megatron-core optimises (see below)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(1234)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).float()
    with torch.no_grad():  # non-trivial norm weights so their gradients are tested too
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    total_tokens = sum(float(b["loss_mask"].sum()) for b in batches)
    objective, lm_sum = 0.0, 0.0
    for b in batches:
        out = model(b["tokens"], position_ids=b["position_ids"], labels=b["labels"], loss_mask=b["loss_mask"])
        n = float(b["loss_mask"].sum())
        lm_sum = lm_sum + out.loss.detach() * n
        # megatron-core (calculate_per_token_loss): token-summed LM loss over the global token
        # count, plus each micro-batch's aux loss weighted by its token count over the same count.
        objective = objective + (out.loss * n + out.aux_loss * b["tokens"].numel()) / total_tokens
    objective.backward()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if mc.tie_word_embeddings:
        grads["lm_head.weight"] = grads["model.embed_tokens.weight"]
    return float(lm_sum) / total_tokens, state, grads


def _layouts_world(rank: int, world_size: int, cases: list[tuple[ModelConfig, ParallelConfig]]) -> None:
    batches = {}
    refs = {}
    for mc, pc in cases:
        key = repr(mc)
        if key not in refs:
            batches[key] = _global_batch(mc.vocab_size)
            refs[key] = _reference(mc, batches[key])
        _check_layout(mc, pc, batches[key], refs[key])


TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)


def test_two_rank_layouts():
    cases = [
        (DENSE, P(tp=2, sp=True)),
        (DENSE, P(tp=2)),
        (DENSE, P(pp=2)),  # 1F1B, 4 micro-batches
        (DENSE, P()),  # DP=2
        (DENSE, P(pp=2, vpp=2)),  # interleaved
        (TIED, P(pp=2)),  # tied embeddings across the first and last stage
        (MOE, P(ep=2)),
        (MOE, P(tp=2, sp=True)),
        (MOE_SHARED, P(ep=2)),
    ]
    run_world(2, _layouts_world, cases)


def test_four_rank_layouts():
    cases = [
        (MOE, P(tp=2, ep=2, sp=True)),
        (MOE_SHARED, P(tp=2, ep=2, sp=True, etp=1)),
        (DENSE, P(tp=2, pp=2, sp=True)),
        (DENSE, P(tp=2)),  # TP=2 x DP=2
    ]
    run_world(4, _layouts_world, cases)
