"""megatron-core models in every parallel layout vs the pure-torch reference model on one rank.

Same weights, same global batch: the loss must agree to fp32 rtol 1e-5 and every gradient, gathered
from its TP/EP/PP shards, must agree with the reference gradient.
"""

from __future__ import annotations

import dataclasses

import pytest

from mcore_rl.config.schema import ModelConfig
from tests.world import run_world
from tests.helpers import DENSE, P
from tests.helpers import _layouts_world

pytestmark = pytest.mark.slow

MOE = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=64,
    moe_aux_loss_coeff=0.01,
)
MOE_SHARED = MOE.replace(moe_shared_expert_intermediate_size=96, moe_norm_topk_prob=False)


TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)


def _two_rank_world(rank: int, world_size: int, cases) -> None:
    _layouts_world(rank, world_size, cases)
    _expert_tp_below_tp_without_ep_is_wrong()


def _expert_tp_below_tp_without_ep_is_wrong() -> None:
    """Why validation refuses TP=2 x ETP=1 x EP=1 (`config/moe_rules.py:
    check_expert_gradient_reduction`): megatron-core 0.16.1 reduces the experts' gradients over the
    data-parallel group there (one rank), so each holds its own slice of the sequence's share. When
    this stops failing, megatron-core reduces them right and the refusal can go."""
    from mcore_rl.config.rules import Errors, check_parallel
    from tests.helpers import _check_layout, _global_batch, _parity_reference

    layout = P(tp=2, sp=True, etp=1)
    errors = Errors()
    check_parallel(layout, MOE, 2, errors)
    assert [line.split(":")[0] for line in errors.lines] == ["parallel.expert_tensor_parallel_size"]
    batches = _global_batch(MOE.vocab_size)
    with pytest.raises(AssertionError, match=r"mlp\.experts\.local_experts\.\d+\.linear_fc\d\.weight"):
        _check_layout(MOE, layout, batches, _parity_reference(MOE, batches))


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
    run_world(2, _two_rank_world, cases)


def test_four_rank_layouts():
    from tests.test_deepseek_v3 import DSV3_RELEASED
    from tests.test_gpt_oss import PARITY as GPT_OSS

    cases = [
        (MOE, P(tp=2, ep=2, sp=True)),
        (MOE_SHARED, P(tp=2, ep=2, sp=True, etp=1)),
        # expert-TP 1 under TP 2 with EP 2: DeepSeek-V3 as released (MLA, grouped sigmoid routing,
        # shared expert), GPT-OSS (sinks, biases; megatron-core builds expert biases only at ETP 1)
        (DSV3_RELEASED, P(tp=2, ep=2, sp=True, etp=1)),
        (GPT_OSS, P(tp=2, ep=2, sp=True, etp=1)),
        (DENSE, P(tp=2, pp=2, sp=True)),
        (DENSE, P(tp=2)),  # TP=2 x DP=2
    ]
    run_world(4, _layouts_world, cases)
