"""Where the time of an RL run goes: the per-phase breakdown of its rollout steps, from metrics.jsonl.

Per rollout step (the record that closes it carries `time/step_s`): generation (engine, until the
batch is complete), rewards, the log-prob recompute of π_old (and π_ref), the optimizer steps
(forward + backward + AdamW, summed over the step's minibatches), the weight sync; evaluation and
checkpoints are listed apart (they run every `eval.interval` / `checkpoint.save_interval` steps),
and so is the trainer's idle time (`time/idle_s`, waiting for rollouts: generation and rewards in
the synchronous loop, the wait on the buffer in the asynchronous one). Prints the median and range
over steps and each phase's share of the median step. The names are those of `mcore_rl/observe/timers.py`.

    .venv/bin/python tools/phase_breakdown.py runs/smollm2_reasoning/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics")
    ap.add_argument("--skip", type=int, default=1, help="leave out the first N steps (warm-up)")
    args = ap.parse_args()
    records = [json.loads(line) for line in open(args.metrics)]
    steps, train_steps, evals, saves = [], [], [], []
    pending: list[float] = []
    for r in records:
        if "time/train_step_s" in r:
            pending.append(r["time/train_step_s"])
        if "time/eval_s" in r:
            evals.append(r["time/eval_s"])
        if "time/checkpoint_s" in r:
            saves.append(r["time/checkpoint_s"])
        if "time/step_s" in r:
            steps.append(r)
            train_steps.append(sum(pending))
            pending = []
    steps, train_steps = steps[args.skip :], train_steps[args.skip :]
    if not steps:
        raise SystemExit(f"{args.metrics}: no completed rollout steps after skipping {args.skip}")
    phases = {
        "generation": [r.get("time/generate_s", 0.0) for r in steps],
        "rewards": [r.get("time/reward_s", 0.0) for r in steps],
        "log-prob recompute": [r.get("time/logprobs_s", 0.0) for r in steps],
        "optimizer steps (fwd+bwd+AdamW)": train_steps,
        "weight sync": [r.get("time/sync_s", 0.0) for r in steps],
    }
    total = [r["time/step_s"] - r.get("time/eval_s", 0.0) for r in steps]
    med_total = statistics.median(total)
    print(f"{len(steps)} rollout steps of {args.metrics} (first {args.skip} left out)")
    print("| phase | median s | min-max s | share of the median step |")
    print("| --- | ---: | ---: | ---: |")
    for name, vals in phases.items():
        print(
            f"| {name} | {statistics.median(vals):.1f} | {min(vals):.1f}-{max(vals):.1f} | "
            f"{statistics.median(vals) / med_total:.0%} |"
        )
    rest = [t - sum(p[i] for p in phases.values()) for i, t in enumerate(total)]
    print(
        f"| other (batching, metrics, ...) | {statistics.median(rest):.1f} | {min(rest):.1f}-{max(rest):.1f} | "
        f"{statistics.median(rest) / med_total:.0%} |"
    )
    print(f"| **step (without evaluation)** | **{med_total:.1f}** | {min(total):.1f}-{max(total):.1f} | 100% |")
    idle = [r["time/idle_s"] for r in steps if "time/idle_s" in r]
    if idle:
        print(
            f"trainer idle (waiting for rollouts): median {statistics.median(idle):.1f} s per step, "
            f"{statistics.median(idle) / med_total:.0%} of the median step"
        )
    if evals:
        print(f"evaluation: {len(evals)} runs, median {statistics.median(evals):.0f} s")
    if saves:
        print(f"checkpoints: {len(saves)} saves, median {statistics.median(saves):.1f} s")


if __name__ == "__main__":
    main()
