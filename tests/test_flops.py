"""The FLOPs count of `models/flops.py` against torch's own FLOP counter on the reference model."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
from mcore_rl.models.flops import forward_flops_per_token, mfu, train_flops_per_token

CONFIGS = {
    "dense": ModelConfig(
        vocab_size=96, hidden_size=32, ffn_hidden_size=80, num_layers=2, num_attention_heads=4, num_query_groups=2
    ),
    "moe": ModelConfig.of(
        arch="qwen3_moe",
        vocab_size=96,
        hidden_size=32,
        ffn_hidden_size=80,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=40,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matmul_flops_match_torch_flop_counter(name: str) -> None:
    """Everything but attention's score products is a linear layer: torch's counter of the reference
    forward must agree (non-causal: torch counts SDPA over the full square)."""
    mc = CONFIGS[name]
    torch.manual_seed(0)
    model = McoreRLForCausalLM(hf_config_from_model_config(mc)).eval()
    seq = 16
    ids = torch.randint(0, mc.vocab_size, (1, seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    measured = sum(counts.values()) / seq
    ours = forward_flops_per_token(mc, seq, causal=False)
    if mc.is_moe:
        # the reference runs every expert on the tokens routed to it: with top-k of E experts each
        # token is counted top-k times, so the totals agree on average over the batch only
        assert measured == pytest.approx(ours.total, rel=0.05)
    else:
        assert measured == pytest.approx(ours.total, rel=1e-6)


def test_training_multiplier_and_mfu() -> None:
    mc = CONFIGS["dense"]
    fwd = forward_flops_per_token(mc, 32).total
    assert train_flops_per_token(mc, 32) == pytest.approx(3 * fwd)
    assert train_flops_per_token(mc, 32, "full") == pytest.approx(4 * fwd)
    assert mfu(1000.0, 1e9, 1e12) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 0.0)
