"""The GPT-OSS family: attention sinks, windowed and full layers in turn, MoE with router and expert
biases and the clamped SwiGLU, YaRN.

Without megatron: the reference model equals stock `GptOssForCausalLM` for the same weights (full
forward, incremental decoding through a transformers cache whose windowed layers keep only their
window, `generate`); the embedded engine serves it like the reference; configs map both ways; bad
values and unbuildable stock configs are refused naming the key.
In one 2-rank gloo world: megatron-core loss and gradients equal the reference in EP=2 and PP=2,
and the weights go to megatron and back to HF names (and the stock layout) bit for bit.
"""

from __future__ import annotations


import pytest

from mcore_rl.config.model_keys.gpt_oss import GptOssKeys
from mcore_rl.config.model_keys.moe import MoEKeys
import torch

from mcore_rl.config.schema import ModelConfig, RopeScalingConfig

VOCAB, SEQ, WINDOW = 128, 16, 4

# Stock GPT-OSS's shape in small: every layer MoE, windowed and full layers in turn, YaRN without
# truncation (the released `rope_parameters`), the SwiGLU clamped at 7.
STOCK = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    head_dim=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=WINDOW,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    router_aux_loss_coef=0.01,
)
GPT_OSS = ModelConfig.of(
    arch="gpt_oss",
    vocab_size=VOCAB,
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    rotary_base=150000.0,
    max_position_embeddings=256,
    norm_epsilon=1e-5,
    qk_layernorm=False,
    num_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=0.01,
    sliding_window=WINDOW,
    sliding_window_pattern=[1, 0, 1, 0],
    rope_scaling=RopeScalingConfig(
        type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, truncate=False
    ),
    attention_sinks=True,
    linear_biases=True,
    swiglu_limit=7.0,
)


def _stock_config(**kw):
    from transformers import GptOssConfig

    return GptOssConfig(**{**STOCK, **kw})


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Weights at 1/sqrt(fan-in) and biases, sinks and norms away from their init, large enough
    that the SwiGLU clamp is reached and a wrong sink, bias or window moves the logits."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.normal_(1.0, 0.2)
        elif name.endswith("sinks"):
            p.normal_(0.0, 1.0)
        elif p.ndim == 1 or name.endswith("_bias"):
            p.normal_(0.0, 0.5)
        elif name.endswith("router.weight"):
            p.normal_(0.0, 0.5)
        elif name.endswith("gate_up_proj"):  # [.., in, out]: large enough for the clamp at 7
            p.normal_(0.0, 4.0 * p.shape[-2] ** -0.5)
        elif name.endswith("down_proj"):
            p.normal_(0.0, p.shape[-2] ** -0.5)
        elif "embed" in name:
            p.normal_(0.0, 1.0)
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5)


def _tokens(b: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(3))


def _stock_and_reference():
    from transformers import GptOssForCausalLM

    from mcore_rl.convert import model_config_from_hf
    from mcore_rl.hf import McoreRLForCausalLM, from_stock_state_dict, hf_config_from_model_config

    torch.manual_seed(0)
    stock = GptOssForCausalLM(_stock_config()).float().eval()
    _randomize(stock)
    mc = model_config_from_hf(stock.config)
    ours = McoreRLForCausalLM(hf_config_from_model_config(mc)).float().eval()
    ours.load_state_dict(from_stock_state_dict(stock.state_dict(), ours.config), strict=True)
    return stock, mc, ours


# ---------------------------------------------------------------------------------------------
# reference model vs stock transformers, the engine, configs, refusals (no megatron)
# ---------------------------------------------------------------------------------------------


def test_reference_equals_stock_gpt_oss() -> None:
    from mcore_rl.hf import to_stock_state_dict

    stock, mc, ours = _stock_and_reference()
    assert mc == GPT_OSS, "the stock config reads as the ModelConfig written here"
    x = _tokens()
    with torch.no_grad():
        want = torch.log_softmax(stock(x).logits, dim=-1)
        full = ours(x).logits
        torch.testing.assert_close(torch.log_softmax(full, dim=-1), want, atol=1e-5, rtol=0)
        # the clamp is reached: without it the model differs
        for layer in ours.model.layers:
            for expert in layer.mlp.experts:
                expert.limit = None
        assert (ours(x).logits - full).abs().max() > 1e-3, "the SwiGLU clamp is never reached"
        for layer in ours.model.layers:
            for expert in layer.mlp.experts:
                expert.limit = mc.section(GptOssKeys).swiglu_limit
        # incremental decoding through a transformers cache (its windowed layers keep WINDOW - 1
        # keys) = the full forward
        out = ours(x[:, :10], use_cache=True)
        assert out.cache.layers[0].keys.shape[2] == WINDOW - 1 and out.cache.layers[1].keys.shape[2] == 10
        step = ours(x[:, 10:12], past_key_values=out.cache, use_cache=True)
        step = torch.cat([step.logits, ours(x[:, 12:], past_key_values=step.cache).logits], dim=1)
        torch.testing.assert_close(step, full[:, 10:], atol=1e-5, rtol=0)
        # our weights are the stock ones under per-expert names; back to the stock layout bit for bit
        back = to_stock_state_dict(ours.state_dict(), ours.config)
        assert set(back) == set(stock.state_dict())
        assert all(torch.equal(back[k], v) for k, v in stock.state_dict().items())
        prompt = x[:1, :5]
        ours_ids = ours.generate(prompt, max_new_tokens=8, do_sample=False)
        stock_ids = stock.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours_ids, stock_ids)


def test_embedded_engine_serves_gpt_oss_like_the_reference() -> None:
    """Sinks and the per-layer window in the engine's batched attention: with continuous batching,
    prompts longer than the window, greedy and sampled tokens, every generated token's log-prob
    equals one cache-free reference forward."""
    import copy

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from tests.helpers import PROMPTS, assert_matches_reference, make_engine, req, run

    torch.manual_seed(0)
    model = McoreRLForCausalLM(hf_config_from_model_config(GPT_OSS.replace(vocab_size=384)))
    _randomize(model)
    ref = copy.deepcopy(model).eval()
    engine = make_engine(model)
    reqs = [req(f"g{i}", p, temperature=0.0, max_new_tokens=6, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    reqs += [req("s", PROMPTS[3], temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=5)]
    outs = run(engine, reqs, stagger=2)  # requests join a running batch
    assert_matches_reference(ref, reqs, outs, atol=1e-4)


def test_configs_both_ways_and_refusals() -> None:
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rules import Errors, check_model
    from mcore_rl.convert import model_config_from_hf
    from mcore_rl.hf import hf_config_from_model_config
    from mcore_rl.hf.configuration import to_stock_hf_config
    from mcore_rl.models.flops import forward_flops_per_token

    ours = hf_config_from_model_config(GPT_OSS)
    assert ours.layer_types == ["sliding_attention", "full_attention"] * 2 and ours.attention_bias
    stock = to_stock_hf_config(ours)
    assert stock.model_type == "gpt_oss"
    for key in ("layer_types", "sliding_window", "swiglu_limit", "num_local_experts", "intermediate_size", "head_dim"):
        assert getattr(stock, key) == getattr(_stock_config(), key), key
    # YaRN's beta defaults are left out of the export, as transformers reads them
    assert {"beta_fast": 32.0, "beta_slow": 1.0, **stock.rope_parameters} == _stock_config().rope_parameters
    assert model_config_from_hf(stock) == GPT_OSS
    # the stock default: windowed and full layers in turn
    assert model_config_from_hf(_stock_config(layer_types=None)).section(GptOssKeys).sliding_window_pattern == [
        1,
        0,
        1,
        0,
    ]

    def refused(**kw) -> str:
        with pytest.raises(ValueError) as err:
            model_config_from_hf(_stock_config(**kw))
        return str(err.value)

    assert "quantization_config" in refused(quantization_config={"quant_method": "awq"})
    model_config_from_hf(_stock_config(quantization_config={"quant_method": "mxfp4"}))  # dequantized on import
    assert "swiglu_alpha=1.5" in refused(swiglu_alpha=1.5)
    assert "attention_bias=false" in refused(attention_bias=False)

    def errors_of(mc: ModelConfig) -> str:
        errors = Errors()
        check_model(mc, errors)
        with pytest.raises(ConfigError) as err:
            errors.raise_if_any()
        return str(err.value)

    qwen = ModelConfig.of(arch="qwen3_moe", num_experts=4)
    assert "model.attention_sinks: is True but needs model.arch=gpt_oss" in errors_of(
        qwen.replace(attention_sinks=True)
    )
    assert "model.swiglu_limit" in errors_of(qwen.replace(swiglu_limit=7.0))
    assert "model.sliding_window_pattern: has 3 entries" in errors_of(GPT_OSS.replace(sliding_window_pattern=[1, 0, 1]))
    assert "model.attention_sinks" in errors_of(GPT_OSS.replace(attention_sinks=False))
    assert "model.qk_layernorm" in errors_of(GPT_OSS.replace(qk_layernorm=True))
    errors = Errors()
    check_model(GPT_OSS, errors)
    assert not errors.lines, errors.lines
    # layouts: expert biases only with one expert-TP rank (megatron-core asserts it while building)
    from mcore_rl.config.rules import check_parallel
    from tests.helpers import P

    errors = Errors()
    check_parallel(P(tp=2, sp=True), GPT_OSS, 2, errors)
    assert errors.lines == [
        "parallel.expert_tensor_parallel_size: is 2 but megatron-core builds the experts' biases "
        "(model.linear_biases, arch gpt_oss) only with expert_tensor_parallel_size 1"
    ]
    errors = Errors()
    check_parallel(P(tp=2, sp=True, etp=1, ep=2), GPT_OSS, 4, errors)
    assert not errors.lines
    # without EP, ETP 1 under TP 2 is refused for every MoE (tests/test_parity.py shows why)
    errors = Errors()
    check_parallel(P(tp=2, sp=True, etp=1), GPT_OSS, 2, errors)
    assert [line.split(":")[0] for line in errors.lines] == ["parallel.expert_tensor_parallel_size"]
    # FLOPs: the GQA decoder's count, every layer routed
    flops = forward_flops_per_token(GPT_OSS, 16)
    assert flops.mlp == pytest.approx(GPT_OSS.num_layers * 2 * (3 * 64 * 32 * 2 + 64 * 4))
    windowed_context = (WINDOW * (WINDOW + 1) / 2 + (16 - WINDOW) * WINDOW) / 16
    assert flops.attention_scores == pytest.approx(2 * 2 * 64 * (2 * windowed_context + 2 * (16 + 1) / 2))


def test_gpt_oss_120b_profile_shape_is_valid() -> None:
    """`configs/profile_gpt_oss_120b.yaml` (docs/model_families.md) is a valid GPT-OSS model: 117B
    parameters, 5.13B active per token (the model card's counts)."""
    import pathlib

    import yaml

    from mcore_rl.config.rules import Errors, check_model
    from mcore_rl.convert.to_hf import model_config_from_dict
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "profile_gpt_oss_120b.yaml"
    mc = model_config_from_dict(yaml.safe_load(path.read_text())["model"])
    errors = Errors()
    check_model(mc, errors)
    assert not errors.lines, errors.lines
    # counted on two of its layers (a windowed and a full one): the 36 are 18 such pairs
    two = mc.replace(num_layers=2, sliding_window_pattern=[1, 0])
    with torch.device("meta"):
        model = McoreRLForCausalLM(hf_config_from_model_config(two))
    count = {"layers": 0, "experts": 0, "embedding": 0, "other": 0}
    for name, p in model.named_parameters():
        kind = "experts" if ".mlp.experts." in name else "layers" if ".layers." in name else "other"
        count["embedding" if "embed_tokens" in name else kind] += p.numel()
    experts, layers = 18 * count["experts"], 18 * count["layers"]
    total = count["embedding"] + count["other"] + layers + experts
    active = (
        count["other"] + layers + experts * mc.section(MoEKeys).moe_router_topk // mc.section(MoEKeys).num_experts
    )  # as OpenAI counts: no embedding
    assert round(total / 1e9, 1) == 116.8 and round(active / 1e9, 2) == 5.13


# ---------------------------------------------------------------------------------------------
# checkpoint files: stock (stacked experts) and MXFP4 as released
# ---------------------------------------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> (blocks [E, out, in / 32, 16] uint8, scales [E, out, in / 32] uint8), as the
    released files store them: per block of 32 inputs the exponent that puts its largest value at or
    below 6, each value the nearest e2m1 code, two per byte (low nibble first)."""
    w = weight.float().transpose(1, 2).reshape(*weight.shape[:1], weight.shape[2], -1, 32)
    amax = w.abs().amax(dim=-1, keepdim=True).clamp_min(2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    codes = (w / 2.0**exponent).unsqueeze(-1).sub(E2M1).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()


def _stock_checkpoints(root) -> None:
    """`root/hf`: a tiny stock GPT-OSS saved by `save_pretrained` in bf16 (experts stacked);
    `root/mxfp4`: the same with its expert weights in MXFP4 and the released `quantization_config`."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    stock = GptOssForCausalLM(_stock_config()).float()
    _randomize(stock)
    stock.to(torch.bfloat16).save_pretrained(root / "hf")
    tensors = load_file(str(root / "hf" / "model.safetensors"))
    (root / "mxfp4").mkdir()
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensors.pop(name))
    save_file(tensors, str(root / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "hf" / "config.json").read_text())
    config["quantization_config"] = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    (root / "mxfp4" / "config.json").write_text(json.dumps(config))


def _dequantized_by_transformers(path) -> dict[str, torch.Tensor]:
    """The MXFP4 checkpoint's tensors with its experts dequantized by transformers' own code."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(path / "model.safetensors"))
    for name in [n[: -len("_blocks")] for n in tensors if n.endswith("_blocks")]:
        blocks, scales = tensors.pop(name + "_blocks"), tensors.pop(name + "_scales")
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    return tensors


def test_in_memory_export_stacks_experts_and_loads_in_stock(tmp_path) -> None:
    """`write_hf_checkpoint` (the export of a state dict) writes the stock file layout, experts stacked."""
    from transformers import GptOssForCausalLM

    from mcore_rl.convert import write_hf_checkpoint
    from mcore_rl.hf import to_stock_state_dict

    stock, mc, ours = _stock_and_reference()
    assert write_hf_checkpoint(ours.state_dict(), mc, str(tmp_path), torch.float32) == "gpt_oss"
    loaded = GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    want = to_stock_state_dict(ours.state_dict(), ours.config)
    assert set(loaded) == set(want) and all(torch.equal(loaded[k], v) for k, v in want.items())


def test_mxfp4_experts_read_dequantized_one_expert_at_a_time(tmp_path) -> None:
    """`HFCheckpoint` lists a stacked (and an MXFP4) checkpoint per expert, under the reference
    model's names, and reads one expert's slice: the stock tensor's, or transformers' dequantization."""
    from safetensors.torch import load_file

    from mcore_rl.convert import HFCheckpoint

    _stock_checkpoints(tmp_path)
    stock, want = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        _dequantized_by_transformers(tmp_path / "mxfp4"),
    )
    bf16, mxfp4 = HFCheckpoint(str(tmp_path / "hf")), HFCheckpoint(str(tmp_path / "mxfp4"))
    assert set(bf16) == set(mxfp4) and "model.layers.1.mlp.experts.3.gate_up_proj" in bf16
    assert not [n for n in mxfp4 if n.endswith(("_blocks", "_scales", "experts.down_proj"))]
    for layer, expert, leaf in [(0, 0, "gate_up_proj"), (1, 3, "down_proj"), (3, 2, "down_proj_bias")]:
        name = f"model.layers.{layer}.mlp.experts.{expert}.{leaf}"
        stacked = f"model.layers.{layer}.mlp.experts.{leaf}"
        assert torch.equal(bf16[name], stock[stacked][expert])
        assert mxfp4.meta(name).shape == want[stacked][expert].shape and mxfp4.meta(name).dtype == torch.bfloat16
        assert torch.equal(mxfp4[name], want[stacked][expert]), name
        assert torch.equal(mxfp4.read_rows(name, 0, 8, 16), want[stacked][expert][8:16])
    # the quantization is lossy, but close: what is imported is the released model, not noise
    error = (
        mxfp4["model.layers.0.mlp.experts.1.gate_up_proj"] - bf16["model.layers.0.mlp.experts.1.gate_up_proj"]
    ).float()
    assert 0 < error.abs().max() < 0.25 * bf16["model.layers.0.mlp.experts.1.gate_up_proj"].float().abs().max()


# ---------------------------------------------------------------------------------------------
# megatron-core in a 2-rank world
# ---------------------------------------------------------------------------------------------


# megatron's init std 0.1 (not 0.02): routing then depends on the token, and every expert gets some
PARITY = GPT_OSS.replace(init_method_std=0.1)


def _world(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_rl.convert import StreamStats, hf_to_mcore, mcore_to_hf
    from mcore_rl.hf.configuration import hf_config_from_model_config
    from mcore_rl.hf.modeling import to_stock_state_dict
    from mcore_rl.hf.weight_map import full_megatron_to_hf
    from mcore_rl.models.shards import gather_full_state_dict
    from tests.helpers import P, _check_layout, _global_batch, _parity_reference, _profile_counts_the_rank

    batches = _global_batch(PARITY.vocab_size)
    ref = _parity_reference(PARITY, batches)
    _, ref_state, _ = ref

    def exports_bit_for_bit(chunks) -> None:
        hf = full_megatron_to_hf(gather_full_state_dict(chunks), PARITY)
        assert set(hf) == set(ref_state)
        for name, value in ref_state.items():
            assert torch.equal(hf[name], value), name
        stock = to_stock_state_dict(hf, hf_config_from_model_config(PARITY))
        assert stock["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)

    # No TP in two ranks: megatron-core 0.16.1 builds expert biases only with expert tensor
    # parallelism 1 and MoE with TP only with sequence parallelism, and TP=2 x ETP=1 x EP=1 is
    # refused for every MoE (its expert gradients miss the other TP rank's tokens; test_parity.py).
    for pc in (P(ep=2), P(pp=2)):
        _check_layout(PARITY, pc, batches, ref, after=_profile_counts_the_rank(PARITY, pc, then=exports_bit_for_bit))
    _sequence_parallel_marks()
    dist.barrier()
    # checkpoint files: the stock one in EP=2, the MXFP4 one in EP=1 (two experts per rank, every
    # expert on both), each back to HF; no rank holds a stacked expert tensor (4 x 64 x 64 bf16) at
    # once, only one expert's slice
    stacked_bytes = PARITY.section(MoEKeys).num_experts * 64 * 64 * 2
    for source, layout, name in [("hf", P(ep=2), "ep2"), ("mxfp4", P(), "mxfp4_ep1")]:
        read, written = StreamStats(), StreamStats()
        hf_to_mcore(f"{tmp}/{source}", f"{tmp}/mcore_{name}", layout, precision="bf16", stats=read)
        mcore_to_hf(f"{tmp}/mcore_{name}", f"{tmp}/export_{name}", stats=written)
        assert 0 < read.largest_tensor_bytes < stacked_bytes and written.largest_tensor_bytes < stacked_bytes
        dist.barrier()


def _sequence_parallel_marks() -> None:
    """TP's marks, checked on a TP=2 x SP x ETP=1 model without running it (refused without EP on two
    ranks, `config/moe_rules.py: check_expert_gradient_reduction`; four ranks with EP=2 matched). With TP x SP, finalize_model_grads sums over TP the gradients of parameters marked
    `sequence_parallel`: the attention's output bias and the router's (replicated, each rank's
    gradient from its slice of the sequence), not an expert's output bias (whole on its rank; its
    TP neighbours may hold other experts). TP=2 x EP=2 x ETP=1 in four ranks matched the reference
    only without the mark (docs/model_families.md)."""
    from mcore_rl.models.builder import build_model
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from tests.helpers import P

    pc = P(tp=2, sp=True, etp=1)
    init_model_parallel(pc)
    set_seed(1)
    (chunk,) = build_model(PARITY, pc)
    marked = {n for n, p in chunk.named_parameters() if getattr(p, "sequence_parallel", False)}
    assert "decoder.layers.0.self_attention.linear_proj.bias" in marked and "decoder.layers.0.mlp.router.bias" in marked
    assert not {n for n in marked if ".mlp.experts." in n}, sorted(marked)
    # the sinks are split by head like the heads they belong to, so the shard maps gather them
    sinks = dict(chunk.named_parameters())["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert sinks.shape == (PARITY.num_attention_heads // 2,)
    assert getattr(sinks, "tensor_model_parallel", False) and getattr(sinks, "partition_dim", None) == 0


@pytest.mark.slow
def test_megatron_parity_in_ep_and_pp_and_checkpoint_files(tmp_path) -> None:
    """Parity in EP=2 and PP=2; a stock checkpoint (experts stacked) to megatron in EP=2 and back is
    the same file's tensors bit for bit, and `generate` from the export equals stock's; an MXFP4 one,
    in EP=1, comes back as transformers dequantizes it, bit for bit (the export is not quantized)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.world import run_world

    _stock_checkpoints(tmp_path)
    run_world(2, _world, str(tmp_path))
    stock = load_file(str(tmp_path / "hf" / "model.safetensors"))
    export = tmp_path / "export_ep2"
    with safe_open(str(export / "model.safetensors"), "pt") as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    assert set(got) == set(stock), sorted(set(got) ^ set(stock))
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in stock.items())
    # config.json the same, but for YaRN's default betas, which the export leaves out (as transformers reads them)
    configs = [json.loads((path / "config.json").read_text()) for path in (export, tmp_path / "hf")]
    for config in configs:
        config.pop("transformers_version")
        config["rope_parameters"] = {"beta_fast": 32.0, "beta_slow": 1.0, **config["rope_parameters"]}
    assert configs[0] == configs[1]
    want = _dequantized_by_transformers(tmp_path / "mxfp4")
    got = load_file(str(tmp_path / "export_mxfp4_ep1" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    assert "quantization_config" not in json.loads((tmp_path / "export_mxfp4_ep1" / "config.json").read_text())
    with torch.no_grad():
        prompt = _tokens()[:1, :6]
        ids = [
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(
                prompt, max_new_tokens=6, do_sample=False
            )
            for path in (tmp_path / "hf", export)
        ]
    assert torch.equal(*ids)
