"""The launch scripts: they parse, and torchrun.sh explains itself and rejects bad input before
starting torchrun. (The real launch is exercised by hand / in the bench: it spawns a 2-rank world.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN_SH = os.path.join(REPO, "launch", "torchrun.sh")
SBATCH = os.path.join(REPO, "launch", "slurm.sbatch")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(PYTHON=sys.executable, **env)
    return subprocess.run(["bash", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", [TORCHRUN_SH, SBATCH])
def test_scripts_parse(script):
    proc = _run("-n", script)
    assert proc.returncode == 0, proc.stderr


def test_torchrun_usage_without_args():
    proc = _run(TORCHRUN_SH)
    assert proc.returncode == 2
    assert proc.stdout == ""
    usage = proc.stderr
    assert usage.startswith("usage:")
    for word in ("RECIPE.yaml", "NNODES", "NODE_RANK", "NPROC", "MASTER_ADDR", "MASTER_PORT",
                 "--rdzv-backend c10d", "-m mcore_rl.cli sft"):
        assert word in usage, word


def test_torchrun_help_goes_to_stdout():
    proc = _run(TORCHRUN_SH, "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage:")


def test_torchrun_rejects_bad_input_before_launching():
    recipe = "configs/sft_demo.yaml"
    proc = _run(TORCHRUN_SH, "configs/missing.yaml")
    assert proc.returncode == 2 and "recipe not found" in proc.stderr
    proc = _run(TORCHRUN_SH, recipe, NNODES="2", NODE_RANK="2")
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr
    proc = _run(TORCHRUN_SH, recipe, NPROC="two")
    assert proc.returncode == 2 and "NPROC" in proc.stderr
    # The config is checked for world size NNODES * NPROC = 2 (TP=4 does not fit), naming the key.
    proc = _run(TORCHRUN_SH, recipe, "parallel.tensor_model_parallel_size=4", NPROC="2")
    assert proc.returncode == 2
    assert "world size 2" in proc.stderr and "parallel.tensor_model_parallel_size" in proc.stderr
    assert "torchrun.sh: node" not in proc.stderr  # torchrun never started


def test_sbatch_rendezvous_on_first_node():
    text = open(SBATCH).read()
    assert "scontrol show hostnames" in text
    assert "--ntasks-per-node=1" in text
    assert "launch/torchrun.sh" in text
