"""`mcore-rl profile`: layouts agree with the trainer's validation, memory/time estimates behave, and
`--measure` on the demo model matches the real tensors exactly (activations within 25%)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import yaml

from mcore_rl.config import ConfigError, validate_sft_config
from mcore_rl.config.schema import ModelConfig
from mcore_rl.profile.cluster import PRESETS, load_cluster
from mcore_rl.profile.layouts import (
    Layout,
    TrainShape,
    candidate_layouts,
    enumerate_layouts,
    parse_layout,
    sft_config_for,
)
from mcore_rl.profile.memory import activations, model_state, param_tensors
from mcore_rl.profile.timing import step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
MOE = ModelConfig.of(
    arch="qwen3_moe",
    vocab_size=1024,
    hidden_size=256,
    ffn_hidden_size=512,
    num_layers=8,
    num_attention_heads=8,
    num_query_groups=4,
    num_experts=8,
    moe_router_topk=2,
    max_position_embeddings=4096,
)
SHAPE = TrainShape(global_batch_size=64, micro_batch_size=1, seq_length=1024)


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "profile", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=ROOT, MCORE_RL_PROGRESS="0"),
    )


def test_enumeration_is_the_trainers_validation():
    layouts = enumerate_layouts(MOE, 16, 8, SHAPE, has_transformer_engine=True)
    assert layouts and any(lay.ep > 1 for lay in layouts) and any(lay.vpp for lay in layouts)
    for lay in layouts:  # every enumerated layout is one `mcore-rl sft` accepts (CP checked as on a TE machine)
        cfg = sft_config_for(MOE, lay, SHAPE)
        if lay.cp == 1:
            validate_sft_config(cfg, lay.world_size)
    rejected = [lay for lay in candidate_layouts(MOE, 16, 8) if lay not in set(layouts) and lay.cp == 1]
    assert rejected
    for lay in rejected[:: max(1, len(rejected) // 25)]:
        with pytest.raises(ConfigError):
            validate_sft_config(sft_config_for(MOE, lay, SHAPE), lay.world_size)


def test_memory_and_time_move_the_right_way():
    base = Layout(tp=1, pp=1, dp=16)
    s = model_state(MOE, base, SHAPE)
    tp2 = model_state(MOE, Layout(tp=2, dp=8, sp=True), SHAPE)
    ep8 = model_state(MOE, Layout(ep=8, dp=16), SHAPE)
    assert tp2.params < s.params and ep8.params < s.params
    dist = model_state(MOE, base, dataclasses.replace(SHAPE, distributed_optimizer=True))
    assert dist.optimizer < s.optimizer / 8 and dist.grads == s.grads
    acts = {r: activations(MOE, base, SHAPE, 4, "flash", r).total for r in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"]
    longer = activations(MOE, base, dataclasses.replace(SHAPE, seq_length=2048), 4).total
    assert longer > 1.9 * activations(MOE, base, SHAPE, 4).total
    cluster = load_cluster("h100_sxm", {"nodes": 2})
    pp = Layout(pp=2, dp=8)
    t = step_time(MOE, pp, SHAPE, cluster, 8)
    t_vpp = step_time(MOE, dataclasses.replace(pp, vpp=2), SHAPE, cluster, 8)
    assert t.bubble_fraction == pytest.approx(1 / 8) and t_vpp.bubble_fraction == pytest.approx(1 / 16)
    assert step_time(
        MOE, base, dataclasses.replace(SHAPE, global_batch_size=128), cluster, 8
    ).compute_s == pytest.approx(2 * step_time(MOE, base, SHAPE, cluster, 4).compute_s)
    # the embedding lives on the first stage, the output layer on the last
    names0 = {p.name for p in param_tensors(MOE, pp, 0)}
    names1 = {p.name for p in param_tensors(MOE, pp, 1)}
    assert "embedding.word_embeddings.weight" in names0 - names1 and "output_layer.weight" in names1 - names0


def _main(capsys, *args: str) -> tuple[int, str]:
    from mcore_rl import cli

    code = cli.main(["profile", *args])
    return code, capsys.readouterr().err


def test_bad_inputs_name_the_key(tmp_path, capsys):
    bad = dict(PRESETS["h100_sxm"], gpu_memory_gb=-1)
    del bad["peak_tflops_bf16"]
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="gpu_memory_gb: must be > 0") as err:
        load_cluster(str(path))
    assert "peak_tflops_bf16: missing" in str(err.value)
    with pytest.raises(ConfigError, match="--layout"):
        parse_layout("tp=3", 8)
    code, err = _main(
        capsys, DEMO, "--cluster", "cpu_here", "--layout", "tp=4", "--seq-length", "64", "--global-batch", "8"
    )
    assert code == 2 and "model.num_query_groups" in err, err
    code, err = _main(capsys, DEMO, "model.num_query_groups=3", "--cluster", "cpu_here", "--seq-length", "64")
    assert code == 2 and "model.num_query_groups" in err, err
    code, err = _main(capsys, DEMO, "--cluster", str(path))
    assert code == 2 and "peak_tflops_bf16: missing" in err, err
    # a vocabulary that does not split over TP is padded (model.make_vocab_size_divisible_by), as built
    odd = dataclasses.replace(MOE, vocab_size=385)
    validate_sft_config(sft_config_for(odd, Layout(tp=2, sp=True), SHAPE), 2)
    embedding = next(
        t for t in param_tensors(odd, Layout(tp=2, sp=True)) if t.name == "embedding.word_embeddings.weight"
    )
    assert embedding.numel == 386 // 2 * odd.hidden_size


def test_hf_config_input_and_json(tmp_path, capsys):
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
    ).save_pretrained(tmp_path / "hf")
    out = tmp_path / "p.json"
    code, err = _main(
        capsys,
        str(tmp_path / "hf" / "config.json"),
        "--cluster",
        "h100_sxm",
        "--nodes",
        "1",
        "--seq-length",
        "1024",
        "--global-batch",
        "32",
        "--json",
        str(out),
    )
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["model"]["num_layers"] == 4 and result["num_valid_layouts"] == len(result["layouts"]) > 1
    first = result["layouts"][0]
    assert first["fits"] and first["time"]["total_s"] == min(
        r["time"]["total_s"] for r in result["layouts"] if r["fits"]
    )
    assert set(first["memory"]) >= {"params", "grads", "optimizer", "optimizer_distributed", "activations", "total"}


def test_a_recipe_is_profiled_with_its_own_shape_and_json_goes_to_stdout():
    """`mcore-rl profile configs/demo.yaml` with no shape flags estimates the recipe's own rows (a fixed
    4096-token default exceeded the demo's 256 positions); `--json -` prints only the JSON; a flag
    still wins over the recipe."""
    run = _cli(DEMO, "--top", "2")
    assert run.returncode == 0, run.stderr
    assert "global batch 64 x 64 tokens, micro-batch 8, fp32" in run.stdout  # 16 prompts x 8 / 2 minibatches
    run = _cli(DEMO, "--json", "-", "--seq-length", "128")
    assert run.returncode == 0, run.stderr
    shape = json.loads(run.stdout)["shape"]
    assert (shape["global_batch_size"], shape["micro_batch_size"], shape["seq_length"]) == (64, 8, 128)
    sft = _cli(os.path.join(ROOT, "configs", "sft_demo.yaml"), "--json", "-")
    assert sft.returncode == 0 and json.loads(sft.stdout)["shape"]["seq_length"] == 64, sft.stderr
    # a model-only recipe sets no training shape: the long-context default, not the schema's 8 x 64
    big = _cli(os.path.join(ROOT, "configs", "profile_llama3_70b.yaml"), "--json", "-", "--nodes", "8")
    shape = json.loads(big.stdout)["shape"]
    assert (shape["global_batch_size"], shape["seq_length"], shape["precision"]) == (256, 4096, "bf16"), shape


def test_measure_demo_matches_real_tensors(tmp_path):
    """One world of 2 ranks runs the top 3 layouts (dp2, tp2, pp2) of the demo model."""
    report = tmp_path / "profile.json"
    out = _cli(
        DEMO,
        "--cluster",
        "cpu_here",
        "--gpus-per-node",
        "2",
        "--global-batch",
        "8",
        "--micro-batch",
        "2",
        "--seq-length",
        "64",
        "--precision",
        "fp32",
        "--measure",
        "--measure-top",
        "3",
        "--measure-steps",
        "1",
        "--json",
        str(report),
        "--rollout-prompts",
        "4",
        "--samples-per-prompt",
        "2",
        "--prompt-length",
        "16",
        "--response-length",
        "32",
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["schema_version"] == 1 and result["cpu_calibration_flops"]["fp32"] > 0
    assert {"layout", "memory", "time", "fits", "mfu"} <= set(result["layouts"][0])
    assert result["rl_split"] and result["rl_split"][0]["train_gpus"] + result["rl_split"][0]["inference_gpus"] == 2
    measured = result["measured"]
    assert {m["layout"] for m in measured} == {"tp1-pp1-dp2", "tp2-pp1-dp1-sp", "tp1-pp2-dp1"}
    for m in measured:
        assert m["step_time_ratio"] > 0
        for st in m["stages"]:
            assert st["model_state_exact"], st
            assert 0.75 <= st["activation_ratio"] <= 1.25, (m["layout"], st)
    assert "measured on this machine vs estimated" in out.stdout


def _family_configs() -> dict[str, ModelConfig]:
    from tests.test_deepseek_v3 import DSV3, DSV3_FULL_Q
    from tests.test_gpt_oss import GPT_OSS

    return {"deepseek_v3": DSV3, "deepseek_v3_full_q": DSV3_FULL_Q, "gpt_oss": GPT_OSS}


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_full_q", "gpt_oss"])
def test_the_profiler_counts_latent_attention_sinks_and_biases(name):
    """`param_tensors` holds the reference model's parameters (= megatron's, which it exports bit for
    bit): MLA's low-rank projections and latent norms, GPT-OSS's sinks and biases. Per TP rank, the
    2-rank worlds of test_deepseek_v3.py / test_gpt_oss.py compare it with the built model."""
    import torch

    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    mc = _family_configs()[name]
    with torch.device("meta"):
        model = McoreRLForCausalLM(hf_config_from_model_config(mc))
    counted = sum(t.numel * t.count for t in param_tensors(mc, Layout()))
    assert counted == sum(p.numel() for p in model.parameters())


def test_deepseek_v3_671b_is_671b():
    """`configs/profile_deepseek_v3_671b.yaml` (the released config.json's shape) is a valid model of
    671.0B parameters, 37.6B active per token (DeepSeek's report: 671B, 37B activated; the MTP
    module's 14B more are carried through conversion, not trained, so not counted)."""
    from mcore_rl.config.model_keys.moe import MoEKeys
    from mcore_rl.config.rules import Errors, check_model
    from mcore_rl.convert.to_hf import model_config_from_dict

    with open(os.path.join(ROOT, "configs", "profile_deepseek_v3_671b.yaml")) as f:
        mc = model_config_from_dict(yaml.safe_load(f)["model"])
    errors = Errors()
    check_model(mc, errors)
    assert not errors.lines, errors.lines
    tensors = param_tensors(mc, Layout())
    total = sum(t.numel * t.count for t in tensors)
    experts = sum(t.numel * t.count for t in tensors if t.expert)
    moe = mc.section(MoEKeys)
    active = total - experts + experts * moe.moe_router_topk // moe.num_experts
    assert round(total / 1e9, 1) == 671.0 and round(active / 1e9, 1) == 37.6
