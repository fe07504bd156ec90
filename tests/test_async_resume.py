"""The learner SIGKILLed and resumed from its last checkpoint, as a user would: `mcore-rl train` in
a subprocess, killed with SIGKILL once its step-2 checkpoint exists, then started again with
`checkpoint.load_dir`.

- `max_staleness: 0`: the resumed run's steps 3 and 4 have the numbers of an uninterrupted run
  with the same seed (same samples; losses to float noise of the engine's batching).
- `max_staleness: 1`: what was buffered or in flight at the checkpoint is restored or sent again,
  so `accounting.json` balances (drawn = trained + filtered + dropped + failed + pending) with
  every step's batch trained exactly once. The samples regenerated after the resume come from the
  resumed weights at another time, so they are not the uninterrupted run's tokens.
- in both, `provenance.jsonl` (the prompts each step trained) shows from the run directory alone
  that no prompt was trained twice or lost across the kill (`check_provenance`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.runtime.accounting import (
    check_provenance,
    compact_ids,
    expand_ids,
    record_trained_prompts,
    trained_by_step,
)
from tests.helpers import SMALL
from tests.helpers import _finish, _kill_after_checkpoint
from tests.helpers import Engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train(tmp: str, name: str, *overrides: str) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        *SMALL,
        "train.num_steps=4",
        f"run_dir={tmp}/{name}",
        "checkpoint.save_interval=1",
        *overrides,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(args, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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
        assert check_provenance(f"{tmp}/b").ok and trained_by_step(f"{tmp}/b") == trained_by_step(f"{tmp}/a")

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
        check = check_provenance(f"{tmp}/c")
        assert check.ok and check.trained == 16, check
    finally:
        engine.close()


def test_provenance_is_compact_and_its_checker_finds_a_repeat_and_a_loss(tmp_path):
    """The checker on hand-made run directories: ranges, a resumed run's lines replacing those a
    killed run wrote after its checkpoint, a prompt trained twice, a prompt lost."""
    assert compact_ids([9, 3, 4, 5, 5]) == [[3, 5], [9, 9]] and expand_ids([[3, 5], [9, 9]]) == [3, 4, 5, 9]

    def run(name: str, steps: list[tuple[int, list[int]]], drawn: int, pending: int = 0, filtered: int = 0) -> str:
        d = str(tmp_path / name)
        for step, ids in steps:
            record_trained_prompts(d, step, ids)
        trained = len({i for _, ids in steps for i in ids})
        with open(os.path.join(d, "accounting.json"), "w") as f:
            json.dump(
                {
                    "drawn": drawn,
                    "trained": trained,
                    "filtered": filtered,
                    "dropped_stale": 0,
                    "failed": 0,
                    "pending": pending,
                },
                f,
            )
        return d

    # killed after writing step 3 (checkpoint of step 2), resumed: step 3 again with other prompts
    resumed = run("resumed", [(1, [0, 1]), (2, [2, 3]), (3, [4, 5]), (3, [5, 6]), (4, [4, 7])], drawn=9, pending=1)
    assert open(os.path.join(resumed, "provenance.jsonl")).readline() == '{"step": 1, "n": 2, "prompts": [[0, 1]]}\n'
    assert trained_by_step(resumed) == {1: [0, 1], 2: [2, 3], 3: [5, 6], 4: [4, 7]}
    assert check_provenance(resumed).ok

    twice = run("twice", [(1, [0, 1]), (2, [1, 2])], drawn=3)
    check = check_provenance(twice)
    assert not check.ok and check.duplicates == {1: [1, 2]}

    # the counts balance (one trained twice, one never), the ids do not
    with open(os.path.join(twice, "accounting.json"), "w") as f:
        json.dump({"drawn": 4, "trained": 4, "filtered": 0, "dropped_stale": 0, "failed": 0, "pending": 0}, f)
    check = check_provenance(twice)
    assert check.duplicates and any("3 prompts trained" in p for p in check.problems)

    lost = run("lost", [(1, [0, 1]), (2, [3, 4])], drawn=6, filtered=1)  # 2 and 5 drawn; one accounted for
    assert check_provenance(lost).problems == [
        "2 drawn prompts were not trained, but accounting.json accounts for 1 (filtered + dropped + failed + "
        "pending): 1 lost"
    ]
    gap = run("gap", [(1, [0]), (3, [1])], drawn=2)
    assert check_provenance(gap).missing_steps == [2]
