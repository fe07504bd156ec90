"""The learner SIGKILLed and resumed from its last checkpoint, as a user would: `mcore-rl train` in
a subprocess, killed with SIGKILL once its step-2 checkpoint exists, then started again with
`checkpoint.load_dir`.

- `max_staleness: 0`: the resumed run's steps 3 and 4 have the numbers of an uninterrupted run
  with the same seed (same samples; losses to float noise of the engine's batching).
- `max_staleness: 1`: what was buffered or in flight at the checkpoint is restored or sent again,
  so `accounting.json` balances (drawn = trained + filtered + dropped + failed + pending) with
  every step's batch trained exactly once. The samples regenerated after the resume come from the
  resumed weights at another time, so they are not the uninterrupted run's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.test_async_runtime import SMALL
from tests.test_engine_faults import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp: str, name: str, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "mcore_rl.cli", "train", *SMALL, "train.num_steps=4", f"run_dir={tmp}/{name}",
            "checkpoint.save_interval=1", *overrides]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:  # timed out: leave no trainer behind
            p.kill()
            p.communicate()
    assert p.returncode == 0, out[-3000:]
    return out


def _kill_after_checkpoint(p: subprocess.Popen, save_dir: str, iteration: int, timeout: float = 300) -> None:
    latest = os.path.join(save_dir, "latest")
    end = time.monotonic() + timeout
    while True:
        if p.poll() is not None or time.monotonic() > end:
            p.kill()
            out, _ = p.communicate()
            raise AssertionError(f"no step-{iteration} checkpoint while the run was alive:\n{out[-3000:]}")
        if os.path.exists(latest) and open(latest).read().strip().endswith(f"{iteration:07d}"):
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=30)


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_sigkilled_learner_resumes_without_losing_or_repeating_a_sample(tmp_path):
    tmp = str(tmp_path)
    engine = Engine(delay=0.005)
    try:
        url = f"rollout.engine_urls=[{engine.url}]"
        s0 = [url, "rollout.runtime=async", "rollout.max_staleness=0"]
        uninterrupted = _train(tmp, "a", *s0, f"checkpoint.save_dir={tmp}/ckpt_a")
        _finish(uninterrupted)
        killed = _train(tmp, "b", *s0, f"checkpoint.save_dir={tmp}/ckpt_b")
        _kill_after_checkpoint(killed, f"{tmp}/ckpt_b", 2)
        _finish(_train(tmp, "b", *s0, f"checkpoint.save_dir={tmp}/ckpt_b", f"checkpoint.load_dir={tmp}/ckpt_b"))
        a, b = _records(f"{tmp}/a"), _records(f"{tmp}/b")
        assert [r["step"] for r in a] == [r["step"] for r in b]  # each step once, records after the checkpoint dropped
        for x, y in zip(a, b):
            if x["rl_step"] <= 2:
                continue
            for key in ("reward/mean", "response/length_mean", "rollout/policy_version_min"):
                assert x[key] == y[key], (x["rl_step"], key)
            assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-4, abs=1e-7)
        acc = json.load(open(f"{tmp}/b/accounting.json"))
        assert acc["balanced"] and acc["trained"] == 4 * 4 and acc["drawn"] == 16 and acc["pending"] == 0

        # staleness 1: killed with a batch generated ahead (in flight or buffered)
        s1 = [url, "rollout.runtime=async", "rollout.max_staleness=1", "rollout.max_new_tokens=24"]
        killed = _train(tmp, "c", *s1, f"checkpoint.save_dir={tmp}/ckpt_c")
        _kill_after_checkpoint(killed, f"{tmp}/ckpt_c", 2)
        _finish(_train(tmp, "c", *s1, f"checkpoint.save_dir={tmp}/ckpt_c", f"checkpoint.load_dir={tmp}/ckpt_c"))
        acc = json.load(open(f"{tmp}/c/accounting.json"))
        assert acc["balanced"] and acc["trained"] == 16 and acc["failed"] == 0
        assert acc["drawn"] == 16 + acc["dropped_stale"] + acc["pending"]
        assert acc["resent_after_resume"] + acc["restored_buffered"] > 0  # step 3's batch was ahead at the kill
        c = _records(f"{tmp}/c")
        assert [r["rl_step"] for r in c if "time/step_s" in r] == [1, 2, 3, 4]
    finally:
        engine.close()
