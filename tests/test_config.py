"""Config loading, overrides and cross-field validation: every failure names the key at fault."""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import pytest

from mcore_rl.config import ConfigError, SFTConfig, load_config, save_config, validate_sft_config
from mcore_rl.config.loader import config_to_dict
from mcore_rl.config.validate import DerivedSizes


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def sft(*overrides: str) -> SFTConfig:
    return load_config(SFTConfig, None, list(overrides))


# ------------------------------------------------------------------- loading and overrides


def test_defaults_without_yaml():
    assert load_config(SFTConfig, None, []) == SFTConfig()


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "r.yaml", """
run_dir: runs/x
model:
  hidden_size: 128
  kv_channels: 32
optimizer:
  lr: 1e-3          # PyYAML reads this as a string; accepted for a float field
  min_lr: 0         # int accepted for float
train:
  precision: bf16
""")
    cfg = load_config(SFTConfig, path, [
        "train.precision=fp32",
        "parallel.sequence_parallel=true",
        "model.kv_channels=null",
        "optimizer.weight_decay=0.1",
        "run_dir=2024",  # str field keeps the literal text
    ])
    assert cfg.model.hidden_size == 128
    assert cfg.model.kv_channels is None
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == 0.0 and isinstance(cfg.optimizer.min_lr, float)
    assert cfg.train.precision == "fp32"
    assert cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.weight_decay == pytest.approx(0.1)
    assert cfg.run_dir == "2024"


def test_unknown_key_in_yaml_names_full_key_and_suggests(tmp_path):
    path = write(tmp_path, "r.yaml", "model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, path, [])
    msg = str(e.value)
    assert "model.hiden_size" in msg
    assert "did you mean 'model.hidden_size'" in msg
    assert "num_attention_heads" in msg  # lists the allowed keys at that level


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "r.yaml", "trian:\n  seed: 1\n")
    with pytest.raises(ConfigError, match=r"'trian'.*did you mean 'train'"):
        load_config(SFTConfig, path, [])


def test_unknown_key_in_override():
    suggestion = r"parallel\.tensor_parallel_size.*did you mean 'parallel\.tensor_model_parallel_size'"
    with pytest.raises(ConfigError, match=suggestion):
        sft("parallel.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match=r"not a section"):
        sft("train.seed.x=1")
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        sft("train.seed")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.hidden_size=abc", "expects int"),
        ("model.hidden_size=1.5", "expects int"),
        ("model.hidden_size=true", "expects int"),  # bool is not an int here
        ("parallel.sequence_parallel=1", "expects bool"),
        ("optimizer.lr=fast", "expects float"),
        ("model.kv_channels=x", "expects int or null"),
    ],
)
def test_wrong_type_names_key_type_and_value(override, expected):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        sft(override)
    msg = str(e.value)
    assert f"'{key}'" in msg and expected in msg and value in msg.lower()


def test_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        sft("train.precision=fp16")
    msg = str(e.value)
    assert "'train.precision'" in msg and "'fp32'" in msg and "'bf16'" in msg and "fp16" in msg


def test_section_must_be_mapping(tmp_path):
    path = write(tmp_path, "r.yaml", "model: 3\n")
    with pytest.raises(ConfigError, match="'model'"):
        load_config(SFTConfig, path, [])


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(SFTConfig, str(tmp_path / "nope.yaml"), [])


def test_defaults_are_merged_under_the_recipe(tmp_path):
    write(tmp_path, "base.yaml", "model:\n  hidden_size: 96\n  num_layers: 4\ntrain:\n  seed: 7\n")
    path = write(tmp_path, "r.yaml", "defaults: [base.yaml]\nmodel:\n  num_layers: 6\n")
    cfg = load_config(SFTConfig, path, [])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.train.seed) == (96, 6, 7)


def test_defaults_cycle(tmp_path):
    write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path, "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(SFTConfig, str(tmp_path / "a.yaml"), [])


def test_round_trip(tmp_path):
    cfg = sft("model.arch=qwen3_moe", "model.num_experts=4", "optimizer.lr=3e-4", "data.path=x.jsonl",
              "parallel.virtual_pipeline_model_parallel_size=2")
    path = str(tmp_path / "sub" / "config.yaml")
    save_config(cfg, path)
    again = load_config(SFTConfig, path, [])
    assert again == cfg
    assert config_to_dict(again)["model"]["num_experts"] == 4


@dataclasses.dataclass
class Inner:
    kind: Literal["a", "b"] = "a"


@dataclasses.dataclass
class Root:
    xs: list[int] = dataclasses.field(default_factory=list)
    inner: Optional[Inner] = None


def test_lists_and_nested_types(tmp_path):
    path = write(tmp_path, "r.yaml", "xs: [1, 2]\ninner:\n  kind: b\n")
    root = load_config(Root, path, [])
    assert root.xs == [1, 2] and root.inner == Inner("b")
    with pytest.raises(ConfigError, match=r"'xs\[1\]' expects int"):
        load_config(Root, None, ["xs=[1, x]"])


# ------------------------------------------------------------------- validation


def invalid(cfg: SFTConfig, world_size: int, key: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate_sft_config(cfg, world_size)
    msg = str(e.value)
    assert key in msg, msg
    return msg


def test_valid_default_and_derived_sizes():
    assert validate_sft_config(SFTConfig(), 1) == DerivedSizes(1, 1, 2)
    cfg = sft("parallel.tensor_model_parallel_size=2", "train.global_batch_size=16")
    assert validate_sft_config(cfg, 4) == DerivedSizes(2, 2, 2)


def test_world_not_divisible_by_model_parallel():
    cfg = sft("parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2")
    msg = invalid(cfg, 6, "parallel.tensor_model_parallel_size")
    assert "6" in msg and "4" in msg


def test_heads_and_groups_vs_tp():
    invalid(sft("parallel.tensor_model_parallel_size=4", "model.num_query_groups=2"), 4, "model.num_query_groups")
    invalid(sft("parallel.tensor_model_parallel_size=8", "model.num_query_groups=4"), 8, "model.num_attention_heads")
    invalid(sft("model.num_query_groups=3"), 1, "model.num_query_groups")
    invalid(sft("model.hidden_size=66"), 1, "model.kv_channels")
    validate_sft_config(sft("model.hidden_size=66", "model.kv_channels=16"), 1)


def test_moe_rules():
    moe = ["model.arch=qwen3_moe", "model.num_experts=4"]
    validate_sft_config(sft(*moe, "parallel.expert_model_parallel_size=2"), 2)
    invalid(sft(*moe, "parallel.expert_model_parallel_size=3"), 3, "model.num_experts")
    invalid(sft(*moe, "model.moe_router_topk=5"), 1, "model.moe_router_topk")
    invalid(sft("model.arch=qwen3_moe"), 1, "model.num_experts")
    invalid(sft("model.num_experts=4"), 1, "model.num_experts")  # dense arch with experts
    invalid(sft("parallel.expert_model_parallel_size=2"), 2, "parallel.expert_model_parallel_size")
    # world 2: tp*pp*cp=1 fits, but expert tp (2) x ep (2) x pp (1) = 4 does not divide it
    msg = invalid(sft(*moe, "parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2"),
                  2, "parallel.expert_model_parallel_size")
    assert "4" in msg
    invalid(sft(*moe, "parallel.tensor_model_parallel_size=2"), 2, "parallel.sequence_parallel")
    validate_sft_config(sft(*moe, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"), 2)


def test_sequence_parallel_without_tp_warns():
    with pytest.warns(UserWarning, match="sequence_parallel"):
        validate_sft_config(sft("parallel.sequence_parallel=true"), 1)


def test_pipeline_rules():
    invalid(sft("parallel.pipeline_model_parallel_size=2", "model.num_layers=3"), 2, "model.num_layers")
    invalid(sft("parallel.virtual_pipeline_model_parallel_size=2"), 1,
            "parallel.virtual_pipeline_model_parallel_size")
    invalid(sft("parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
                "model.num_layers=6", "train.global_batch_size=8"), 2, "model.num_layers")
    # 4 layers over pp=2 x vpp=2 is fine, but 3 micro-batches are not a multiple of pp=2
    vpp = ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
           "model.num_layers=4", "train.micro_batch_size=1"]
    invalid(sft(*vpp, "train.global_batch_size=3"), 2, "train.global_batch_size")
    validate_sft_config(sft(*vpp, "train.global_batch_size=4"), 2)


def test_batch_sizes():
    msg = invalid(sft("train.global_batch_size=6", "train.micro_batch_size=4"), 1, "train.global_batch_size")
    assert "6" in msg
    invalid(sft("train.global_batch_size=8", "train.micro_batch_size=4"), 4, "train.global_batch_size")


def test_context_parallel_needs_transformer_engine(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    msg = invalid(sft("parallel.context_parallel_size=2"), 2, "parallel.context_parallel_size")
    assert "transformer-engine" in msg


def test_sequence_length_and_positive_sizes():
    invalid(sft("train.seq_length=4096"), 1, "train.seq_length")
    invalid(sft("train.micro_batch_size=0"), 1, "train.micro_batch_size")
    invalid(sft("parallel.tensor_model_parallel_size=0"), 1, "parallel.tensor_model_parallel_size")
    invalid(sft("optimizer.min_lr=1.0"), 1, "optimizer.min_lr")


def test_all_errors_reported_together():
    msg = invalid(sft("train.seq_length=4096", "model.num_query_groups=3"), 1, "train.seq_length")
    assert "model.num_query_groups" in msg
