"""The RL demo (`configs/demo.yaml`) for a few steps with its rollouts from a vLLM engine process.

Skipped without the vLLM venv (`bash tools/setup_vllm.sh`; CI creates it and runs this tier).
vLLM on CPU needs a head dim of 32 or more (`model.kv_channels=32`), fp32 or bf16 weights, and the
disk weight transport. In fp32 the engine's log-probs μ equal the trainer's π_old to rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.config.rl_vllm import vllm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    not os.path.isfile(vllm_python()),
    reason=f"no vLLM venv at {os.path.dirname(os.path.dirname(vllm_python()))} (bash tools/setup_vllm.sh)",
)
VLLM_DEMO = [
    "rollout.engine_kind=vllm",
    "rollout.quantization=none",
    "model.kv_channels=32",
    "rollout.sync_transport=disk",
]


def test_rl_demo_trains_with_vllm_engines(tmp_path: str) -> None:
    run_dir = os.path.join(tmp_path, "run")
    argv = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        os.path.join(ROOT, "configs", "demo.yaml"),
        *VLLM_DEMO,
        f"rollout.sync_dir={os.path.join(tmp_path, 'weights')}",
        f"run_dir={run_dir}",
        "train.num_steps=2",
        "init.sft_steps=0",
        "eval.at_start=false",
        "eval.interval=0",
        "eval.num_prompts=8",
        "eval.k=1",
    ]
    env = {**os.environ, "MCORE_RL_PROGRESS": "0"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "mismatch/abs_logp_diff" in m]
    assert [m["rl_step"] for m in steps][-1] == 2
    for m in steps:
        assert m["mismatch/abs_logp_diff"] < 1e-4  # vLLM fp32 vs the trainer's fp32 log-probs of the same tokens
        assert m["rollout/policy_version_min"] == m["rl_step"]  # each step sampled from the weights synced to vLLM
    assert not processes_naming(run_dir), "a vLLM process outlived the run"


def processes_naming(path: str) -> list[int]:
    """Pids whose command line names `path` (the engines' model directory is under the run's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if path.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found
