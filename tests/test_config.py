"""Config loading, overrides and cross-field validation: every failure names the key at fault."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import pytest

from mcore_rl.config import (
    ConfigError,
    RLConfig,
    SFTConfig,
    load_config,
    save_config,
    validate_rl_config,
    validate_sft_config,
)
from mcore_rl.config.loader import config_to_dict
from mcore_rl.config.validate import DerivedSizes
from tests.helpers import rl, rl_errors


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    path = write(
        tmp_path,
        "r.yaml",
        """
run_dir: runs/x
model:
  hidden_size: 128
  kv_channels: 32
optimizer:
  lr: 1e-3          # PyYAML reads this as a string; accepted for a float field
  min_lr: 0         # int accepted for float
train:
  precision: bf16
""",
    )
    cfg = load_config(
        SFTConfig,
        path,
        [
            "train.precision=fp32",
            "parallel.sequence_parallel=true",
            "model.kv_channels=null",
            "optimizer.weight_decay=0.1",
            "run_dir=2024",  # str field keeps the literal text
        ],
    )
    assert cfg.model.hidden_size == 128
    assert cfg.model.kv_channels is None
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == 0.0 and isinstance(cfg.optimizer.min_lr, float)
    assert cfg.train.precision == "fp32"
    assert cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.weight_decay == pytest.approx(0.1)
    assert cfg.run_dir == "2024"


def test_a_partial_section_override_keeps_the_recipes_other_keys(tmp_path):
    """`optimizer.lr=...` and `optimizer={lr: ...}` change lr only: the recipe's other optimizer keys
    (not the defaults) stay, and so do the section's nested keys under `init.sft.optimizer`."""
    path = write(
        tmp_path,
        "r.yaml",
        "optimizer:\n  lr: 1e-3\n  lr_decay_style: constant\n  weight_decay: 0.1\nmodel:\n  hidden_size: 128\n",
    )
    for override in ("optimizer.lr=2e-5", "optimizer={lr: 2e-5}"):
        cfg = load_config(SFTConfig, path, [override])
        assert cfg.optimizer.lr == pytest.approx(2e-5), override
        assert cfg.optimizer.lr_decay_style == "constant" and cfg.optimizer.weight_decay == pytest.approx(0.1)
        assert cfg.model.hidden_size == 128
    # a mapping replaces no section it names wrongly: its keys are still checked
    with pytest.raises(ConfigError, match="optimizer.lrr"):
        load_config(SFTConfig, path, ["optimizer={lrr: 2e-5}"])


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


def test_override_into_a_listed_entry(tmp_path):
    """`data.domains[i].key=value` changes an entry the recipe lists (typed and checked like any
    key); an index the recipe does not have, a misspelt key or an index on a non-list is named."""
    from mcore_rl.config import RLConfig

    path = write(
        tmp_path,
        "r.yaml",
        "data:\n  domains:\n    - {name: a, task: addition}\n"
        "    - {name: b, task: formatting, eval: {num_prompts: 5}}\n",
    )
    cfg = load_config(
        RLConfig, path, ["data.domains[0].weight=3", "data.domains[1].eval.num_prompts=7", "data.domains[1].name=2024"]
    )
    assert [(d.name, d.weight, d.eval.num_prompts) for d in cfg.data.domains] == [("a", 3.0, None), ("2024", 1.0, 7)]
    with pytest.raises(ConfigError, match=r"'data\.domains' has 2 entries in the recipe, so \[2\] does not exist"):
        load_config(RLConfig, path, ["data.domains[2].weight=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'data\.domains\[0\]\.wieght'.*did you mean"):
        load_config(RLConfig, path, ["data.domains[0].wieght=1"])
    with pytest.raises(ConfigError, match=r"'rollout\.max_new_tokens' is not a list of sections"):
        load_config(RLConfig, path, ["rollout.max_new_tokens[0]=1"])
    with pytest.raises(ConfigError, match=r"data\.domains\[0\]\.weight.*expects float"):
        load_config(RLConfig, path, ["data.domains[0].weight=heavy"])


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


def test_missing_defaults_file_names_the_recipe(tmp_path):
    path = write(tmp_path, "r.yaml", "defaults: [base/missing.yaml]\nmodel:\n  num_layers: 6\n")
    with pytest.raises(ConfigError) as e:
        load_config(SFTConfig, path, [])
    assert str(e.value).startswith(f"{path}: 'defaults' names 'base/missing.yaml', which is not a file")
    assert str(tmp_path / "base" / "missing.yaml") in str(e.value)


def test_override_as_first_argument(capsys):
    from mcore_rl.cli import main

    # an override whose value ends in .yaml is still an override (the validation error proves it was read)
    assert main(["train", "eval.path=held.yaml", "rollout.max_staleness=3"]) == 2
    err = capsys.readouterr().err
    assert "rollout.max_staleness: 3 needs rollout.runtime=async" in err and "config file not found" not in err
    for argv, hint in (
        (["train", "rollout.group_size", "4"], "rollout.group_size=4"),
        (["sft", "train.train_iters:5"], "train.train_iters=5"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{argv[1]!r} is not a recipe file; it looks like an override" in err and f"(e.g. {hint})" in err
        assert f"usage: mcore-rl {argv[0]} [RECIPE.yaml] [key.path=value ...]" in err
    assert main(["train", "nope.yaml"]) == 2 and "config file not found" in capsys.readouterr().err


def test_defaults_cycle(tmp_path):
    write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path, "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(SFTConfig, str(tmp_path / "a.yaml"), [])


def test_round_trip(tmp_path):
    cfg = sft(
        "model.arch=qwen3_moe",
        "model.num_experts=4",
        "optimizer.lr=3e-4",
        "data.path=x.jsonl",
        "parallel.virtual_pipeline_model_parallel_size=2",
    )
    path = str(tmp_path / "sub" / "config.yaml")
    save_config(cfg, path)
    again = load_config(SFTConfig, path, [])
    assert again == cfg
    assert config_to_dict(again)["model"]["num_experts"] == 4


def test_recipe_sections_load_at_their_yaml_keys_and_round_trip(tmp_path):
    """A recipe's keys are its own dataclass, registered under a core section (`config/sections.py`):
    nested (`rollout.polaris.*`) or flat among the owner's keys (`algorithm.mismatch.mipu_*`, a list
    entry's `data.mixture.stages[k].stop_*`); they load from YAML and overrides typed, a misspelt
    one fails like any key, and the saved config writes them back at the same keys."""
    from mcore_rl.recipes.config.mipu import MIPUConfig
    from mcore_rl.recipes.config.polaris import PolarisConfig
    from mcore_rl.recipes.config.remath import RefreshStopConfig

    path = write(
        tmp_path,
        "r.yaml",
        "rollout:\n  polaris:\n    rescue: true\nalgorithm:\n  mismatch:\n    mipu_c_start: 0.01\n"
        "data:\n  mixture:\n    stages:\n      - {start_step: 0}\n      - {start_step: 3, stop_patience: 2}\n",
    )
    cfg = load_config(RLConfig, path, ["rollout.polaris.correct_reward=0.5", "algorithm.mismatch.mipu_z=1"])
    assert cfg.rollout.section(PolarisConfig) == PolarisConfig(rescue=True, correct_reward=0.5)
    mipu = cfg.algorithm.mismatch.section(MIPUConfig)
    assert (mipu.c_start, mipu.z, mipu.bootstrap) == (0.01, 1.0, 200) and isinstance(mipu.z, float)
    stages = cfg.data.mixture.stages
    assert [st.section(RefreshStopConfig).patience for st in stages] == [0, 2]
    saved = str(tmp_path / "config.yaml")
    save_config(cfg, saved)
    plain = config_to_dict(cfg)
    assert plain["rollout"]["polaris"]["rescue"] is True and plain["algorithm"]["mismatch"]["mipu_c_start"] == 0.01
    assert plain["data"]["mixture"]["stages"][1]["stop_patience"] == 2 and "sections" not in plain["rollout"]
    assert load_config(RLConfig, saved, []) == cfg
    with pytest.raises(ConfigError, match=r"'rollout\.polaris\.rescu'; did you mean 'rollout\.polaris\.rescue'"):
        rl("rollout.polaris.rescu=true")
    with pytest.raises(ConfigError, match=r"'algorithm\.mismatch\.mipu_cstart'; did you mean .*mipu_c_start"):
        rl("algorithm.mismatch.mipu_cstart=1")
    with pytest.raises(ConfigError, match=r"config key 'rollout\.polaris\.rescue' expects bool"):
        rl("rollout.polaris.rescue=3")
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.sections'"):
        rl("rollout.sections={}")


# ModelConfig's keys when it was one union of every family's: each still sits where users write it.
MODEL_KEYS = (
    "arch vocab_size hidden_size ffn_hidden_size num_layers num_attention_heads num_query_groups kv_channels "
    "rotary_base max_position_embeddings norm_epsilon qk_layernorm tie_word_embeddings init_method_std num_experts "
    "moe_router_topk moe_ffn_hidden_size moe_shared_expert_intermediate_size moe_aux_loss_coeff moe_norm_topk_prob "
    "moe_token_dispatcher_type moe_latent_size attn_res attn_res_num_blocks ngram add_qkv_bias moe_shared_expert_gate mtp_num_layers "
    "sliding_window rope_scaling moe_layer_pattern moe_router_score_function moe_router_enable_expert_bias "
    "moe_router_bias_update_rate moe_router_num_groups moe_router_group_topk moe_router_topk_scaling_factor "
    "multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim "
    "mtp_num_layers_carried make_vocab_size_divisible_by rotary_percent sliding_window_pattern attention_sinks "
    "linear_biases swiglu_limit"
).split()


def test_model_sections_keep_their_keys_where_users_write_them(tmp_path):
    """The keys a model feature or family owns are its dataclass (`config/model_keys/`), flat among
    ModelConfig's shared keys (`model.q_lora_rank`) or in their own mapping (`model.ngram`): they load
    typed, a saved config writes them back at the same keys, an unknown one fails as before."""
    from mcore_rl.config.model_keys.attn_res import AttnResKeys
    from mcore_rl.config.model_keys.deepseek_v3 import DeepSeekV3Keys
    from mcore_rl.config.model_keys.moe import MoEKeys
    from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
    from mcore_rl.config.schema import ModelConfig

    path = write(tmp_path, "m.yaml", "model:\n  arch: deepseek_v3\n  q_lora_rank: 16\n  ngram: {orders: [2, 3]}\n")
    cfg = load_config(RLConfig, path, ["model.num_experts=4", "model.attn_res=full", "model.hidden_size=32"])
    m = cfg.model
    assert (m.hidden_size, m.section(DeepSeekV3Keys).q_lora_rank, m.section(MoEKeys).num_experts) == (32, 16, 4)
    assert (m.section(AttnResKeys).attn_res, m.section(NgramEmbeddingConfig).orders) == ("full", [2, 3])
    plain = config_to_dict(cfg)["model"]
    assert sorted(plain) == sorted(MODEL_KEYS) and plain["q_lora_rank"] == 16 and plain["ngram"]["orders"] == [2, 3]
    saved = str(tmp_path / "config.yaml")
    save_config(cfg, saved)
    assert load_config(RLConfig, saved, []) == cfg
    with pytest.raises(
        ConfigError, match=r"unknown config key 'model\.q_lora_rnk'; did you mean 'model\.q_lora_rank'\?"
    ):
        rl("model.q_lora_rnk=1")
    with pytest.raises(ConfigError, match=r"config key 'model\.num_experts' expects int"):
        rl("model.num_experts=many")
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.sections'"):
        rl("model.sections={}")
    # inline: by YAML keys (checked as a recipe's), or typed
    moe = ModelConfig.of(arch="qwen3_moe", num_experts=4)
    assert moe == ModelConfig(arch="qwen3_moe").replace(num_experts=4)
    assert moe == ModelConfig(arch="qwen3_moe").with_sections(MoEKeys(num_experts=4))
    assert moe != ModelConfig(arch="qwen3_moe") and repr(moe) != repr(ModelConfig(arch="qwen3_moe"))
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.num_expert'"):
        ModelConfig.of(num_expert=4)
    # the dataclass holds the shared keys only: 44 fields before, 19 (+ the sections) now (18, and
    # the partial rotary GLM-4.5 brought, a decoder key: the reference, the engine and megatron-core read it)
    assert len([f for f in dataclasses.fields(ModelConfig) if f.name != "sections"]) == 19


def test_warm_start_is_written_in_the_sft_types_and_the_flat_keys_still_read(tmp_path):
    """`init.sft` holds the SFT warm start in `mcore-rl sft`'s own types; the flat `init.sft_*` keys
    (every shipped config writes them) set the same settings and make the same SFT config, a setting
    written both ways is refused naming both keys, and messages name the key the config wrote."""
    from mcore_rl.config.schema import DataConfig, OptimizerConfig, TrainConfig

    def load(*overrides: str) -> RLConfig:
        return load_config(RLConfig, None, list(overrides))

    flat = load(
        "init.sft_steps=5",
        "init.sft_lr=1e-3",
        "init.sft_min_lr=1e-4",
        "init.sft_warmup_steps=2",
        "init.sft_lr_decay_style=linear",
        "init.sft_micro_batch_size=2",
        "init.sft_seq_length=32",
        "init.sft_num_examples=64",
        "optimizer.clip_grad=0.5",
        "train.precision=bf16",
    )
    typed = load(
        "init.sft.train.train_iters=5",
        "init.sft.optimizer.lr=1e-3",
        "init.sft.optimizer.min_lr=1e-4",
        "init.sft.optimizer.lr_warmup_iters=2",
        "init.sft.optimizer.lr_decay_style=linear",
        "init.sft.train.micro_batch_size=2",
        "init.sft.train.seq_length=32",
        "init.sft.data.synthetic_num_examples=64",
        "optimizer.clip_grad=0.5",
        "train.precision=bf16",
    )
    assert flat == typed and flat.sft_view(2) == typed.sft_view(2)
    view = flat.sft_view(2)  # what the flat keys made before: these settings, the rest the run's
    assert view.optimizer == OptimizerConfig(
        lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="linear", clip_grad=0.5, backend="torch"
    )
    assert view.train == TrainConfig(
        seed=1234,
        seq_length=32,
        micro_batch_size=2,
        global_batch_size=4,
        train_iters=5,
        precision="bf16",
        eval_interval=0,
    )
    assert view.data == DataConfig(synthetic_task="addition", synthetic_num_examples=64, synthetic_max_digits=2)
    # the defaults are the flat keys' defaults
    assert load().sft_view(1).optimizer == OptimizerConfig(lr=3e-3, min_lr=3e-5, lr_warmup_iters=10)
    assert (load().init.sft.train.micro_batch_size, load().init.sft.data.synthetic_num_examples) == (8, 8192)
    saved = str(tmp_path / "config.yaml")
    save_config(flat, saved)
    assert load_config(RLConfig, saved, []) == flat
    with pytest.raises(
        ConfigError, match=r"init\.sft_lr and init\.sft\.optimizer\.lr both set .*; keep init\.sft\.optimizer\.lr"
    ):
        load("init.sft_lr=1e-3", "init.sft.optimizer.lr=2e-3")
    assert rl_errors(load("init.sft_steps=2", "init.sft_seq_length=0"), 1) == [
        "init.sft_seq_length: must be in [1, model.max_position_embeddings=2048], got 0"
    ]
    assert rl_errors(load("init.sft.train.train_iters=2", "init.sft.train.seq_length=0"), 1) == [
        "init.sft.train.seq_length: must be in [1, model.max_position_embeddings=2048], got 0"
    ]
    # a key of these types that the warm start takes from the run, or does not use, stays at its default
    errors = rl_errors(load("init.sft.optimizer.clip_grad=0.5", "init.sft.data.path=x.jsonl"), 1)
    assert errors == [
        "init.sft.optimizer.clip_grad: is the RL run's setting for the warm start too: set optimizer.clip_grad instead",
        "init.sft.data.path: is not used by the warm start (packed, prompt-masked rows of the task's answers, "
        "one micro-batch per data-parallel rank per step, no evaluation); leave it at its default",
    ]


def test_section_keys_never_shadow_a_key():
    """A flat section's keys sit among its owner's: none may repeat a field's or another section's."""
    from mcore_rl.config.loader import _field_types
    from mcore_rl.config.sections import registered, sections_of

    for owner in {s.owner for s in registered()}:
        keys = list(_field_types(owner))
        for s in sections_of(owner):
            keys += list(s.yaml_keys()) if s.flat else [s.key]
        assert len(keys) == len(set(keys)), owner.__name__


@dataclasses.dataclass
class Inner:
    kind: Literal["a", "b"] = "a"


@dataclasses.dataclass
class Root:
    xs: list[int] = dataclasses.field(default_factory=list)
    inner: Inner | None = None


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
    validate_sft_config(sft("model.hidden_size=66", "model.kv_channels=16"), 1)


def test_an_underivable_head_dim_names_the_key_the_user_set():
    """`model.hidden_size=63` on the demo: the error names hidden_size (set) and num_attention_heads,
    not kv_channels, a key the user never set (it is only where the derived head dim would go)."""
    msg = invalid(sft("model.hidden_size=66"), 1, "model.hidden_size")
    assert "model.num_attention_heads" in msg and "model.kv_channels:" not in msg
    demo = load_config(RLConfig, os.path.join(ROOT, "configs", "demo.yaml"), ["model.hidden_size=63"])
    lines = rl_errors(demo, 1)
    assert [line.split(":", 1)[0] for line in lines] == ["model.hidden_size"], lines


def test_moe_rules():
    moe = ["model.arch=qwen3_moe", "model.num_experts=4"]
    validate_sft_config(sft(*moe, "parallel.expert_model_parallel_size=2"), 2)
    invalid(sft(*moe, "parallel.expert_model_parallel_size=3"), 3, "model.num_experts")
    invalid(sft(*moe, "model.moe_router_topk=5"), 1, "model.moe_router_topk")
    invalid(sft("model.arch=qwen3_moe"), 1, "model.num_experts")
    invalid(sft("model.num_experts=4"), 1, "model.num_experts")  # dense arch with experts
    invalid(sft("parallel.expert_model_parallel_size=2"), 2, "parallel.expert_model_parallel_size")
    # world 2: tp*pp*cp=1 fits, but expert tp (2) x ep (2) x pp (1) = 4 does not divide it
    msg = invalid(
        sft(*moe, "parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2"),
        2,
        "parallel.expert_model_parallel_size",
    )
    assert "4" in msg
    invalid(sft(*moe, "parallel.tensor_model_parallel_size=2"), 2, "parallel.sequence_parallel")
    validate_sft_config(sft(*moe, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"), 2)


def test_sequence_parallel_without_tp_warns():
    with pytest.warns(UserWarning, match="sequence_parallel"):
        validate_sft_config(sft("parallel.sequence_parallel=true"), 1)


def test_pipeline_rules():
    invalid(sft("parallel.pipeline_model_parallel_size=2", "model.num_layers=3"), 2, "model.num_layers")
    invalid(sft("parallel.virtual_pipeline_model_parallel_size=2"), 1, "parallel.virtual_pipeline_model_parallel_size")
    invalid(
        sft(
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "model.num_layers=6",
            "train.global_batch_size=8",
        ),
        2,
        "model.num_layers",
    )
    # 4 layers over pp=2 x vpp=2 is fine, but 3 micro-batches are not a multiple of pp=2
    vpp = [
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        "model.num_layers=4",
        "train.micro_batch_size=1",
    ]
    invalid(sft(*vpp, "train.global_batch_size=3"), 2, "train.global_batch_size")
    validate_sft_config(sft(*vpp, "train.global_batch_size=4"), 2)


def test_batch_sizes():
    msg = invalid(sft("train.global_batch_size=6", "train.micro_batch_size=4"), 1, "train.global_batch_size")
    assert "6" in msg
    invalid(sft("train.global_batch_size=8", "train.micro_batch_size=4"), 4, "train.global_batch_size")


def test_context_parallel_needs_transformer_engine(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a)
    )
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


# ------------------------------------------------------------------- RL validation


def test_rl_valid_and_derived_sizes():
    assert validate_rl_config(rl(), 2) == DerivedSizes(2, 2, 1)
    assert validate_rl_config(rl("parallel.tensor_model_parallel_size=2"), 4) == DerivedSizes(2, 2, 1)
    assert validate_rl_config(RLConfig(), 1) == DerivedSizes(1, 1, 1)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["rollout.max_staleness=2"], "rollout.max_staleness"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["rollout.temperature=0"], "rollout.temperature"),
        (["train.seq_length=8"], "train.seq_length"),
        (["algorithm.num_minibatches=100"], "algorithm.num_minibatches"),
        (["algorithm.mismatch.name=mipu", "algorithm.mismatch.mask_low=0.5"], "algorithm.mismatch.mask_low"),
        (["algorithm.mismatch.name=mipu", "algorithm.policy_loss=gspo"], "algorithm.policy_loss"),
        (["algorithm.mismatch.clip_low=3", "algorithm.mismatch.clip_high=2"], "algorithm.mismatch.clip_low"),
        (["eval.score=avg@k", "eval.k=0"], "eval.score"),
        (["reward.name=nope"], "reward.name"),
        (["rollout.engine_urls=[localhost:1]"], "rollout.engine_urls[0]"),
        (["rollout.engine_urls=[http://h:1]", "rollout.sync_transport=disk"], "rollout.sync_dir"),
        (["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
        (["model.num_attention_heads=3"], "model.num_query_groups"),
        (
            ["parallel.virtual_pipeline_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
            "parallel.virtual_pipeline_model_parallel_size",
        ),  # RL steps have no fixed micro-batch count
        (["init.sft_steps=2", "data.path=x.jsonl"], "init.sft_steps"),
        # the asynchronous runtime: impossible settings fail before any engine process starts
        (["rollout.runtime=async", "rollout.max_staleness=-1"], "rollout.max_staleness"),
        (["rollout.runtime=async", "rollout.max_inflight_requests=100000"], "rollout.max_inflight_requests"),
        (["rollout.runtime=async", "rollout.max_inflight_requests=2"], "rollout.max_inflight_requests"),
        (
            ["rollout.runtime=async", "rollout.placement=colocated", "rollout.engine_urls=[http://h:1]"],
            "rollout.placement",
        ),
        (["rollout.placement=colocated"], "rollout.placement"),
        (
            ["rollout.runtime=async", "rollout.num_embedded_engines=2", "rollout.engine_cores=[[0]]"],
            "rollout.engine_cores",
        ),
        (["rollout.runtime=async", "rollout.engine_cores=[[9999]]"], "rollout.engine_cores[0]"),
        (["rollout.runtime=async", "rollout.buffer_groups=1"], "rollout.buffer_groups"),
        (
            ["rollout.runtime=async", "rollout.max_staleness=1", "algorithm.mismatch.name=mipu"],
            "algorithm.mismatch.name",
        ),
        (
            ["algorithm.mismatch.name=mipu", "algorithm.mismatch.mipu_validation_group_size=1"],
            "algorithm.mismatch.mipu_validation_group_size",
        ),
        (["algorithm.mismatch.name=mipu", "algorithm.mismatch.mipu_z=-1"], "algorithm.mismatch.mipu_z"),
        (["algorithm.mismatch.name=mipu", "algorithm.mismatch.mipu_z=inf"], "algorithm.mismatch.mipu_z"),
        (["algorithm.mismatch.name=mipu", "algorithm.mismatch.mipu_bootstrap=-1"], "algorithm.mismatch.mipu_bootstrap"),
        (["rollout.engine_devices=[gpu0]"], "rollout.engine_devices"),
        (["rollout.runtime=async", "rollout.no_engine_timeout_s=0"], "rollout.no_engine_timeout_s"),
    ],
)
def test_rl_validation_names_the_key(overrides, key):
    assert any(line.startswith(key + ":") for line in rl_errors(rl(*overrides))), key


def _names(kind: str) -> str:
    from mcore_rl.algos import registry

    return ", ".join(registry.names(kind))


def test_unknown_algorithm_names_list_the_registry():
    from mcore_rl.algos import registry

    assert "mipu" in registry.names("mismatch")
    assert f"algorithm.advantage: unknown advantage 'foo'; registered: {_names('advantage')}" in rl_errors(
        rl("algorithm.advantage=foo")
    )
    assert f"algorithm.policy_loss: unknown policy loss 'foo'; registered: {_names('policy_loss')}" in rl_errors(
        rl("algorithm.policy_loss=foo")
    )
    assert (
        f"algorithm.mismatch.name: unknown mismatch correction 'bogus'; registered: {_names('mismatch')}"
        in rl_errors(rl("algorithm.mismatch.name=bogus"))
    )  # loads (a str field), refused by validation


def test_unknown_task_and_reward_list_the_registry():
    from mcore_rl.data.tasks import task_names
    from mcore_rl.rewards import reward_names

    task_line = f"data.synthetic_task: unknown task 'nope'; registered: {', '.join(task_names())}"
    assert task_line in rl_errors(rl("data.synthetic_task=nope"))
    assert task_line in invalid(sft("data.synthetic_task=nope"), 1, "data.synthetic_task")
    lines = rl_errors(rl("reward.name=nope"))
    assert lines == [
        f"reward.name: unknown reward 'nope'; registered: {', '.join(reward_names())} (or 'package.module:function')"
    ]  # and not also 'is scored by'
    assert "addition" in reward_names() and "math" in reward_names()


def test_reward_must_score_the_synthetic_task():
    assert rl_errors(rl("reward.name=math")) == [
        "reward.name: the synthetic task 'addition' is scored by 'addition', got 'math'"
    ]
    validate_rl_config(rl("reward.name=math", "data.path=x.jsonl", "init.sft_steps=0"), 2)
    validate_rl_config(rl("reward.name=tests.test_rewards:_length_reward"), 2)  # an import path is the user's choice


@pytest.mark.parametrize(
    "name, error",
    [
        ("nosuchmod:fn", "ModuleNotFoundError: No module named 'nosuchmod'"),
        (
            "mcore_rl.rewards.math_verify:no_such_fn",
            "AttributeError: module 'mcore_rl.rewards.math_verify' has no attribute 'no_such_fn'",
        ),
        (
            "mcore_rl.rewards.math_verify:logger",
            "TypeError: 'mcore_rl.rewards.math_verify:logger' is a Logger, not a function",
        ),
        (":fn", "ValueError: Empty module name"),
    ],
)
def test_reward_import_path_is_resolved_when_validating(name, error):
    """Found now, not after the SFT warm start: the module is imported and the name must be callable."""
    assert rl_errors(rl(f"reward.name={name}")) == [f"reward.name: {name!r} cannot be loaded: {error}"]


@pytest.fixture
def runtime_advantage():
    from mcore_rl.algos import registry

    registry.register("advantage", "my_test_adv")(lambda rewards, group_ids, **inputs: rewards)
    yield "my_test_adv"
    del registry._TABLES["advantage"]["my_test_adv"]


def test_names_come_from_the_registry(runtime_advantage):
    validate_rl_config(rl(f"algorithm.advantage={runtime_advantage}"), 2)
    assert runtime_advantage in rl_errors(rl("algorithm.advantage=foo"))[0]


@pytest.fixture
def long_task():
    """A task registered at runtime whose prompts are long and scored by 'math'."""
    from mcore_rl.data import tasks

    @dataclasses.dataclass(frozen=True)
    class LongTask:
        max_digits: int = 1
        name: str = "long_test_task"
        reward: str = "math"

        def max_prompt_tokens(self) -> int:
            return 20 * self.max_digits

    tasks.register_task("long_test_task")(LongTask)
    yield "long_test_task"
    del tasks._TASKS["long_test_task"]


def test_task_rules_come_from_the_task(long_task):
    cfg = rl(f"data.synthetic_task={long_task}", "reward.name=math", "data.synthetic_max_digits=1")
    validate_rl_config(cfg, 2)  # 1 + 20 + 4 tokens fit in 32
    assert rl_errors(rl(f"data.synthetic_task={long_task}", "data.synthetic_max_digits=2")) == [
        "train.seq_length: 32 is shorter than the longest sample (45 tokens: prompt + rollout.max_new_tokens=4); "
        "raise it or lower rollout.max_new_tokens",
        f"reward.name: the synthetic task '{long_task}' is scored by 'math', got 'addition'",
    ]


def test_addition_prompt_length_sets_the_row_length():
    # "999+999=" is 8 tokens, + bos + 4 new tokens = 13
    validate_rl_config(rl("data.synthetic_max_digits=3", "train.seq_length=13"), 2)
    assert rl_errors(rl("data.synthetic_max_digits=3", "train.seq_length=12"))[0].startswith(
        "train.seq_length: 12 is shorter than the longest sample (13 tokens"
    )


def test_rl_errors_in_several_sections_are_reported_together():
    lines = rl_errors(
        rl(
            "parallel.tensor_model_parallel_size=3",  # world 2
            "optimizer.min_lr=1.0",
            "data.synthetic_task=nope",
            "rollout.temperature=0",
            "algorithm.advantage=foo",
            "algorithm.mismatch.veto_threshold=-1",
            "reward.timeout_s=0",
            "eval.k=-1",
            "init.sft_lr=-1",
        )
    )
    keys = [line.split(":", 1)[0] for line in lines]
    for key in [
        "parallel.tensor_model_parallel_size",
        "optimizer.min_lr",
        "data.synthetic_task",
        "rollout.temperature",
        "algorithm.advantage",
        "algorithm.mismatch.veto_threshold",
        "reward.timeout_s",
        "eval.k",
        "init.sft_lr",
    ]:
        assert key in keys, (key, lines)
    assert len(lines) == len(set(lines))  # each line once


def test_rl_size_errors_do_not_stop_the_other_sections():
    lines = rl_errors(rl("train.micro_batch_size=0", "model.num_layers=0", "eval.num_prompts=0"))
    assert lines == [
        "model.num_layers: must be >= 1, got 0",
        "train.micro_batch_size: must be >= 1, got 0",
        "eval.num_prompts: must be >= 1, got 0",
    ]


MIPU = ["algorithm.mismatch.name=mipu"]


def test_mipu_clip_rules():
    validate_rl_config(rl(*MIPU), 2)
    validate_rl_config(rl(*MIPU, "algorithm.mismatch.clip_high=3"), 2)
    w_max = "algorithm.mismatch.clip_high: is MIPU's w_max"
    assert [line for line in rl_errors(rl(*MIPU, "algorithm.mismatch.clip_high=0")) if line.startswith(w_max)] == [
        f"{w_max}, the cap of its weight min(π_k/μ, w_max); it must be null (= 2) or > 0, got 0.0"
    ]
    assert any(line.startswith(w_max) for line in rl_errors(rl(*MIPU, "algorithm.mismatch.clip_high=-1")))
    assert rl_errors(rl(*MIPU, "algorithm.mismatch.clip_low=0.5")) == [
        "algorithm.mismatch.clip_low: is not used by MIPU (its only parameters are clip_high = w_max, level and mipu_*)"
    ]
    # other corrections keep their own rules: TIS may truncate at 0
    validate_rl_config(
        rl("algorithm.mismatch.name=tis", "algorithm.mismatch.clip_high=0", "algorithm.mismatch.clip_low=0"), 2
    )


@pytest.mark.parametrize(
    "override",
    [
        "train.precision=fp16",
        "train.recompute=some",
        "algorithm.loss_agg=mean",
        "algorithm.mismatch.level=batch",
        "algorithm.kl_estimator=k4",
        "eval.score=pass@k",
        "rollout.quantization=int4",
        "algorithm.mismatch.mipu_decision=strict",
    ],
)
def test_rl_literal_fields_list_their_values(override):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as e:
        rl(override)
    msg = str(e.value)
    assert f"'{key}' expects" in msg and "one of" in msg and value in msg


# ------------------------------------------------------------------- one engine-group config


def test_engine_groups_share_one_config_and_one_check(tmp_path):
    """Engine teachers, the explorer and the rollout engines are one `EngineGroupConfig` (the rollout
    under its own key names), so the same mistake gets the same message under each key; the cores
    of engines a teacher starts are checked as the rollout's always were."""
    from mcore_rl.config.rl_schema import EngineGroupConfig, RolloutConfig, TeacherConfig
    from mcore_rl.recipes.config.s2l_po import ExplorerConfig

    group = {f.name for f in dataclasses.fields(EngineGroupConfig)}
    assert issubclass(TeacherConfig, EngineGroupConfig) and issubclass(ExplorerConfig, EngineGroupConfig)
    assert set(RolloutConfig.ENGINE_KEYS) == group - {"model_path"}
    r = rl(
        "rollout.engine_urls=['http://a:1']", "rollout.num_embedded_engines=3", "rollout.request_timeout_s=9"
    ).rollout
    assert (r.engines.urls, r.engines.num_engines, r.engines.request_timeout_s) == (["http://a:1"], 3, 9.0)
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    teacher = f"teachers=[{{kind: engine, model_path: {ckpt}, {{}}}}]"
    explorer = [f"rollout.explorer.model_path={ckpt}", "algorithm.routing_replay=none"]
    for setting, rule in [
        ("engine_threads: 0", "must be null or >= 1, got 0"),
        ("request_timeout_s: 0", "must be > 0, got 0"),
        ("max_running_requests: 0", "must be >= 1, got 0"),
        ("engine_cores: [[100000]]", "cores [100000] do not exist"),
    ]:
        field, value = setting.split(": ")
        lines = rl_errors(rl(teacher.replace("{}", setting)), 1)
        assert any(line.startswith(f"teachers[0].{field}") and rule in line for line in lines), (setting, lines)
        lines = rl_errors(rl(*explorer, f"rollout.explorer.{field}={value}"), 1)
        assert any(line.startswith(f"rollout.explorer.{field}") and rule in line for line in lines), (setting, lines)
        rollout_key = "rollout." + RolloutConfig.ENGINE_KEYS[field]
        started = ["rollout.runtime=async"] if field == "engine_cores" else []
        lines = rl_errors(rl(*started, f"{rollout_key}={value}"), 1)
        assert any(line.startswith(rollout_key) and rule in line for line in lines), (setting, lines)
