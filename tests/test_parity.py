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

pytestmark = pytest.mark.slow

SEQ, MBS, NUM_MICROBATCHES = 16, 2, 4

DENSE = ModelConfig(arch="qwen3", num_layers=4, hidden_size=64, ffn_hidden_size=128)
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


def _global_batch(vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, vocab, (MBS, SEQ + 1), generator=g)
        loss_mask = (torch.rand(MBS, SEQ, generator=g) > 0.25).float()
        batches.append(
            dict(
                tokens=tokens[:, :-1].contiguous(),
                labels=tokens[:, 1:].contiguous(),
                loss_mask=loss_mask,
                position_ids=torch.arange(SEQ).expand(MBS, SEQ).contiguous(),
            )
        )
    return batches


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


def _check_layout(mc: ModelConfig, pc: ParallelConfig, batches, ref, recompute: str = "none", after=None) -> str:
    """`after(chunks)`, if given, runs once the checks passed (further checks on the same model)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp

    ref_loss, ref_state, ref_grads = ref
    layout = init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(mc, pc, recompute=recompute)
    chunks = build_model(mc, pc, config=config)
    load_full_state_dict(chunks, hf_to_megatron(ref_state, mc))
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    per_rank = len(batches) // layout.dp
    dp_rank = ps.get_data_parallel_rank()
    mine = batches[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    result = forward_backward(chunks, mine)

    name = f"{mc.arch} {pc}"
    assert abs(result["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"{name}: loss {result['loss']} vs {ref_loss}"
    grads = gather_full_state_dict(chunks, grads=True)
    expected = hf_to_megatron(ref_grads, mc)
    assert set(grads) == set(expected), f"{name}: {sorted(set(grads) ^ set(expected))}"
    for key, want in expected.items():
        got = grads[key]
        scale = float(want.abs().max()) or 1.0
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{name} {key}: {m}")
    if after is not None:
        after(chunks)
    return name


def _layouts_world(rank: int, world_size: int, cases: list[tuple[ModelConfig, ParallelConfig]]) -> None:
    batches = {}
    refs = {}
    for mc, pc in cases:
        key = repr(mc)
        if key not in refs:
            batches[key] = _global_batch(mc.vocab_size)
            refs[key] = _reference(mc, batches[key])
        _check_layout(mc, pc, batches[key], refs[key])


def P(**kw) -> ParallelConfig:
    names = dict(
        tp="tensor_model_parallel_size",
        pp="pipeline_model_parallel_size",
        vpp="virtual_pipeline_model_parallel_size",
        ep="expert_model_parallel_size",
        sp="sequence_parallel",
        etp="expert_tensor_parallel_size",
    )
    return ParallelConfig(**{names[k]: v for k, v in kw.items()})


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
