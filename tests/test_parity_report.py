"""`mcore-rl parity`: the engine-vs-trainer report, run as a user runs it (a real process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from mcore_rl.runtime.parity import position_bins, routing_disagreement, token_mismatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_token_mismatch_and_bins() -> None:
    m = token_mismatch([0.0, -1.0, -2.0], [0.0, -1.5, -1.0])
    d = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    assert m["mean_abs"] == pytest.approx(0.5)
    assert m["max_abs"] == pytest.approx(1.0)
    assert m["k3"] == pytest.approx(float((d.exp() - d - 1).mean()))
    bins = position_bins([[0.0, -1.0, -2.0], [0.0]], [[0.0, -1.5, -1.0], [-0.25]], width=2)
    assert [(b.start, b.end, b.tokens) for b in bins] == [(0, 2, 3), (2, 3, 1)]
    assert bins[0].mean_abs == pytest.approx((0 + 0.5 + 0.25) / 3)
    assert bins[1].mean_abs == pytest.approx(1.0)
    assert math.isnan(token_mismatch([], [])["k3"])


def test_routing_disagreement_compares_sets() -> None:
    a = torch.tensor([[0, 1], [2, 3], [4, 5]])
    b = torch.tensor([[1, 0], [2, 4], [4, 5]])  # same set in another order, one flip, same
    assert routing_disagreement(a, b) == pytest.approx(1 / 3)


def _parity(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_rl.cli",
            "parity",
            "configs/demo_moe.yaml",
            f"run_dir={tmp_path}/run",
            "init.sft_steps=0",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_parity_command_moe(tmp_path) -> None:
    out = tmp_path / "parity.json"
    proc = _parity(
        tmp_path,
        "--precisions",
        "none",
        "fp8",
        "--prompts",
        "3",
        "--samples",
        "2",
        "--position-bins",
        "2",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "routing" in proc.stdout and "fp8" in proc.stdout
    report = json.loads(out.read_text())
    fp32, fp8 = report["engines"]
    assert (fp32["engine"], fp8["engine"]) == ("fp32", "fp8")
    assert fp32["tokens"] == fp8["tokens"] > 0
    assert sum(b["tokens"] for b in fp32["by_position"]) == fp32["tokens"]
    # same weights, same precision: the reference engine and megatron-core agree to float rounding,
    # the engine's scoring equals its sampling-time log-probs, and every token routes the same way
    assert fp32["max_abs"] < 1e-5
    assert fp32["scoring_vs_sampling"] < 1e-5
    assert max(fp32["layer_rel_diff"]) < 1e-5
    assert fp32["routing_disagreement"] == [0.0, 0.0]
    # FP8 weights and activations: visibly different log-probs and hidden states
    assert fp8["mean_abs"] > 100 * max(fp32["mean_abs"], 1e-9)
    assert min(fp8["layer_rel_diff"]) > 1e-4
    assert all(0.0 <= x <= 1.0 for x in fp8["routing_disagreement"])
    # R3: replaying the fp32 engine's own experts changes nothing; both K3s are defined for FP8
    assert fp32["r3_mean_abs"] < 1e-5
    assert fp8["r3_k3"] >= 0.0 and math.isfinite(fp8["r3_k3"])
    # demo_moe samples with top-p 0.9: against the distribution the fp32 engine drew from, the trainer
    # over the same support agrees to rounding; over the full vocabulary it does not (the kept mass)
    rows = {b["trainer"]: b for b in report["behaviour"]}
    assert set(rows) == {"full vocabulary", "R3", "sampling mask", "R3 + sampling mask"}
    assert rows["sampling mask"]["max_abs"] < 1e-5 and rows["R3 + sampling mask"]["max_abs"] < 1e-5
    assert rows["full vocabulary"]["mean_abs"] > 1e-3


def test_parity_bad_precision_fails_before_building(tmp_path) -> None:
    proc = _parity(tmp_path, "--precisions", "fp16")
    assert proc.returncode == 2
    assert "--precisions: 'fp16' is not one of" in proc.stderr


def test_parity_against_an_engine_url(tmp_path) -> None:
    """`--engine-url`: a `mcore-rl serve` process (FP8, MoE), weights pushed over HTTP as a training
    run does; it scores the fp32 engine's tokens over SGLang's wire format, routed experts included."""
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.rollout.engine_processes import EngineProcesses

    mc = load_config(RLConfig, os.path.join(ROOT, "configs/demo_moe.yaml"), []).model
    engines = EngineProcesses.start(
        mc, num=1, workdir=str(tmp_path / "engine"), quantization="fp8", context_length=256, threads=1
    )
    try:
        url = engines.urls[0]
        out = tmp_path / "parity.json"
        proc = _parity(
            tmp_path,
            "--precisions",
            "none",
            "--engine-url",
            url,
            "--prompts",
            "2",
            "--samples",
            "2",
            "--json",
            str(out),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        fp32, remote = json.loads(out.read_text())["engines"]
        assert remote["engine"] == url and remote["tokens"] == fp32["tokens"] > 0
        assert fp32["max_abs"] < 1e-5 < remote["mean_abs"]  # the served engine is FP8
        assert remote["r3_k3"] is not None and math.isfinite(remote["r3_k3"])
        assert remote["layer_rel_diff"] is None  # no debug forward over HTTP
    finally:
        engines.close()
