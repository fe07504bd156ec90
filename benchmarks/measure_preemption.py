"""Pre-emption time of `mcore-rl train`: SIGTERM to exit 75, split into its phases.

Why: a scheduler gives a job a grace period after SIGTERM (SLURM's KillWait, 30 s by default)
before SIGKILL. This starts the asynchronous runtime with started engine processes (the demo-sized
model, the test suite's small recipe), sends SIGTERM at a random point of step 3, and reads the
phases from `preempted.json` (`parallel/preemption.py`): the rest of the step (rollouts, learner,
weight sync, evaluation), the checkpoint, and — by the process's exit time — the teardown (engines,
reward workers, the interpreter). Prints each run and the median (min-max) of each phase.

    python benchmarks/measure_preemption.py                 # 3 runs
    python benchmarks/measure_preemption.py --runs 5 rollout.max_staleness=0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = [
    "train.num_steps=50",
    "train.seq_length=64",
    "train.micro_batch_size=8",
    "data.synthetic_max_digits=1",
    "data.synthetic_num_prompts=500",
    "rollout.quantization=none",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=12",
    "rollout.runtime=async",
    "rollout.max_staleness=1",
    "algorithm.num_minibatches=2",
    "reward.name=tests.reward_fns:digit_count",
    "eval.interval=0",
    "eval.at_start=false",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.plot=false",
]


def _steps(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return max((json.loads(x)["rl_step"] for x in f if x.endswith("\n")), default=0)
    except OSError:
        return 0


def one_run(tmp: str, extra: list[str], seed: int) -> dict[str, float]:
    run_dir = os.path.join(tmp, "run")
    args = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        *RECIPE,
        f"run_dir={run_dir}",
        f"checkpoint.save_dir={tmp}/ckpt",
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(os.path.join(tmp, "log.txt"), "w") as log:
        proc = subprocess.Popen(args, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while _steps(run_dir) < 2:
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended early; see {tmp}/log.txt")
            time.sleep(0.05)
        time.sleep(random.Random(seed).uniform(0.0, 1.0))  # somewhere in step 3
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
        ended = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code != 75:
        raise RuntimeError(f"exit code {code}, not 75; see {tmp}/log.txt")
    with open(os.path.join(run_dir, "preempted.json")) as f:
        marker = json.load(f)
    phases = {k.removesuffix("_s"): float(v) for k, v in marker["phases"].items()}
    phases["teardown"] = ended - marker["time"]
    phases["total"] = ended - sent
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="more dotted config overrides")
    a = p.parse_args()
    results = []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="preempt_") as tmp:
            r = one_run(tmp, a.overrides, i)
        results.append(r)
        print(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()), flush=True)
    for key in results[0]:
        xs = [r[key] for r in results]
        print(f"{key:>20}: median {statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})")


if __name__ == "__main__":
    main()
