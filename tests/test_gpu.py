"""The GPU-only checks of `tools/gpu_check.py` as tests: each runs one row of the prepared check and
asserts what the row can only show on CUDA. Marked `gpu`: without CUDA they are skipped
(tests/conftest.py), and `tools/gpu_check.sh` still prints the same rows as one table.

The bounds are loose on purpose — no row has run on a GPU yet — and say what would be a bug, not
what is expected: an fp32 transformer-engine model that does not match the reference, an MFU of 0,
an FP8 engine whose mismatch is not small. Tighten them once the first GPU run has given figures.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def _gpu_check() -> ModuleType:
    """tools/gpu_check.py as a module (tools/ is not a package), loaded once: a second copy's `Skip`
    would be another class, and `_row` would not catch a row's skip."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _row(tmp_path: Path, run: Callable[..., str], timeout_s: int = 300) -> str:
    """One row's result string; a row that cannot run here skips the test with its reason."""
    gc = _gpu_check()
    ctx = gc.Context(str(tmp_path), timeout_s, cuda=torch.cuda.is_available())
    cwd = os.getcwd()
    os.chdir(ROOT)  # rows run the repository's configs and scripts by relative path
    try:
        return run(ctx)
    except gc.Skip as why:
        pytest.skip(str(why))
    finally:
        os.chdir(cwd)


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in {text!r}"
    return float(m.group(1).replace(",", ""))


@pytest.mark.parametrize("model", ["dense", "gpt_oss"])
@pytest.mark.parametrize("precision, bound", [("fp32", 1e-3), ("bf16", 0.25)])
def test_transformer_engine_spec_matches_the_reference_model(tmp_path, precision, bound, model):
    """The TE spec at TP=1 against the pure-torch reference on the same weights: max |Δlogit| as a
    fraction of the logits' std (fp32: numerics only; bf16: rounding). GPT-OSS: TE's sink kernels
    (transformer-engine >= 2.8, skipped below), windowed and full layers, biases, clamped SwiGLU."""
    out = _row(tmp_path, _gpu_check().te_parity(precision, model))
    diff = _number(r"max \|Δlogit\| ([0-9.e+-]+)", out)
    std = _number(r"logits' std ([0-9.e+-]+)", out)
    assert diff <= bound * max(std, 1.0), out


@pytest.mark.parametrize("model", ["dense_1b", "moe"])
def test_bf16_training_step_reports_throughput_and_mfu(tmp_path, model):
    gc = _gpu_check()
    shape = gc.DENSE_1B if model == "dense_1b" else gc.SMALL_MOE
    out = _row(tmp_path, gc.train_step(shape, model), timeout_s=400)
    assert _number(r"([0-9,.]+) tokens/s per device", out) > 0, out
    assert 0 < _number(r"MFU ([0-9.]+)%", out) <= 100, out


def test_nccl_weight_sync_against_a_raw_broadcast(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: NCCL puts no two ranks of one group on one device")
    out = _row(tmp_path, _gpu_check().nccl_weight_sync)
    assert "broadcast" in out, out


def test_fp8_engine_mismatch_is_small_and_the_unquantised_engine_matches(tmp_path):
    out = _row(tmp_path, _gpu_check().fp8_mismatch, timeout_s=400)
    k3 = {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+): K3 ([0-9.e+-]+)", out)}
    assert set(k3) >= {"fp32", "fp8"}, out  # engine names: runtime/parity.py PRECISION_NAMES
    assert k3["fp32"] < 1e-3 and k3["fp8"] < 5e-2, out


@pytest.mark.parametrize("runtime", ["sync", "async"])
def test_the_rl_demo_runs_on_the_gpu(tmp_path, runtime):
    out = _row(tmp_path, _gpu_check().rl_demo(runtime), timeout_s=400)
    before, after = _number(r"avg@4 ([0-9.]+)%", out), _number(r"-> ([0-9.]+)%", out)
    assert after > before, out


def test_sglang_and_the_embedded_engine_agree_on_greedy_tokens(tmp_path):
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    out = _row(tmp_path, _gpu_check().sglang_vs_embedded, timeout_s=400)
    agree = _number(r"greedy tokens agree for (\d+)/", out)
    assert agree >= 8, out  # bf16 on two engines: the first tokens must agree
