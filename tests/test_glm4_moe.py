"""The GLM-4.5 family (stock `Glm4MoeForCausalLM`): GQA with q/k/v biases, QK-norm and partial
rotary, DeepSeek-V3's sigmoid router with expert bias, shared experts and first dense layers.

Without megatron: the reference model equals stock `transformers` for the same weights (log-probs to
1e-5 in fp32), with and without its cache; configs translate both ways and bad values are refused
naming the key; the embedded engine serves it like the reference; `mcore-rl profile` counts its
parameters. In one 2-rank gloo world: megatron-core loss and gradients equal the reference in
TP=2, PP=2 and EP=2; a tiny stock GLM-4.5 checkpoint with an MTP layer converts to megatron and
exports back bit for bit, its stock logits equal megatron's and it generates with its cache as
without.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
from mcore_rl.config.model_keys.moe import MoEKeys
import torch

from mcore_rl.config.schema import ModelConfig, RopeScalingConfig

VOCAB, SEQ = 128, 16

# head_dim 32 with 4 heads on hidden 64 (GLM-4.5: 96 x 128 on 5120), half of it rotated, a group
# of 4 experts ranked by its best 2 (topk 3 > topk // topk_group)
GLM = ModelConfig.of(
    arch="glm4_moe",
    vocab_size=VOCAB,
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=32,
    qk_layernorm=True,
    add_qkv_bias=True,
    rotary_percent=0.5,
    num_experts=8,
    moe_router_topk=3,
    moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32,
    moe_layer_pattern=[0, 1],
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5,
)
# GLM-4.5-Air's settings: no QK-norm, one group (plain top-k), every layer MoE (its rules; the
# reference test covers no QK-norm against stock)
GLM_AIR = GLM.replace(
    qk_layernorm=False,
    moe_router_num_groups=1,
    moe_router_group_topk=1,
    moe_norm_topk_prob=False,
    moe_layer_pattern=None,
)


def _stock_config(**kw):
    from transformers import Glm4MoeConfig

    args = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Glm4MoeConfig(**{**args, **kw})


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Weights at 1/sqrt(fan-in), non-trivial norms and biases, a sharp router and a non-zero expert
    bias, so that every path (and a wrong routing or rotation) moves the logits."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, 0.3)
        elif p.ndim == 1:
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


@pytest.mark.parametrize("qk_norm", [True, False])
def test_reference_equals_stock_glm4_moe(qk_norm) -> None:
    from transformers import Glm4MoeForCausalLM

    torch.manual_seed(0)
    stock = Glm4MoeForCausalLM(_stock_config(use_qk_norm=qk_norm, norm_topk_prob=qk_norm)).float().eval()
    _randomize(stock)
    mc, ours = _reference_of_stock(stock)
    assert (mc.arch, mc.section(MoEKeys).moe_layer_pattern, mc.rotary_percent, mc.kv_channels) == (
        "glm4_moe",
        [0, 1, 1],
        0.5,
        32,
    )
    assert mc.add_qkv_bias and mc.qk_layernorm == qk_norm and mc.section(MoEKeys).moe_norm_topk_prob == qk_norm
    assert (
        mc.section(DeepSeekV3Keys).moe_router_num_groups,
        mc.section(DeepSeekV3Keys).moe_router_group_topk,
        mc.section(DeepSeekV3Keys).moe_router_topk_scaling_factor,
    ) == (2, 1, 2.5)
    assert (
        mc.section(MoEKeys).moe_shared_expert_intermediate_size == 32
        and mc.section(DeepSeekV3Keys).moe_router_score_function == "sigmoid"
    )
    x = _tokens()
    with torch.no_grad():
        full = ours(x).logits
        expected = torch.log_softmax(stock(x).logits, -1)
        torch.testing.assert_close(torch.log_softmax(full, -1), expected, atol=1e-5, rtol=0)
        # incremental decoding through the cache = the full forward
        out = ours(x[:, :10], use_cache=True)
        step = ours(x[:, 10:], past_key_values=out.cache).logits
    torch.testing.assert_close(step, full[:, 10:], atol=1e-5, rtol=0)


def test_configs_translate_both_ways_and_released_shapes_are_read() -> None:
    from transformers import Glm4MoeConfig

    from mcore_rl.convert import model_config_from_hf
    from mcore_rl.hf.configuration import hf_config_from_model_config, to_stock_hf_config

    ours = hf_config_from_model_config(GLM)
    assert (ours.family, ours.partial_rotary_factor, ours.qkv_bias, ours.n_group) == ("glm4_moe", 0.5, True, 2)
    stock = to_stock_hf_config(ours)
    assert stock.model_type == "glm4_moe" and stock.first_k_dense_replace == 1 and stock.attention_bias
    assert stock.rope_parameters["partial_rotary_factor"] == 0.5 and stock.n_shared_experts == 1
    assert model_config_from_hf(stock) == GLM
    assert model_config_from_hf(ours) == GLM
    # the stock defaults are GLM-4.5-Air's shape (its config.json adds head_dim 128): read as is,
    # with its MTP layer carried
    air = model_config_from_hf(Glm4MoeConfig(head_dim=128))
    assert (
        air.num_layers,
        air.section(MoEKeys).num_experts,
        air.section(MoEKeys).moe_router_topk,
        air.kv_channels,
        air.rotary_percent,
    ) == (
        46,
        128,
        8,
        128,
        0.5,
    )
    assert (
        air.section(MoEKeys).moe_layer_pattern == [0] + [1] * 45
        and air.section(DeepSeekV3Keys).mtp_num_layers_carried == 1
    )
    assert not air.qk_layernorm and not air.add_qkv_bias
    with pytest.raises(ValueError, match="first-k-dense"):
        to_stock_hf_config(hf_config_from_model_config(GLM.replace(num_layers=3, moe_layer_pattern=[1, 0, 1])))


def test_unsupported_stock_configs_are_refused_naming_the_field() -> None:
    from mcore_rl.hf.configuration import unsupported_stock_fields

    assert unsupported_stock_fields(_stock_config()) == []
    assert any(p.startswith("n_group=3") for p in unsupported_stock_fields(_stock_config(n_group=3)))
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    assert any("rope_type='yarn'" in p for p in unsupported_stock_fields(_stock_config(rope_parameters=yarn)))
    quantized = _stock_config()
    quantized.quantization_config = {"quant_method": "gptq"}
    assert any(p.startswith("quantization_config=") for p in unsupported_stock_fields(quantized))
    # partial rotary stays refused where the stock class does not rotate part of a head
    from transformers import Qwen3Config

    qwen = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    assert any("partial_rotary_factor=0.5" in p for p in unsupported_stock_fields(qwen))


# GLM-4.5-FP8's and GLM-4.5-Air-FP8's `quantization_config` as released: compressed-tensors, FP8
# weights with one scale per output channel (`weight_scale` [out, 1]), activations quantized per
# token at run time (nothing stored); the router, embeddings and head stay unquantized.
GLM45_FP8 = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "dynamic": True,
                "num_bits": 8,
                "strategy": "token",
                "symmetric": True,
                "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "dynamic": False,
                "num_bits": 8,
                "observer": "minmax",
                "strategy": "channel",
                "symmetric": True,
                "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def test_fp8_release_reads_dequantized_per_channel(tmp_path) -> None:
    """Each FP8 linear weight reads as fp8 x its row's scale, in the checkpoint's dtype (bf16),
    whole or a row/column range at a time; scales are not listed; other FP8 schemes are refused
    naming their field."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeForCausalLM

    from mcore_rl.convert import HFCheckpoint, model_config_from_hf, read_hf_config

    torch.manual_seed(0)
    stock = Glm4MoeForCausalLM(_stock_config(num_hidden_layers=2)).float()
    _randomize(stock)
    stock.to(torch.bfloat16).save_pretrained(tmp_path)
    tensors, expected = load_file(str(tmp_path / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith("proj.weight")]:  # every linear but the router and head
        weight = tensors[name].float()
        scale = (weight.abs().amax(dim=1, keepdim=True) / 448.0).bfloat16()  # e4m3's largest finite value
        tensors[name] = (weight / scale.float()).to(torch.float8_e4m3fn)
        tensors[name + "_scale"] = scale
        expected[name] = (tensors[name].float() * scale.float()).bfloat16()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": GLM45_FP8}))

    assert model_config_from_hf(read_hf_config(str(tmp_path))).arch == "glm4_moe"
    ckpt = HFCheckpoint(str(tmp_path))
    assert not [n for n in ckpt if n.endswith("_scale")] and len(expected) > 10
    for name, want in expected.items():
        assert ckpt.meta(name).dtype == torch.bfloat16 and torch.equal(ckpt[name], want), name
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    for dim, start, stop in [(0, 8, 40), (1, 4, 20)]:
        part = ckpt.read_rows(name, dim, start, stop)
        assert torch.equal(part, expected[name][start:stop] if dim == 0 else expected[name][:, start:stop])
    assert torch.equal(ckpt["model.layers.1.mlp.gate.weight"], tensors["model.layers.1.mlp.gate.weight"])

    def refused(quantization: dict) -> str:
        with pytest.raises(ValueError) as err:
            model_config_from_hf(_stock_config(quantization_config=quantization))
        return str(err.value)

    assert "quantization_config.format='pack-quantized'" in refused({**GLM45_FP8, "format": "pack-quantized"})
    int8 = copy.deepcopy(GLM45_FP8)
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    assert "quantization_config.config_groups.group_0.weights" in refused(int8)
    assert "quantization_config=" in refused({"quant_method": "awq"})


def test_bad_values_are_refused_naming_the_key() -> None:
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rules import Errors, check_model

    def errors_of(mc: ModelConfig) -> str:
        errors = Errors()
        check_model(mc, errors)
        with pytest.raises(ConfigError) as err:
            errors.raise_if_any()
        return str(err.value)

    for good in (GLM, GLM_AIR):
        errors = Errors()
        check_model(good, errors)
        assert not errors.lines, errors.lines
    assert "model.moe_router_score_function: arch glm4_moe routes with sigmoid" in errors_of(
        GLM.replace(moe_router_score_function="softmax", moe_router_enable_expert_bias=False)
    )
    assert "model.moe_router_group_topk" in errors_of(GLM.replace(moe_router_group_topk=3))
    assert "model.multi_latent_attention: is True but arch glm4_moe has the GQA decoder's attention" in errors_of(
        GLM.replace(multi_latent_attention=True)
    )
    assert "model.moe_shared_expert_gate" in errors_of(GLM.replace(moe_shared_expert_gate=True))
    # the router's keys belong to both families that route with it
    qwen = ModelConfig.of(arch="qwen3_moe", num_experts=8, moe_router_num_groups=2, moe_router_group_topk=1)
    assert "model.moe_router_num_groups: is 2 but needs model.arch=deepseek_v3 or glm4_moe" in errors_of(qwen)
    assert "model.rotary_percent: must be in (0, 1]" in errors_of(GLM.replace(rotary_percent=0.0))
    assert "model.rotary_percent: 0.3 x head_dim 32 = 9 rotated channels" in errors_of(GLM.replace(rotary_percent=0.3))
    yarn = RopeScalingConfig(type="yarn", factor=4.0)
    assert "model.rope_scaling.type: 'yarn' with rotary_percent 0.5" in errors_of(
        dataclasses.replace(GLM, rope_scaling=yarn)
    )


def test_embedded_engine_serves_glm4_moe_like_the_reference() -> None:
    """The engine rotates the first half of each head and routes with the sigmoid router: with
    continuous batching, greedy and sampled tokens, every generated token's log-prob equals one
    cache-free reference forward."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from tests.helpers import PROMPTS, assert_matches_reference, make_engine, req, run

    torch.manual_seed(0)
    model = McoreRLForCausalLM(hf_config_from_model_config(GLM.replace(vocab_size=384)))
    _randomize(model)
    ref = copy.deepcopy(model).eval()
    engine = make_engine(model)
    reqs = [req(f"g{i}", p, temperature=0.0, max_new_tokens=6, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    reqs += [req("s", PROMPTS[1], temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=5)]
    outs = run(engine, reqs, stagger=2)  # requests join a running batch
    assert_matches_reference(ref, reqs, outs, atol=1e-4)


def test_profile_counts_its_parameters_and_flops() -> None:
    """`mcore-rl profile`'s tensors are the model's: q/k/v biases, QK-norms, the first dense layer,
    router, routed and shared experts (the expert bias is a buffer in both)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.models.flops import forward_flops_per_token
    from mcore_rl.profile.layouts import Layout
    from mcore_rl.profile.memory import param_tensors

    model = McoreRLForCausalLM(hf_config_from_model_config(GLM))
    counted = sum(t.numel * t.count for t in param_tensors(GLM, Layout(tp=1, pp=1, dp=1)))
    assert counted == sum(p.numel() for p in model.parameters())
    flops = forward_flops_per_token(GLM, 16)
    h, q, kv = 64, 4 * 32, 2 * 32
    assert flops.attention_projections == pytest.approx(GLM.num_layers * 2 * (h * (q + 2 * kv) + q * h))


def test_bf16_export_keeps_the_router_in_fp32(tmp_path) -> None:
    """As stock GLM-4.5 keeps them (`_keep_in_fp32_modules_strict`), and loads back in stock."""
    from transformers import Glm4MoeForCausalLM

    from mcore_rl.convert import write_hf_checkpoint
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from tests.helpers import _load_tensors

    model = McoreRLForCausalLM(hf_config_from_model_config(GLM))
    assert write_hf_checkpoint(model.state_dict(), GLM, str(tmp_path), torch.bfloat16) == "glm4_moe"
    tensors = _load_tensors(tmp_path)
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    Glm4MoeForCausalLM.from_pretrained(tmp_path)  # loads in the stock class


# ---------------------------------------------------------------------------------------------
# megatron-core in a 2-rank world
# ---------------------------------------------------------------------------------------------


def _world(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf, model_config_from_hf, read_hf_config
    from tests.helpers import P, _check_layout, _global_batch, _megatron_logits, _parity_reference
    from tests.helpers import _tokens as convert_tokens

    batches = _global_batch(GLM.vocab_size)
    ref = _parity_reference(GLM, batches)
    for pc in [P(tp=2, sp=True), P(pp=2), P(ep=2)]:  # PP: the dense layer and the MoE one on their own stages
        _check_layout(GLM, pc, batches, ref)
    dist.barrier()
    # a stock checkpoint with an MTP layer: HF -> megatron (EP=2) -> HF, megatron logits in TP=2
    case = f"{tmp}/glm4_moe"
    hf_to_mcore(f"{case}/hf", f"{case}/mcore", P(ep=2))
    mcore_to_hf(f"{case}/mcore", f"{case}/export")
    mc = model_config_from_hf(read_hf_config(f"{case}/hf"))
    assert mc.rotary_percent == 0.5 and mc.section(DeepSeekV3Keys).mtp_num_layers_carried == 1
    _megatron_logits(mc, P(tp=2, sp=True), f"{case}/mcore", convert_tokens(mc.vocab_size), f"{case}/megatron_logits.pt")
    dist.barrier()


def _stock_checkpoint(root) -> None:
    """`root/hf`: a tiny stock GLM-4.5 (2 layers, the first dense) in bf16 with an MTP layer
    (`model.layers.2.*`, past its 2 layers, as the released checkpoints store it)."""
    from safetensors.torch import save_file
    from transformers import Glm4MoeForCausalLM

    from tests.helpers import _load_tensors

    torch.manual_seed(0)
    stock = Glm4MoeForCausalLM(_stock_config(num_hidden_layers=2, num_nextn_predict_layers=1)).float()
    _randomize(stock)
    stock.to(torch.bfloat16).save_pretrained(root / "hf")
    tensors = _load_tensors(root / "hf")
    mtp = {
        k.replace("layers.1.", "layers.2."): v.clone() for k, v in tensors.items() if k.startswith("model.layers.1.")
    }
    g = torch.Generator().manual_seed(5)
    mtp |= {
        f"model.layers.2.{n}.weight": (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
        for n in ("enorm", "hnorm", "shared_head.norm")
    }
    mtp["model.layers.2.eh_proj.weight"] = (0.1 * torch.randn(64, 128, generator=g)).bfloat16()
    tensors |= mtp
    for name in tensors:
        if name.endswith(".mlp.gate.weight") or name.endswith("e_score_correction_bias"):
            tensors[name] = tensors[name].float()  # stock keeps the router in fp32
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "hf" / "model.safetensors"))


@pytest.mark.slow
def test_megatron_parity_and_round_trip(tmp_path) -> None:
    """Layouts, and a stock checkpoint with an MTP layer: converted and exported, it comes back bit
    for bit (MTP layer included), the export's stock logits equal megatron's, and the export
    generates with its cache as without."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import _check_export
    from tests.world import run_world

    case = tmp_path / "glm4_moe"
    _stock_checkpoint(case)
    run_world(2, _world, str(tmp_path))
    _check_export(case, "Glm4MoeForCausalLM")  # export == hf (weights, MTP, config); logits
    exported = json.loads((case / "export" / "config.json").read_text())
    assert exported["first_k_dense_replace"] == 1 and exported["num_nextn_predict_layers"] == 1
    with torch.no_grad():
        export = AutoModelForCausalLM.from_pretrained(case / "export", dtype=torch.float32).eval()
        prompt = _tokens()[:1, :6]
        generated = export.generate(prompt, max_new_tokens=5, do_sample=False)
        ids = prompt
        for _ in range(5):  # greedy without a cache, one full forward per token
            ids = torch.cat([ids, export(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, ids)
