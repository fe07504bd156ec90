"""The README's real-model path as a newcomer runs it: `tools/fetch_smollm2.py` ends by naming the
training recipe, a checkpoint loads without the libraries' deprecation warnings, and in
`tools/eval_heldout.py` overrides may follow `--seeds` and each evaluation pass shows a progress bar
(a real model's took 16 minutes without a line of output)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "eval_heldout.py")
FETCH = os.path.join(ROOT, "tools", "fetch_smollm2.py")
SFT_DEMO = os.path.join(ROOT, "configs", "sft_demo.yaml")
DEMO = os.path.join(ROOT, "configs", "demo.yaml")


def _tool():
    spec = importlib.util.spec_from_file_location("eval_heldout", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overrides_may_follow_the_seeds_and_the_models():
    tool = _tool()
    args = tool.parse_args(
        [
            DEMO,
            "--models",
            "base=a",
            "rl=b",
            "eval.num_prompts=8",
            "--k",
            "2",
            "--seeds",
            "1",
            "2",
            "rollout.quantization=none",
            "run_dir=x",
        ]
    )
    assert args.models == ["base=a", "rl=b"] and args.seeds == [1, 2] and args.k == 2
    assert args.overrides == ["eval.num_prompts=8", "rollout.quantization=none", "run_dir=x"]
    args = tool.parse_args([DEMO, "eval.k=0", "--models", "base=a"])  # before the flags, as before
    assert args.overrides == ["eval.k=0"] and args.models == ["base=a"]
    with pytest.raises(SystemExit):
        tool.parse_args([DEMO, "--models", "base"])  # no name=dir


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """An HF-format directory of a 2-layer model with the demo's vocabulary."""
    from tests.helpers import save_tiny_hf_model

    return save_tiny_hf_model(str(tmp_path_factory.mktemp("hf_model")), max_position_embeddings=64)


def test_each_pass_shows_progress_and_the_table_is_printed(tiny_hf_model, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            TOOL,
            DEMO,
            "eval.num_prompts=6",
            "rollout.quantization=none",
            "init.sft_steps=0",
            "reward.name=tests.reward_fns:digit_count",
            "reward.max_concurrency=1",
            "--models",
            f"base={tiny_hf_model}",
            f"other={tiny_hf_model}",
            "--k",
            "2",
            "--seeds",
            "1",
        ],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT, MCORE_RL_PROGRESS="1"),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for desc, total in [("base greedy", 6), ("base avg@2 seed 1", 12), ("other greedy", 6)]:
        assert f"{desc}: 100%" in run.stderr and f"{total}/{total}" in run.stderr, (desc, run.stderr[-3000:])
    assert "base: loading" in run.stdout  # log_line: between the bars
    assert "| addition_lsd |" in run.stdout and "other - base (95% CI)" in run.stdout, run.stdout  # the demo's task


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, MCORE_RL_PROGRESS="0")


def test_fetch_smollm2_ends_with_the_training_recipe(tmp_path):
    """The conversions of a (tiny, local) GGUF in place of the downloaded one: the last line names
    the RL recipe, and the converter's generic `mcore-rl sft` hint is not shown."""
    pytest.importorskip("gguf")
    from tests.helpers import tiny_llama, write_gguf

    out = tmp_path / "smollm2"
    (out / "gguf").mkdir(parents=True)
    write_gguf(tiny_llama(), str(out / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    run = subprocess.run(
        [sys.executable, FETCH, "--out", str(out)],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "mcore" / "recipe.yaml").exists()
    last = run.stdout.rstrip().splitlines()[-1]
    assert "mcore-rl train configs/smollm2_reasoning.yaml" in last and f"init.checkpoint={out}/mcore" in last, last
    assert "mcore-rl sft" not in run.stdout, run.stdout
    assert "deprecat" not in run.stderr.lower(), run.stderr


def test_a_checkpoint_loads_without_the_libraries_deprecation_warnings(tmp_path):
    """`mcore-rl sft` saves, then resumes: megatron-core and torch.distributed.checkpoint warned four
    times about their own calls (load_state_dict, ShardedTensor x2, the cuda-graph scope)."""
    common = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "sft",
        SFT_DEMO,
        "train.eval_interval=0",
        "logging.tensorboard=false",
    ]
    run = subprocess.run(
        [*common, "train.train_iters=1", f"checkpoint.save_dir={tmp_path}/ckpt", f"run_dir={tmp_path}/a"],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    run = subprocess.run(
        [*common, "train.train_iters=2", f"checkpoint.load_dir={tmp_path}/ckpt", f"run_dir={tmp_path}/b"],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from" in run.stdout + run.stderr
    assert "Warning" not in run.stderr, run.stderr
