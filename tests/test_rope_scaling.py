"""RoPE scaling (linear, Llama 3.x, YaRN) through every layer: config, reference model, megatron-core
model, conversion and the embedded engine.

* The reference model gives stock `transformers`' logits (`LlamaForCausalLM` with llama3 and linear,
  `Qwen3ForCausalLM` with yarn) at positions past `original_max_position_embeddings`, and differs
  from plain RoPE there.
* The embedded engine, serving a stock llama3 checkpoint, decodes the same greedy tokens as stock
  `generate`.
* One spawned 2-rank world: megatron-core's loss and gradients equal the reference's for each type in
  TP=2 and PP=2; a stock llama3 checkpoint in transformers 4.x spelling converts to megatron and
  exports back bit-identical, to `LlamaForCausalLM`, with `rope_scaling` still spelled so.
* Bad values and unsupported rope types fail with the key named as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from mcore_rl.config.schema import ModelConfig, RopeScalingConfig

# original_max_position_embeddings (8) is half the parity harness' sequence length (16), so
# positions beyond it are trained and compared.
LLAMA3 = RopeScalingConfig(
    type="llama3", factor=8.0, original_max_position_embeddings=8, low_freq_factor=1.0, high_freq_factor=4.0
)
LINEAR = RopeScalingConfig(type="linear", factor=4.0)
YARN = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=8)
# an explicit attention factor and unrounded ramp bounds: megatron-core's mscale path
YARN_ATTENTION = dataclasses.replace(YARN, attention_factor=1.3, beta_fast=16.0, truncate=False)
# A small RoPE base and a large init: most frequencies turn within 16 positions and attention is
# sharp, so the scaling moves the loss well beyond the parity tolerance.
BASE = ModelConfig(
    arch="qwen3",
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    max_position_embeddings=64,
    rotary_base=100.0,
    init_method_std=0.2,
)
LLAMA = dataclasses.replace(BASE, qk_layernorm=False)


# ---- reference model vs stock transformers -------------------------------------------------------


def _stock(kind: str, rope_scaling: dict, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=10000.0,
        initializer_range=0.1,
        rope_scaling=dict(rope_scaling),
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # transformers warns when factor != max / original positions
        warnings.simplefilter("ignore")
        if kind == "llama":
            return LlamaForCausalLM(LlamaConfig(**common)).eval()
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()


STOCK_CASES = {
    "llama3": (
        "llama",
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn_attention_factor": (
        "qwen3",
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 1.3,
            "beta_fast": 16.0,
            "truncate": False,
        },
    ),
}


@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_reference_logits_equal_stock_transformers(case) -> None:
    from mcore_rl.convert import export_kind, model_config_from_hf
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.hf.configuration import to_stock_hf_config

    kind, scaling = STOCK_CASES[case]
    stock = _stock(kind, scaling)
    mc = model_config_from_hf(stock.config)
    assert mc.rope_scaling.type == scaling["rope_type"] and mc.rope_scaling.factor == scaling["factor"]
    ours = hf_config_from_model_config(mc)
    again = to_stock_hf_config(ours)  # what export writes: the stock class, the same scaling
    assert export_kind(mc) == kind and type(again) is type(stock.config)
    assert {k: v for k, v in again.rope_parameters.items() if k != "rope_theta"} == scaling
    ids = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(5))  # 4x the original context
    logits = {}
    for name, m in [("scaled", mc), ("plain", dataclasses.replace(mc, rope_scaling=RopeScalingConfig()))]:
        ref = McoreRLForCausalLM(hf_config_from_model_config(m)).eval()
        ref.load_state_dict(stock.state_dict(), strict=True)
        with torch.no_grad():
            logits[name] = ref(ids).logits
    with torch.no_grad():
        want = stock(ids).logits
    torch.testing.assert_close(logits["scaled"], want, atol=2e-5, rtol=0)
    assert (logits["plain"] - want)[:, 16:].abs().max() > 1e-3  # the scaling matters past the original context


def test_engine_greedy_tokens_equal_stock_generate(tmp_path) -> None:
    """A stock llama3 checkpoint served by the embedded engine decodes what stock `generate` does,
    past the original context (16 positions)."""
    from mcore_rl.rollout.engine.core import EngineCore, Request
    from mcore_rl.rollout.engine.sampling import SamplingParams

    stock = _stock("llama", STOCK_CASES["llama3"][1])
    stock.save_pretrained(tmp_path)
    engine = EngineCore.from_model_path(str(tmp_path), context_length=128)
    prompt = [5, 17, 33, 42, 8, 61, 90, 3]
    engine.add_request(Request("g", list(prompt), SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)))
    out = None
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                out = o
    with torch.no_grad():
        want = stock.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=40,
            min_new_tokens=40,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert out is not None and out.output_ids == want
    plain = _stock("llama", {"rope_type": "default"})  # same weights, plain RoPE: other tokens
    with torch.no_grad():
        other = plain.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=40,
            min_new_tokens=40,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    assert other != want and len(set(want)) > 3


def test_trainer_started_engines_get_the_scaling(tmp_path) -> None:
    """`mcore-rl serve` engines of the trainer read the model from a written config.json."""
    from mcore_rl.hf.rope import hf_rope_dict, rope_scaling_of
    from mcore_rl.rollout.engine.core import _load_config
    from mcore_rl.rollout.engine_processes import write_model_dir

    for scaling in (LLAMA3, LINEAR, YARN_ATTENTION):
        mc = dataclasses.replace(BASE, rope_scaling=scaling)
        config = _load_config(write_model_dir(mc, str(tmp_path / scaling.type)))
        got = {k: v for k, v in rope_scaling_of(config).items() if k != "rope_theta"}
        assert got == hf_rope_dict(scaling, mc.max_position_embeddings) and config.rope_theta == 100.0


# ---- config and conversion errors ----------------------------------------------------------------


def test_bad_values_name_the_key() -> None:
    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.validate import validate_sft_config

    def problems(**values) -> str:
        overrides = [f"model.rope_scaling.{k}={v}" for k, v in values.items()]
        with pytest.raises(ConfigError) as err:
            validate_sft_config(load_config(SFTConfig, None, overrides), 1)
        return str(err.value)

    assert "model.rope_scaling.factor: must be >= 1" in problems(type="linear", factor=0.5)
    assert "model.rope_scaling.high_freq_factor: must be > low_freq_factor 4.0" in problems(
        type="llama3", low_freq_factor=4.0, high_freq_factor=2.0
    )
    text = problems(type="yarn", beta_slow=0, original_max_position_embeddings=0)
    assert "model.rope_scaling.beta_slow: must be > 0" in text
    assert "model.rope_scaling.original_max_position_embeddings: must be null" in text
    assert "model.rope_scaling.attention_factor: 1.2 needs factor > 1" in problems(
        type="yarn", factor=1.0, attention_factor=1.2
    )
    with pytest.raises(ConfigError, match="model.rope_scaling.type"):
        load_config(SFTConfig, None, ["model.rope_scaling.type=dynamic"])
    cfg = load_config(SFTConfig, None, ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4"])
    validate_sft_config(cfg, 1)  # a good one passes


def _write_config(path, **fields) -> None:
    base = dict(
        model_type="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**base, **fields}))


def test_convert_errors_name_the_key_the_file_has(tmp_path) -> None:
    from mcore_rl.convert import model_config_from_hf, read_hf_config
    from mcore_rl.hf.rope import rope_key_in_file

    def error(directory) -> str:
        with pytest.raises(ValueError) as err:
            model_config_from_hf(read_hf_config(str(directory)), rope_key_in_file(str(directory)))
        return str(err.value)

    v4, v5 = tmp_path / "v4", tmp_path / "v5"
    _write_config(v4, rope_theta=1e4, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    _write_config(v5, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert "rope_scaling.rope_type='dynamic': supported are default, linear, llama3, yarn" in error(v4)
    assert "rope_parameters.rope_type='dynamic'" in error(v5)
    _write_config(v4, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 0.5})
    assert "rope_scaling.factor: must be >= 1" in error(v4)
    _write_config(
        v4,
        rope_theta=1e4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 4.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert "rope_scaling.high_freq_factor: must be > low_freq_factor" in error(v4)
    _write_config(v4, rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    mc = model_config_from_hf(read_hf_config(str(v4)), rope_key_in_file(str(v4)))
    assert (mc.rope_scaling.type, mc.rope_scaling.factor, mc.rope_scaling.hf_key) == ("linear", 2.0, "rope_scaling")


# ---- megatron-core parity and the conversion round trip (one 2-rank world) ----------------------------


def _save_llama3_v4_checkpoint(directory) -> None:
    """A stock llama3 checkpoint made with transformers, its config.json in 4.x spelling
    (`rope_scaling` + top-level `rope_theta`, as Llama 3.1 files on the Hub)."""
    from tests.helpers import _randomize

    model = _stock("llama", STOCK_CASES["llama3"][1])
    _randomize(model)
    model.save_pretrained(directory)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    path.write_text(json.dumps(config, indent=2))


def _world(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_rl.convert import hf_to_mcore, mcore_to_hf
    from mcore_rl.convert import parallel_config as convert_layout
    from tests.helpers import P, _check_layout, _global_batch
    from tests.helpers import _parity_reference

    cases = [
        (dataclasses.replace(LLAMA, rope_scaling=LLAMA3), [P(tp=2, sp=True), P(pp=2)]),
        (dataclasses.replace(LLAMA, rope_scaling=LINEAR), [P(tp=2), P(pp=2)]),
        (dataclasses.replace(BASE, rope_scaling=YARN), [P(tp=2, sp=True), P(pp=2)]),
        (dataclasses.replace(BASE, rope_scaling=YARN_ATTENTION), [P(tp=2)]),
    ]
    for mc, layouts in cases:
        batches = _global_batch(mc.vocab_size)
        ref = _parity_reference(mc, batches)
        plain = _parity_reference(dataclasses.replace(mc, rope_scaling=RopeScalingConfig()), batches)
        assert abs(ref[0] - plain[0]) > 1e-3 * abs(ref[0]), (mc.rope_scaling, ref[0], plain[0])
        for pc in layouts:
            _check_layout(mc, pc, batches, ref)

    hf_to_mcore(f"{tmp}/hf", f"{tmp}/mcore", convert_layout(tp=2))
    mcore_to_hf(f"{tmp}/mcore", f"{tmp}/export", convert_layout(pp=2))
    dist.barrier()


@pytest.mark.slow
def test_megatron_parity_and_conversion_round_trip(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers import _assert_same_checkpoint
    from tests.world import run_world

    _save_llama3_v4_checkpoint(tmp_path / "hf")
    run_world(2, _world, str(tmp_path))
    _assert_same_checkpoint(tmp_path / "hf", tmp_path / "export")  # bit-identical tensors, same config.json
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert "rope_parameters" not in config and config["rope_theta"] == 10000.0
    assert config["rope_scaling"] == STOCK_CASES["llama3"][1]
    assert "rope_scaling" in (tmp_path / "mcore" / "recipe.yaml").read_text()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.rope_parameters["rope_type"] == "llama3"
