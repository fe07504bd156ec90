"""DeepSeek-V3 as released, and the models that share its architecture (Kimi-K2, DeepSeek-R1).

Without megatron: tiny configs with the released `config.json` fields (YaRN with mscale /
mscale_all_dim, any `topk_group`, `norm_topk_prob` false, `num_nextn_predict_layers`, block-scaled
FP8 `quantization_config`, Kimi-K2's `kimi_k2` model type) convert, and the reference model equals
stock `DeepseekV3ForCausalLM` on them; FP8 blocks dequantize as stock transformers dequantizes them,
whole or a row range at a time. The megatron-core side (parity in TP/EP layouts, the FP8 + MTP
checkpoint's round trip, `generate` from the export) runs in `test_deepseek_v3.py`'s world.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_deepseek_v3 import _randomize, _stock_deepseek_config, _tokens
from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
from mcore_rl.config.model_keys.moe import MoEKeys

# The released config.json files' architecture fields, at the tiny sizes of `_stock_deepseek_config`
# (what stays released: the RoPE scaling, router settings, MTP count and quantization).
YARN_V3 = {  # DeepSeek-V3 and DeepSeek-R1 (original context 4096 there; 16 here so it matters at 640)
    "type": "yarn",
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
}
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [8, 8]}
DEEPSEEK_R1 = dict(  # V3's architecture; R1 and V3 differ in weights only
    model_type="deepseek_v3",
    rope_scaling=YARN_V3,
    rope_theta=10000,
    max_position_embeddings=640,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=1,
    quantization_config=FP8,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
)
KIMI_K2 = dict(  # one group (topk_group 1: no group limit), beta_fast = beta_slow = 1, no MTP layers
    model_type="kimi_k2",
    rope_scaling={**YARN_V3, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0},
    rope_theta=50000.0,
    max_position_embeddings=512,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=3,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    num_nextn_predict_layers=0,
    quantization_config=FP8,
    auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
)
# settings no released file has, which the router now computes as stock does
UNRELEASED_ROUTING = dict(n_group=2, topk_group=1, num_experts_per_tok=3, norm_topk_prob=False)


def _config_json(tmp_path, fields: dict) -> str:
    """A checkpoint directory's config.json: a tiny stock config's with the released fields on top."""
    data = {**_stock_deepseek_config().to_dict(), **fields}
    data.pop("rope_parameters", None)  # released files spell RoPE the 4.x way: rope_scaling + rope_theta
    path = tmp_path / fields["model_type"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("fields", [DEEPSEEK_R1, KIMI_K2], ids=["deepseek_r1", "kimi_k2"])
def test_released_configs_convert_and_the_reference_equals_stock(tmp_path, fields) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from mcore_rl.convert import model_config_from_hf, read_hf_config
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.hf.modeling import from_stock_state_dict
    from mcore_rl.hf.rope import rope_key_in_file

    directory = _config_json(tmp_path, fields)
    hf = read_hf_config(directory)
    assert isinstance(hf, DeepseekV3Config)  # kimi_k2 reads as DeepSeek-V3's config, no remote code
    mc = model_config_from_hf(hf, rope_key_in_file(directory))
    s = mc.rope_scaling
    assert (s.type, s.factor, s.mscale, s.mscale_all_dim, s.hf_key) == (
        "yarn",
        float(fields["rope_scaling"]["factor"]),
        1.0,
        1.0,
        "rope_scaling",
    )
    assert (mc.section(DeepSeekV3Keys).moe_router_num_groups, mc.section(DeepSeekV3Keys).moe_router_group_topk) == (
        fields["n_group"],
        fields["topk_group"],
    )
    assert mc.section(DeepSeekV3Keys).mtp_num_layers_carried == fields["num_nextn_predict_layers"]
    torch.manual_seed(0)
    stock = DeepseekV3ForCausalLM(DeepseekV3Config.from_dict({**hf.to_dict(), "quantization_config": None}))
    stock = stock.float().eval()
    _randomize(stock)
    ours = McoreRLForCausalLM(hf_config_from_model_config(mc)).float().eval()
    ours.load_state_dict(from_stock_state_dict(stock.state_dict(), ours.config), strict=True)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, stock(x).logits, atol=1e-5, rtol=0)


def test_any_topk_group_and_unnormalised_routing_equal_stock() -> None:
    from transformers import DeepseekV3ForCausalLM

    from tests.test_deepseek_v3 import _reference_of_stock

    torch.manual_seed(0)
    stock = DeepseekV3ForCausalLM(_stock_deepseek_config(**UNRELEASED_ROUTING)).float().eval()
    _randomize(stock)
    mc, ours = _reference_of_stock(stock)
    assert (
        mc.section(DeepSeekV3Keys).moe_router_group_topk,
        mc.section(MoEKeys).moe_router_topk,
        mc.section(MoEKeys).moe_norm_topk_prob,
    ) == (1, 3, False)
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, stock(x).logits, atol=1e-5, rtol=0)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale_inv per block) as DeepSeek's checkpoints store them: each
    block's largest magnitude maps to e4m3's largest finite value (448)."""
    rows, cols = weight.shape
    br, bc = block
    scale = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float()
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_fp8_blocks_dequantize_whole_and_by_rows(tmp_path) -> None:
    """Partial last blocks; any row or column range reads as the same slice of the whole."""
    from safetensors.torch import save_file

    from mcore_rl.convert import HFCheckpoint

    torch.manual_seed(0)
    weight = torch.randn(37, 21)
    q, scale = quantize_fp8_blocks(weight, (16, 8))
    expected = torch.empty(37, 21)
    for r in range(37):
        for c in range(21):
            expected[r, c] = q[r, c].float() * scale[r // 16, c // 8]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**FP8, "weight_block_size": [16, 8]}}))
    save_file(
        {"w.weight": q, "w.weight_scale_inv": scale, "model.embed_tokens.weight": torch.zeros(2, 2)},
        str(tmp_path / "model.safetensors"),
    )
    ckpt = HFCheckpoint(str(tmp_path))
    assert sorted(ckpt) == ["model.embed_tokens.weight", "w.weight"] and "w.weight_scale_inv" not in ckpt
    assert torch.equal(ckpt["w.weight"], expected)  # fp32: the checkpoint's dtype (its embedding's)
    assert ckpt.meta("w.weight").dtype == torch.float32
    for dim, start, stop in [(0, 5, 30), (0, 16, 37), (1, 3, 17), (1, 8, 21)]:
        part = ckpt.read_rows("w.weight", dim, start, stop)
        assert torch.equal(part, expected[start:stop] if dim == 0 else expected[:, start:stop]), (dim, start, stop)


def test_released_refusals_that_remain_name_their_field() -> None:
    from mcore_rl.convert import model_config_from_hf

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    with pytest.raises(ValueError) as err:
        model_config_from_hf(
            _stock_deepseek_config(
                rope_parameters={**yarn, "attention_factor": 1.2},
                quantization_config={"quant_method": "awq", "bits": 4},
                topk_group=1,
            )
        )
    text = str(err.value)
    assert "rope_parameters.attention_factor=1.2" in text and "quantization_config=" in text
    assert "topk_group=1" in text  # 4 groups of 2 experts: one group cannot hold 4 experts
    with pytest.raises(ValueError, match="rope_type='linear'"):
        model_config_from_hf(_stock_deepseek_config(rope_parameters={"rope_type": "linear", "factor": 2.0}))
