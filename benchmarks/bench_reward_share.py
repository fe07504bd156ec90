"""What the code sandbox costs an RL step, and whether it stalls the learner.

    python benchmarks/bench_reward_share.py [--steps 12] [--repeats 2]

One domain, `tiny_code` ("f(x)=3x+1" -> "lambda x:3*x+1"), every completion run against its unit
tests in the sandbox (`rewards/sandbox.py`), after a short SFT warm start so that completions are
real programs. Side by side, alternating, in one run:

  sync  + sandbox   the synchronous loop: generate, score, train; `time/reward_s` is on the critical path
  async + sandbox   the asynchronous runtime (max_staleness 1, one started engine process): rewards are
                    scored by the reward workers while the learner trains
  async + regex     the same with a regular-expression check instead of running the program (the
                    baseline: what the learner waits when rewards cost nothing)

Reported per configuration (median over steps after the first two, then median and range over
repeats): the step time, the reward time and its share of the step (sync), the learner's wait for
a batch (`time/rollout_wait_s`) and its idle fraction (async). The sandbox does not stall the
learner when async+sandbox waits no longer than async+regex.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = [
    "configs/domains.yaml",
    "data.domains=[{name: code, task: tiny_code, max_new_tokens: 16, eval: {num_prompts: 20}}]",
    "init.sft_steps=150",
    "eval.interval=0",
    "eval.num_prompts=20",
    "eval.k=0",
    "eval.score=greedy",
    "logging.progress_bar=false",
    "logging.plot=false",
    "logging.tensorboard=false",
]
ASYNC = ["rollout.runtime=async", "rollout.max_staleness=1"]
REGEX = [
    "data.domains=[{name: code, task: tiny_code, max_new_tokens: 16, eval: {num_prompts: 20}, "
    "rewards: [{name: formatting, options: {pattern: 'lambda x:[-+*0-9x]+'}}]}]"
]
CONFIGS = {"sync+sandbox": [], "async+sandbox": ASYNC, "async+regex": ASYNC + REGEX}


def run(name: str, steps: int, out: str, rep: int) -> dict[str, float]:
    run_dir = os.path.join(out, f"{name.replace('+', '_')}-{rep}")
    cmd = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        *BASE,
        *CONFIGS[name],
        f"run_dir={run_dir}",
        f"train.num_steps={steps}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps_rows = [r for r in rows if "time/step_s" in r][2:]  # the first steps include start-up

    def med(key: str) -> float:
        vals = [r[key] for r in steps_rows if key in r]
        return statistics.median(vals) if vals else float("nan")

    step, reward = med("time/step_s"), med("time/reward_s")
    return {
        "step_s": step,
        "reward_s": reward,
        "reward_share": reward / step if step else float("nan"),
        "wait_s": med("time/rollout_wait_s"),
        "idle_frac": med("time/trainer_idle_frac"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_reward_share"))
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {k: [] for k in CONFIGS}
    for rep in range(args.repeats):
        order = list(CONFIGS) if rep % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            results[name].append(run(name, args.steps, args.out, rep))
            print(
                f"{name:14s} repeat {rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name][-1].items()),
                flush=True,
            )

    def cell(name: str, key: str) -> str:
        vals = sorted(r[key] for r in results[name])
        mid = statistics.median(vals)
        return f"{mid:.3f}" + (f" [{vals[0]:.3f}, {vals[-1]:.3f}]" if len(vals) > 1 else "")

    keys = ["step_s", "reward_s", "reward_share", "wait_s", "idle_frac"]
    print("\n| config | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for name in CONFIGS:
        print(f"| {name} | " + " | ".join(cell(name, k) for k in keys) + " |")
    a, b = (statistics.median(r["wait_s"] for r in results[n]) for n in ("async+sandbox", "async+regex"))
    print(
        f"\nlearner wait for a batch, async: sandbox {a:.3f} s vs regex {b:.3f} s (ratio {a / b if b else float('nan'):.2f})"
    )


if __name__ == "__main__":
    main()
