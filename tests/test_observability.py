"""Observability (mcore_rl/observe/): what a run writes about itself, checked on one tiny RL run and
one tiny SFT run in one spawned gloo world — metrics.jsonl (and TensorBoard, W&B offline when
installed), per-phase timers, tokens/s and MFU per device from models/flops.py, time to first step
by phase, a torch.profiler trace and memory timeline of step 1, `mcore-rl plot` on the run dirs and
`tools/phase_breakdown.py` on the metrics — plus the errors (W&B missing, a run dir without
metrics, unknown plot keys) and `tools/gpu_check.sh` on CPU (every GPU row skipped, a failing row
reported in its own line).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from mcore_rl.config import ConfigError, RLConfig, SFTConfig, load_config, validate_rl_config, validate_sft_config
from tests.helpers import tiny
from tests.world import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_WANDB = importlib.util.find_spec("wandb") is not None
PHASES = ("generate", "reward", "logprobs", "train", "sync", "idle")


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _check_perf(record: dict, model, seq_length: int) -> None:
    from mcore_rl.models.flops import train_flops_per_token

    per_device = record["perf/tokens_per_s_per_device"]
    assert per_device > 0 and record["perf/train_tokens"] > 0
    assert record["perf/peak_measured"] == 1.0  # CPU: the peak is measured, not a datasheet figure
    expected = per_device * train_flops_per_token(model, seq_length) / record["perf/peak_flops_per_device"]
    assert record["perf/mfu"] == pytest.approx(expected, rel=1e-9) and 0 < record["perf/mfu"] < 1


def _check_ttfs(records: list[dict], phases: tuple[str, ...]) -> None:
    with_ttfs = [r for r in records if "ttfs/total_s" in r]
    assert len(with_ttfs) == 1, "time to first step is reported once, with the first step"
    first = with_ttfs[0]
    for phase in phases:
        assert first[f"ttfs/{phase}_s"] >= 0, phase
    parts = sum(v for k, v in first.items() if k.startswith("ttfs/") and k != "ttfs/total_s")
    assert parts == pytest.approx(first["ttfs/total_s"], rel=1e-6)


def _world(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.cli import main as cli
    from mcore_rl.runtime import run_rl
    from mcore_rl.train.sft import run_sft

    # 1. RL: two rollout steps of two optimizer steps; step 1 profiled; a checkpoint after each step
    rl = f"{tmp}/rl"
    cfg = tiny(
        f"run_dir={rl}",
        "train.num_steps=2",
        "eval.interval=0",
        "eval.at_start=false",
        "logging.profile_steps=[1]",
        f"checkpoint.save_dir={tmp}/ckpt",
        "checkpoint.save_interval=1",
        "init.sft_steps=2",
        f"logging.wandb={HAS_WANDB}",
    )
    run_rl(cfg)
    recs = _records(rl)
    closing = [r for r in recs if "time/step_s" in r]  # the record that closes each rollout step
    assert [r["rl_step"] for r in closing] == [1, 2]
    for r in closing:
        for phase in PHASES:
            assert r[f"time/{phase}_s"] >= 0, phase
        _check_perf(r, cfg.model, cfg.train.seq_length)
    assert "time/eval_s" not in closing[0] and closing[1]["time/eval_s"] > 0  # evaluated after the last step
    assert "time/checkpoint_s" not in closing[0] and closing[1]["time/checkpoint_s"] > 0  # the save after step 1
    _check_ttfs(
        recs,
        (
            "imports",
            "distributed_init",
            "model_build",
            "warm_start",
            "engine_start",
            "first_weight_sync",
            "first_rollout",
            "first_train_step",
        ),
    )
    trace = json.load(open(f"{rl}/profile/step_1.rank0.trace.json"))
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert os.listdir(f"{rl}/profile") == ["step_1.rank0.trace.json"]
    assert os.listdir(f"{rl}/tensorboard")
    if HAS_WANDB:
        assert os.listdir(f"{rl}/wandb")

    # 2. SFT: the same sinks, timers, MFU and time to first step (one process, a second run in it)
    sft_cfg = load_config(
        SFTConfig,
        None,
        [
            f"run_dir={tmp}/sft",
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.ffn_hidden_size=64",
            "train.seq_length=16",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            "train.train_iters=3",
            "train.eval_interval=0",
            "data.synthetic_num_examples=64",
            "logging.tensorboard=true",
            "logging.memory_snapshot_steps=[2]",
        ],
    )
    run_sft(sft_cfg)
    srecs = _records(f"{tmp}/sft")
    assert [r["step"] for r in srecs] == [1, 2, 3] and all(r["time/train_s"] > 0 for r in srecs)
    for r in srecs:
        _check_perf(r, sft_cfg.model, 16)
        assert r["perf/train_tokens"] == 2 * 16  # the global batch's packed rows
    _check_ttfs(srecs, ("distributed_init", "model_build", "data", "first_train_step"))  # a fresh clock: 2nd run
    assert os.listdir(f"{tmp}/sft/tensorboard")
    memory = json.load(open(f"{tmp}/sft/profile/step_2.rank0.memory.json"))  # [times, bytes per category]
    assert len(memory) == 2 and len(memory[0]) == len(memory[1]) > 0
    assert os.listdir(f"{tmp}/sft/profile") == ["step_2.rank0.memory.json"]  # no trace: not in profile_steps

    # 3. `mcore-rl plot`: one run, two side by side, chosen keys; a key no run logged is an error
    assert cli(["plot", rl]) == 0
    assert open(f"{rl}/plot.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    out = f"{tmp}/both.png"
    assert cli(["plot", rl, f"{tmp}/sft", "--keys", "time/*,perf/mfu,perf/tokens_per_s_per_device", "--out", out]) == 0
    assert os.path.getsize(out) > 10_000
    assert cli(["plot", rl, "--keys", "reward/mean,no/such_key"]) == 2
    # the breakdown tool reads the same names
    text = subprocess.run(
        [sys.executable, f"{ROOT}/tools/phase_breakdown.py", f"{rl}/metrics.jsonl", "--skip", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "| weight sync |" in text and "trainer idle" in text and "checkpoints: 1 saves" in text


def test_run_metrics_timers_mfu_ttfs_profile_and_plot(tmp_path, capsys):
    run_world(1, _world, str(tmp_path))


def test_plot_of_a_directory_without_metrics_names_it(tmp_path, capsys):
    from mcore_rl.cli import main

    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}: holds no metrics.jsonl" in err
    assert main(["plot", str(tmp_path / "absent")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.skipif(HAS_WANDB, reason="wandb is installed: the offline sink is tested in the run")
def test_wandb_without_the_package_fails_before_workers_naming_the_key():
    for validate, cfg in (
        (validate_rl_config, load_config(RLConfig, None, ["logging.wandb=true"])),
        (validate_sft_config, load_config(SFTConfig, None, ["logging.wandb=true"])),
    ):
        with pytest.raises(ConfigError, match=r"logging.wandb: is true but the `wandb` package is not installed"):
            validate(cfg, 1)
    from mcore_rl.observe.sinks import WandbSink

    with pytest.raises(ImportError, match=r"logging.wandb=true needs the `wandb` package"):
        WandbSink("/nonexistent", "p", "", "offline")


def test_bad_profile_steps_are_named():
    with pytest.raises(ConfigError, match=r"logging.profile_steps: optimizer steps count from 1; got \[0\]"):
        validate_rl_config(tiny("logging.profile_steps=[0]"), 1)
    with pytest.raises(ConfigError, match="logging.peak_flops_per_device: must be >= 0"):
        validate_rl_config(tiny("logging.peak_flops_per_device=-1"), 1)


def test_gpu_check_on_cpu_skips_every_gpu_row_and_a_failing_row_reports_its_error(tmp_path):
    out = subprocess.run(
        ["bash", f"{ROOT}/tools/gpu_check.sh", "--no-install"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [
        line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith(("| check", "| ---"))
    ]
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert len(rows) == len(gpu_check.ROWS) and all("skipped: no CUDA device" in line for line in rows), out.stdout

    def broken(ctx):
        raise RuntimeError("boom")

    rows = [
        gpu_check.Row("broken", broken, needs_cuda=False),
        gpu_check.Row("fine", lambda ctx: "ok", needs_cuda=False),
    ]
    results = gpu_check.run_rows(rows, gpu_check.Context(str(tmp_path), 60, cuda=False))
    assert results[0][1].startswith("error: RuntimeError: boom") and results[1][1].startswith("ok")


def test_gpu_check_tiny_checkpoint_loads_with_autotokenizer_and_the_embedded_engine(tmp_path):
    """The SGLang row's checkpoint: SGLang reads the tokenizer with `AutoTokenizer`, so it must be a
    stock `tokenizer.json` (it once was the project's own byte-tokenizer file, which it cannot parse)."""
    from transformers import AutoTokenizer

    from mcore_rl.rollout.engine.core import EngineCore

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    gpu_check._tiny_checkpoint(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.encode("def f(x): return 'é'", add_special_tokens=False)
    assert tok.decode(ids) == "def f(x): return 'é'" and max(ids) < 1024
    assert tok.eos_token_id is not None and tok.eos_token_id < 1024
    engine = EngineCore.from_model_path(str(tmp_path))
    assert engine is not None
