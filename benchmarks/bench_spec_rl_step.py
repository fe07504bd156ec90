"""The RL step time of a recipe with and without speculative rollouts, alternating runs.

    .venv/bin/python benchmarks/bench_spec_rl_step.py --recipe configs/smollm2_reasoning.yaml \\
        --rounds 2 --steps 2 --spec rollout.speculative_algorithm=ngram -- init.checkpoint=DIR/mcore \\
        data.tokenizer_path=DIR/hf

Each round runs `mcore-rl train RECIPE train.num_steps=STEPS eval.interval=0` twice in fresh
processes, plain and with the `--spec` overrides (the order swaps every round, so load from other
processes hits both alike), each in its own temporary run directory, with no evaluation before the
first step and held-out sets of 2 prompts per domain (the run evaluates after its last step; that
time is subtracted), and reads back `metrics.jsonl`: per optimizer step `time/step_s` (the whole
RL step: rollout, log-probs, training, weight sync) and
`time/generate_s` (the rollout's generation). Printed: the median of each over every step of every
round of a side, the min-max, and the ratio of the medians. Overrides after `--` go to both sides
(paths of the checkpoint and tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import yaml


def small_eval_recipe(recipe: str, prompts: int, out: str) -> None:
    """`recipe` with every domain's held-out set cut to `prompts` (the run still evaluates after its
    last step; that evaluation is subtracted from the step's time)."""
    with open(recipe) as f:
        data = yaml.safe_load(f)
    for d in data.get("data", {}).get("domains", []):
        d.setdefault("eval", {})["num_prompts"] = prompts
    data.setdefault("eval", {})["num_prompts"] = prompts
    with open(out, "w") as f:
        yaml.safe_dump(data, f)


def run_side(recipe: str, steps: int, overrides: list[str]) -> list[dict]:
    """One training run in a fresh process; its per-step metric records."""
    with tempfile.TemporaryDirectory() as run_dir:
        small = os.path.join(run_dir, "recipe.yaml")
        small_eval_recipe(recipe, 2, small)
        cmd = [
            sys.executable,
            "-m",
            "mcore_rl.cli",
            "train",
            small,
            f"train.num_steps={steps}",
            "eval.interval=0",
            "eval.at_start=false",
            f"run_dir={run_dir}",
            f"checkpoint.save_dir={os.path.join(run_dir, 'checkpoint')}",
            *overrides,
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
    steps_seen = [r for r in records if "time/step_s" in r]
    for r in steps_seen:  # the evaluation after the last step is not part of an RL step
        r["time/step_s"] -= r.get("time/eval_s", 0.0)
    print(
        f"  {'spec ' if overrides[:1] and 'speculative' in overrides[0] else ''}run: {wall:.0f} s wall, "
        f"step_s {[round(r['time/step_s'], 1) for r in steps_seen]}, "
        f"generate_s {[round(r.get('time/generate_s', float('nan')), 1) for r in steps_seen]}",
        flush=True,
    )
    return steps_seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="configs/smollm2_reasoning.yaml")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", nargs="+", default=["rollout.speculative_algorithm=ngram"])
    ap.add_argument("common", nargs="*", help="overrides for both sides (after --)")
    args = ap.parse_args()
    sides = {"plain": list(args.common), "spec": [*args.spec, *args.common]}
    got: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        order = ["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]
        for side in order:
            print(f"round {r}, {side}", flush=True)
            got[side] += run_side(args.recipe, args.steps, sides[side])
    print("| side | steps | step s, median (min-max) | generate s, median (min-max) |")
    print("| --- | ---: | ---: | ---: |")
    med = {}
    for side, recs in got.items():
        step = [r["time/step_s"] for r in recs]
        gen = [r.get("time/generate_s", float("nan")) for r in recs]
        med[side] = (statistics.median(step), statistics.median(gen))
        print(
            f"| {side} | {len(step)} | {med[side][0]:.1f} ({min(step):.1f}-{max(step):.1f}) | "
            f"{med[side][1]:.1f} ({min(gen):.1f}-{max(gen):.1f}) |"
        )
    print(
        f"spec / plain: step {med['spec'][0] / med['plain'][0]:.2f}x, generate {med['spec'][1] / med['plain'][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
