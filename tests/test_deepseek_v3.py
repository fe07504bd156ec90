"""Mixed dense/MoE layers and the DeepSeek-V3 family (MLA, sigmoid router with expert bias, grouped
top-k, shared experts, first-k-dense).

Without megatron: the reference model equals stock `transformers` (`DeepseekV3ForCausalLM`,
`Qwen3MoeForCausalLM` with `mlp_only_layers` / `decoder_sparse_step`) for the same weights; configs
map to `model.moe_layer_pattern` and back; bad values are refused naming the key.
In one 2-rank gloo world: megatron-core loss and gradients equal the reference in TP=2, PP=2 (stages
holding different layer kinds) and EP=2; the expert bias moves toward balance over optimizer steps
and reaches the engine through the weight sync; a tiny stock DeepSeek-V3 checkpoint converts to
megatron and exports back bit for bit, with the megatron logits equal to the stock ones.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig, RopeScalingConfig

VOCAB, SEQ = 128, 16

MIXED = ModelConfig.of(
    arch="qwen3_moe",
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=0.01,
    moe_layer_pattern=[0, 0, 1, 1],
)
DSV3 = ModelConfig.of(
    arch="deepseek_v3",
    vocab_size=VOCAB,
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=4,
    num_experts=8,
    moe_router_topk=4,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=64,
    moe_layer_pattern=[0, 1],
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=0.01,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    multi_latent_attention=True,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=16,
)
DSV3_FULL_Q = DSV3.replace(q_lora_rank=None, moe_layer_pattern=None)
# What the released models set and megatron-core alone routes or rotates differently: YaRN on MLA
# with DeepSeek's mscale / mscale_all_dim, a group ranked by its best 2 whatever topk // topk_group
# (3 here), no renormalisation (norm_topk_prob false); and MTP layers carried.
DSV3_RELEASED = DSV3.replace(
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk=3,
    moe_norm_topk_prob=False,
    max_position_embeddings=640,
    rope_scaling=RopeScalingConfig(
        type="yarn", factor=40.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0
    ),
    mtp_num_layers_carried=1,
)
RELEASED_STOCK = dict(
    n_group=2,
    topk_group=1,
    num_experts_per_tok=3,
    norm_topk_prob=False,
    max_position_embeddings=640,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16,
    },
    num_nextn_predict_layers=1,
)
FP8_BLOCK = [8, 8]


def _stock_deepseek_config(**kw):
    from transformers import DeepseekV3Config

    args = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
    )
    return DeepseekV3Config(**{**args, **kw})


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Weights at 1/sqrt(fan-in), non-trivial norms, a sharp router and a non-zero expert bias, so
    that every path (and a wrong routing) moves the logits."""
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.normal_(1.0, 0.2)
        elif name.endswith("gate.weight"):
            p.normal_(0.0, 0.5)
        elif "embed" not in name:
            p.normal_(0.0, p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.1)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _reference_of_stock(stock: torch.nn.Module):
    from mcore_rl.convert import model_config_from_hf
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.hf.modeling import from_stock_state_dict

    mc = model_config_from_hf(stock.config)
    ours = McoreRLForCausalLM(hf_config_from_model_config(mc)).float().eval()
    ours.load_state_dict(from_stock_state_dict(stock.state_dict(), ours.config), strict=True)
    return mc, ours


# ---------------------------------------------------------------------------------------------
# reference model vs stock transformers, configs, refusals (no megatron)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_reference_equals_stock_deepseek_v3(q_lora_rank) -> None:
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    stock = DeepseekV3ForCausalLM(_stock_deepseek_config(q_lora_rank=q_lora_rank)).float().eval()
    _randomize(stock)
    mc, ours = _reference_of_stock(stock)
    assert (
        mc.arch == "deepseek_v3"
        and mc.section(MoEKeys).moe_layer_pattern == [0, 1, 1]
        and mc.section(DeepSeekV3Keys).multi_latent_attention
    )
    assert (
        mc.section(DeepSeekV3Keys).moe_router_num_groups,
        mc.section(DeepSeekV3Keys).moe_router_group_topk,
        mc.section(DeepSeekV3Keys).moe_router_topk_scaling_factor,
    ) == (4, 2, 2.5)
    assert (
        mc.section(MoEKeys).moe_shared_expert_intermediate_size == 64
        and mc.section(DeepSeekV3Keys).q_lora_rank == q_lora_rank
    )
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, stock(x).logits, atol=1e-5, rtol=0)
        # incremental decoding through the latent cache = the full forward
        full = ours(x).logits
        out = ours(x[:, :10], use_cache=True)
        first = out.cache.layers[0]  # (latent, rotated RoPE key) per layer, a transformers DynamicCache
        assert first.keys.shape == (2, 1, 10, 32) and first.values.shape == (2, 1, 10, 8)
        step = ours(x[:, 10:], past_key_values=out.cache).logits
    torch.testing.assert_close(step, full[:, 10:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mlp_only_layers, step, pattern", [([0], 2, [0, 1, 0, 1]), ([1, 2], 1, [1, 0, 0, 1])])
def test_reference_equals_stock_qwen3_moe_with_dense_layers(mlp_only_layers, step, pattern) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=mlp_only_layers,
        decoder_sparse_step=step,
    )
    stock = AutoModelForCausalLM.from_config(config).float().eval()
    _randomize(stock)
    mc, ours = _reference_of_stock(stock)
    assert mc.section(MoEKeys).moe_layer_pattern == pattern
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, stock(x).logits, atol=1e-5, rtol=0)


def test_embedded_engine_serves_deepseek_v3_like_the_reference() -> None:
    """The engine's slot cache keeps MLA's latent + RoPE key; with continuous batching, greedy and
    sampled tokens, every generated token's log-prob equals one cache-free reference forward."""
    import copy

    from mcore_rl.hf import hf_config_from_model_config
    from tests.helpers import PROMPTS, assert_matches_reference, make_engine, req, run

    from mcore_rl.hf import McoreRLForCausalLM

    torch.manual_seed(0)
    model = McoreRLForCausalLM(hf_config_from_model_config(dataclasses.replace(DSV3, vocab_size=384)))
    _randomize(model)
    ref = copy.deepcopy(model).eval()
    engine = make_engine(model)
    reqs = [req(f"g{i}", p, temperature=0.0, max_new_tokens=6, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    reqs += [req("s", PROMPTS[1], temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=5)]
    outs = run(engine, reqs, stagger=2)  # requests join a running batch
    assert_matches_reference(ref, reqs, outs, atol=1e-4)


@pytest.mark.parametrize("kind", ["NGRAM", "STANDALONE"])
def test_speculative_decoding_of_deepseek_v3(kind: str) -> None:
    """MLA's latent cache in the multi-token verification pass: greedy tokens and log-probs are plain
    decoding's token for token (prompt lookup; a draft model of the same family with noisy weights),
    requests joining mid-batch; sampled tokens' log-probs are the cache-free reference's."""
    import copy

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from tests.helpers import PROMPTS, assert_matches_reference, make_engine, req, run

    torch.manual_seed(0)
    model = McoreRLForCausalLM(hf_config_from_model_config(dataclasses.replace(DSV3, vocab_size=384)))
    _randomize(model)
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    greedy = [req(f"g{i}", p * 3, temperature=0.0, max_new_tokens=12, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    plain = run(make_engine(copy.deepcopy(model)), greedy, stagger=2)
    spec = SpeculativeSettings(kind, num_steps=3)
    engine = make_engine(copy.deepcopy(model), speculative=spec, draft_model=copy.deepcopy(draft))
    outs = run(engine, greedy, stagger=2)
    assert engine.spec_stats["verify_passes"] > 0 and engine.spec_stats["accepted"] > 0
    for r in greedy:
        assert outs[r.rid].output_ids == plain[r.rid].output_ids
        for (a, _), (b, _) in zip(outs[r.rid].output_token_logprobs, plain[r.rid].output_token_logprobs):
            assert a == pytest.approx(b, abs=1e-4)
    sampled = [
        req(f"s{i}", p * 3, temperature=1.0, max_new_tokens=8, ignore_eos=True, sampling_seed=i)
        for i, p in enumerate(PROMPTS)
    ]
    engine = make_engine(copy.deepcopy(model), speculative=spec, draft_model=copy.deepcopy(draft))
    assert_matches_reference(model.eval(), sampled, run(engine, sampled, stagger=2), atol=1e-4)
    assert engine.spec_stats["verify_passes"] > 0


def test_deepseek_mtp_layers_draft_as_nextn_heads(tmp_path) -> None:
    """A checkpoint with DeepSeek's MTP layer under `model.layers.{num_hidden_layers}.*` (and its copies of
    the embedding and the head) served with NEXTN: the layer becomes the drafting heads by name, and
    the engine drafts exactly as one built with those heads in memory (seeded sampled tokens and
    drafting counts equal; greedy tokens plain decoding's). Without NEXTN the layer is not served."""
    import copy

    from safetensors.torch import save_file

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.engine.speculative import SpeculativeSettings
    from tests.helpers import PROMPTS, make_engine, req, run

    torch.manual_seed(0)
    config = hf_config_from_model_config(DSV3.replace(vocab_size=384, mtp_num_layers_carried=1))
    config.save_pretrained(str(tmp_path))  # num_nextn_predict_layers 1, no heads of ours
    config.mtp_num_layers = 1
    model = McoreRLForCausalLM(config)
    _randomize(model)
    n = config.num_hidden_layers
    tensors = {}
    for name, t in model.state_dict().items():  # the weights the engine takes, the routers' biases too
        if name.startswith("mtp.layers.0."):
            name = f"model.layers.{n}." + name.removeprefix("mtp.layers.0.")
        tensors[name] = t.detach().contiguous()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))

    spec = SpeculativeSettings("NEXTN", num_steps=3)
    reqs = [
        req(f"s{i}", p * 3, temperature=1.0, max_new_tokens=10, ignore_eos=True, sampling_seed=i)
        for i, p in enumerate(PROMPTS)
    ] + [req("g", PROMPTS[3], temperature=0.0, max_new_tokens=10, ignore_eos=True)]
    loaded = EngineCore.from_model_path(str(tmp_path), max_total_tokens=4096, speculative=spec)
    biases = {k: v for k, v in loaded.model.state_dict().items() if k.endswith("e_score_correction_bias")}
    assert biases and all(torch.equal(v, model.state_dict()[k]) for k, v in biases.items())
    built = make_engine(copy.deepcopy(model), max_total_tokens=4096, speculative=spec)
    got, want = run(loaded, reqs), run(built, reqs)
    assert {r: o.output_ids for r, o in got.items()} == {r: o.output_ids for r, o in want.items()}
    assert loaded.spec_stats == built.spec_stats and loaded.spec_stats["drafted"] > 0
    plain = EngineCore.from_model_path(str(tmp_path), max_total_tokens=4096)  # the MTP layer skipped
    assert not any(name.startswith("mtp.") for name in plain.weight_names())
    assert run(plain, reqs[-1:])["g"].output_ids == got["g"].output_ids


def test_layer_patterns_of_configs_and_flops() -> None:
    from mcore_rl.hf.configuration import hf_config_from_model_config, moe_layer_pattern_of, to_stock_hf_config
    from mcore_rl.models.flops import forward_flops_per_token

    deepseek = _stock_deepseek_config(num_hidden_layers=6, first_k_dense_replace=2)
    assert moe_layer_pattern_of(deepseek) == [0, 0, 1, 1, 1, 1]
    deepseek.moe_layer_freq = 2  # DeepSeek's own remote code: i >= k and i % freq == 0
    assert moe_layer_pattern_of(deepseek) == [0, 0, 1, 0, 1, 0]
    # export with the family's own keys
    stock = to_stock_hf_config(hf_config_from_model_config(DSV3))
    assert stock.model_type == "deepseek_v3" and stock.first_k_dense_replace == 1
    qwen = to_stock_hf_config(hf_config_from_model_config(MIXED))
    assert qwen.model_type == "qwen3_moe" and qwen.mlp_only_layers == [0, 1]
    # the export keeps the source's own spelling of the same pattern (pattern [0, 1, 0, 1])
    from mcore_rl.convert import export_config

    mixed = MIXED.replace(moe_layer_pattern=[0, 1, 0, 1])
    source = {"model_type": "qwen3_moe", "decoder_sparse_step": 2, "mlp_only_layers": []}
    cfg, kind = export_config(mixed, torch.float32, source)
    assert kind == "qwen3_moe" and (cfg.decoder_sparse_step, cfg.mlp_only_layers) == (2, [])
    cfg, _ = export_config(mixed, torch.float32, {**source, "decoder_sparse_step": 1})  # not this pattern
    assert (cfg.decoder_sparse_step, cfg.mlp_only_layers) == (1, [0, 2])
    alternating = DSV3.replace(num_layers=3, moe_layer_pattern=[1, 0, 1])
    with pytest.raises(ValueError, match="first-k-dense"):
        to_stock_hf_config(hf_config_from_model_config(alternating))
    # a dense layer costs a dense MLP; MLA's projections differ from GQA's
    dense = forward_flops_per_token(MIXED.replace(arch="qwen3", num_experts=0, moe_layer_pattern=None), 16)
    moe = forward_flops_per_token(MIXED.replace(moe_layer_pattern=None), 16)
    mixed = forward_flops_per_token(MIXED, 16)
    assert mixed.mlp == pytest.approx((dense.mlp + moe.mlp) / 2)
    h, heads = DSV3.hidden_size, DSV3.num_attention_heads
    q = 2 * (h * 24 + 24 * heads * 24)  # q_a, q_b (qk_head_dim 16 + rope 8 = 24 per head)
    kv = 2 * (h * (32 + 8) + 32 * heads * (16 + 16))  # kv_a, kv_b
    out = 2 * heads * 16 * h
    assert forward_flops_per_token(DSV3, 16).attention_projections == pytest.approx(DSV3.num_layers * (q + kv + out))


def test_bad_values_are_refused_naming_the_key() -> None:
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rules import Errors, check_model

    def errors_of(mc: ModelConfig) -> str:
        errors = Errors()
        check_model(mc, errors)
        with pytest.raises(ConfigError) as err:
            errors.raise_if_any()
        return str(err.value)

    assert "model.moe_layer_pattern: has 3 entries but num_layers is 4" in errors_of(
        MIXED.replace(moe_layer_pattern=[0, 1, 1])
    )
    assert "model.moe_layer_pattern: entries must be 0 (dense) or 1" in errors_of(
        MIXED.replace(moe_layer_pattern=[0, 2, 1, 1])
    )
    assert "model.moe_layer_pattern" in errors_of(MIXED.replace(arch="qwen3", num_experts=0))
    assert "model.moe_router_group_topk" in errors_of(DSV3.replace(moe_router_group_topk=5))
    assert "model.moe_router_num_groups" in errors_of(DSV3.replace(moe_router_num_groups=3))
    assert "model.multi_latent_attention" in errors_of(DSV3.replace(multi_latent_attention=False))
    assert "model.moe_router_enable_expert_bias" in errors_of(MIXED.replace(moe_router_enable_expert_bias=True))
    assert "model.mtp_num_layers_carried" in errors_of(MIXED.replace(mtp_num_layers_carried=1))
    linear = dataclasses.replace(DSV3, rope_scaling=RopeScalingConfig(type="linear", factor=2.0))
    assert "model.rope_scaling.type" in errors_of(linear)
    # what released configs set is not refused (tests/test_deepseek_v3_released.py converts them)
    errors = Errors()
    check_model(DSV3_RELEASED, errors)
    assert not errors.lines, errors.lines


def test_bf16_export_keeps_the_router_in_fp32(tmp_path) -> None:
    """As stock DeepSeek-V3 keeps them (`_keep_in_fp32_modules_strict`), and loads back in stock."""
    from transformers import DeepseekV3ForCausalLM

    from mcore_rl.convert import write_hf_checkpoint
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from tests.helpers import _load_tensors

    model = McoreRLForCausalLM(hf_config_from_model_config(DSV3))
    assert write_hf_checkpoint(model.state_dict(), DSV3, str(tmp_path), torch.bfloat16) == "deepseek_v3"
    tensors = _load_tensors(tmp_path)
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    DeepseekV3ForCausalLM.from_pretrained(tmp_path)  # loads in the stock class


# ---------------------------------------------------------------------------------------------
# megatron-core in a 2-rank world
# ---------------------------------------------------------------------------------------------


def _bias_moves_toward_balance(rank: int) -> None:
    """A few optimizer steps with the expert bias on: the most loaded expert's bias falls, the least
    loaded one's rises (finalize_model_grads), every rank holds the same bias, and the weight sync
    ships it under its HF name."""
    from mcore_rl.config.schema import OptimizerConfig
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import forward_backward, prepare_config, wrap_ddp
    from mcore_rl.train.optimizer import build_optimizer
    from mcore_rl.train.weight_sync import iter_hf_weights
    from tests.helpers import P, _global_batch

    mc = DSV3.replace(moe_router_bias_update_rate=0.05)
    pc = P(ep=2)
    init_model_parallel(pc)
    set_seed(3)
    config = transformer_config(mc, pc)
    chunks = wrap_ddp(build_model(mc, pc, config=config), config)
    prepare_config(config, chunks)
    optimizer = build_optimizer(chunks, OptimizerConfig(lr=1e-4), "fp32", 10)
    router = next(m for m in chunks[0].modules() if hasattr(m, "expert_bias") and m.expert_bias is not None)
    batches = _global_batch(mc.vocab_size)[rank * 2 : rank * 2 + 2]
    loads = []
    for _ in range(3):
        forward_backward(chunks, batches)  # finalize_model_grads updates the bias from this step's load
        optimizer.step()
        optimizer.zero_grad()
        loads.append(router.local_tokens_per_expert.clone())
    bias = router.expert_bias.detach().clone()
    assert bias.abs().max() > 0, "the expert bias did not move"
    every = [torch.empty_like(bias) for _ in range(2)]
    torch.distributed.all_gather(every, bias)
    assert torch.equal(every[0], every[1]), "ranks disagree on the expert bias"
    synced = dict(iter_hf_weights(chunks, mc))
    if rank == 0:
        torch.testing.assert_close(synced["model.layers.1.mlp.gate.e_score_correction_bias"], bias)
        assert "model.layers.0.mlp.gate_proj.weight" in synced  # the first layer is dense


def _world(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf, model_config_from_hf, read_hf_config
    from tests.helpers import P, _check_layout, _global_batch, _megatron_logits, _parity_reference
    from tests.helpers import _profile_counts_the_rank
    from tests.helpers import _tokens as convert_tokens

    for mc, layouts in [
        (MIXED, [P(pp=2)]),  # stage 0 holds only dense layers, stage 1 only MoE ones
        (DSV3_RELEASED, [P(tp=2, sp=True), P(ep=2)]),
        (DSV3_FULL_Q, [P(pp=2)]),  # full-rank query projection; an MoE layer on each stage
    ]:
        batches = _global_batch(mc.vocab_size)
        ref = _parity_reference(mc, batches)
        for pc in layouts:
            _check_layout(mc, pc, batches, ref, after=_profile_counts_the_rank(mc, pc))
    _bias_moves_toward_balance(rank)
    dist.barrier()
    # the FP8 checkpoint with an MTP layer: HF -> megatron (EP=2) -> HF, megatron logits in TP=2
    case = f"{tmp}/deepseek_v3"
    hf_to_mcore(f"{case}/fp8", f"{case}/mcore", P(ep=2))
    mcore_to_hf(f"{case}/mcore", f"{case}/export")
    mc = model_config_from_hf(read_hf_config(f"{case}/fp8"))
    assert mc.rope_scaling == DSV3_RELEASED.rope_scaling and mc.section(DeepSeekV3Keys).mtp_num_layers_carried == 1
    _megatron_logits(mc, P(tp=2, sp=True), f"{case}/mcore", convert_tokens(mc.vocab_size), f"{case}/megatron_logits.pt")
    dist.barrier()


def _released_checkpoints(root) -> None:
    """`root/hf`: a tiny stock DeepSeek-V3 with the released settings (`RELEASED_STOCK`) in bf16, its
    linear weights on an FP8 block grid and an MTP layer (`model.layers.2.*`, past its 2 layers);
    `root/fp8`: the same as released files store it (FP8 + `weight_scale_inv`, `quantization_config`)."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM

    from tests.helpers import _load_tensors
    from tests.test_deepseek_v3_released import FP8, quantize_fp8_blocks

    torch.manual_seed(0)
    stock = DeepseekV3ForCausalLM(_stock_deepseek_config(num_hidden_layers=2, **RELEASED_STOCK)).float()
    _randomize(stock)
    stock.to(torch.bfloat16).save_pretrained(root / "hf")
    tensors = _load_tensors(root / "hf")
    mtp = {k.replace("layers.1.", "layers.2."): v for k, v in tensors.items() if k.startswith("model.layers.1.")}
    g = torch.Generator().manual_seed(5)
    mtp |= {
        f"model.layers.2.{n}.weight": (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
        for n in ("enorm", "hnorm", "shared_head.norm")
    }
    mtp["model.layers.2.eh_proj.weight"] = (0.1 * torch.randn(64, 128, generator=g)).bfloat16()
    tensors |= mtp
    hf, fp8 = {}, {}
    for name, t in tensors.items():
        if name.endswith(".mlp.gate.weight") or name.endswith("e_score_correction_bias"):
            t = t.float()  # stock keeps the router in fp32 (_keep_in_fp32_modules_strict)
        if t.ndim == 2 and name.endswith("proj.weight") and "embed" not in name:
            q, scale = quantize_fp8_blocks(t, tuple(FP8_BLOCK))
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            expanded = scale.repeat_interleave(FP8_BLOCK[0], 0)[: t.shape[0]].repeat_interleave(FP8_BLOCK[1], 1)
            t = (q.float() * expanded[:, : t.shape[1]]).bfloat16()  # DeepSeek's weight_dequant
        else:
            fp8[name] = t.clone()
        hf[name] = t.clone()  # the MTP layer's copies must not share storage
    save_file(hf, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    (root / "fp8").mkdir()
    save_file(fp8, str(root / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    (root / "fp8" / "config.json").write_text(
        json.dumps({**config, "quantization_config": {**FP8, "weight_block_size": FP8_BLOCK}})
    )


@pytest.mark.slow
def test_megatron_parity_bias_update_and_round_trip(tmp_path) -> None:
    """Layouts, the expert bias, and a released-style FP8 checkpoint with an MTP layer: converted and
    exported, it comes back as its dequantized bf16 self bit for bit (MTP layer included), the
    export's stock logits equal megatron's, and the export generates with its cache as without."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import _check_export
    from tests.world import run_world

    case = tmp_path / "deepseek_v3"
    _released_checkpoints(case)
    run_world(2, _world, str(tmp_path))
    _check_export(case, "DeepseekV3ForCausalLM")  # export == hf (weights, MTP, config); logits
    exported = json.loads((case / "export" / "config.json").read_text())
    assert exported["first_k_dense_replace"] == 1 and exported["num_nextn_predict_layers"] == 1
    assert exported["rope_parameters"]["rope_type"] == "yarn" and "quantization_config" not in exported
    # stock transformers reads the FP8 files (dequantizing on CPU) as the bf16 ones
    with torch.no_grad():
        dequantized = AutoModelForCausalLM.from_pretrained(case / "fp8", dtype=torch.float32).eval()
        export = AutoModelForCausalLM.from_pretrained(case / "export", dtype=torch.float32).eval()
        for name, value in export.state_dict().items():
            assert torch.equal(dequantized.state_dict()[name].bfloat16().float(), value), name
        prompt = _tokens()[:1, :6]
        generated = export.generate(prompt, max_new_tokens=5, do_sample=False)
        ids = prompt
        for _ in range(5):  # greedy without a cache, one full forward per token
            ids = torch.cat([ids, export(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)
