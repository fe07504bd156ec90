"""Reward hacking, side by side: RL of the demo policy against a learned reward model vs against
the verifier the RM was trained to imitate, same budget, several seeds (docs/reward_models.md).

1. Two RMs learn the demo's task (`addition_lsd`) from preference pairs (`mcore-rl rm-train`: a
   verified answer chosen over a wrong one): `plain`, and `rrm` with RRM's augmentation
   (`data.rrm=true`); each is exported as a Hugging Face sequence classifier.
2. `mcore-rl train configs/demo.yaml` runs once per seed and reward: `verifier` (the task's own
   reward), `rm_plain` and `rm_rrm` (the RM's score is the reward). Every run also scores each sample
   with the verifier as a head of weight 0, so `reward/addition_lsd/head/addition_lsd` is the true
   accuracy of the policy's samples at every step whatever it was trained on, and
   `.../head/reward_model` is what the RM said about the same samples.
3. One plot (verifier accuracy and RM reward over steps, mean and range over seeds per reward) and a
   table: the true accuracy of the first and the last 10 steps per run.

    python benchmarks/bench_reward_hacking.py --seeds 1234,1,2 --rm-steps 300 --out docs/reward_hacking.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

TASK = "addition_lsd"  # the demo's task (configs/demo.yaml)
RM_HEAD, TRUE_HEAD = "reward_model", TASK
WINDOW = 10  # steps averaged at the start and the end of a run


def _cli(*args: str) -> None:
    run = subprocess.run([sys.executable, "-m", "mcore_rl.cli", *args], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"mcore-rl {' '.join(args[:2])} failed:\n{run.stderr[-3000:]}")


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_rm(work: str, name: str, steps: int, rrm: bool) -> tuple[str, float]:
    """Train and export one RM; its HF directory and its held-out pair accuracy."""
    run = os.path.join(work, f"rm_{name}")
    if os.path.exists(f"{run}/hf/config.json"):  # made by an earlier call with the same --work
        return f"{run}/hf", float([r["eval_accuracy"] for r in _records(run) if "eval_accuracy" in r][-1])
    _cli(
        "rm-train",
        "configs/rm_demo.yaml",
        f"run_dir={run}",
        f"checkpoint.save_dir={run}/ckpt",
        f"data.synthetic_task={TASK}",
        f"data.rrm={str(rrm).lower()}",
        f"train.train_iters={steps}",
        f"train.eval_interval={steps}",
    )
    _cli("convert", "mcore-to-hf", "--input", f"{run}/ckpt", "--output", f"{run}/hf")
    acc = [r["eval_accuracy"] for r in _records(run) if "eval_accuracy" in r][-1]
    return f"{run}/hf", float(acc)


def train_policy(work: str, reward: str, seed: int, rm_dirs: dict[str, str], extra: list[str]) -> list[dict]:
    """One RL run of the demo recipe with `reward` as its reward; the verifier always as a 0-weight head."""
    heads = [{"name": TASK, "weight": 1.0 if reward == "verifier" else 0.0}]
    if reward != "verifier":
        heads.insert(0, {"name": RM_HEAD, "weight": 1.0, "options": {"model_dir": rm_dirs[reward]}})
    # the demo's data (`data.synthetic_task`, 2-digit operands, a pool of 100k) as one domain with heads
    domain = {"name": TASK, "task": TASK, "options": {"max_digits": 2}, "num_prompts": 100_000, "rewards": heads}
    run = os.path.join(work, f"{reward}_{seed}")
    _cli(
        "train",
        "configs/demo.yaml",
        f"run_dir={run}",
        f"train.seed={seed}",
        f"data.domains={json.dumps([domain])}",
        "eval.interval=0",  # held-out scores would threshold the RM's score; the verifier head is the truth
        "eval.num_prompts=8",  # only the before/after evaluation (scored by the weighted reward: not used)
        *extra,
    )
    return [r for r in _records(run) if f"reward/{TASK}/head/{TRUE_HEAD}" in r]


def _curve(recs: list[dict], head: str) -> list[float]:
    return [r[f"reward/{TASK}/head/{head}"] for r in recs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1234,1,2")
    ap.add_argument("--rm-steps", type=int, default=300)
    ap.add_argument("--rewards", default="verifier,rm_plain,rm_rrm")
    ap.add_argument("--rl-steps", type=int, default=None, help="train.num_steps (default: the demo's)")
    ap.add_argument("--out", default=None, help="a PNG of the curves")
    ap.add_argument("--work", default=None, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rewards = args.rewards.split(",")
    extra = [f"train.num_steps={args.rl_steps}"] if args.rl_steps else []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or tmp
        os.makedirs(work, exist_ok=True)
        rm_dirs: dict[str, str] = {}
        for name in [r for r in rewards if r.startswith("rm_")]:
            rm_dirs[name], acc = train_rm(work, name[3:], args.rm_steps, rrm=name == "rm_rrm")
            print(f"{name}: held-out pair accuracy {acc:.3f} after {args.rm_steps} steps", flush=True)
        runs: dict[str, list[list[dict]]] = {r: [] for r in rewards}
        for seed in seeds:  # alternate the rewards within a seed: load drifts between seeds, not between rewards
            for reward in rewards:
                runs[reward].append(train_policy(work, reward, seed, rm_dirs, extra))
                recs = runs[reward][-1]
                true = _curve(recs, TRUE_HEAD)
                print(
                    f"{reward:9s} seed {seed:5d}: verifier accuracy of the samples "
                    f"{statistics.mean(true[:WINDOW]):.3f} -> {statistics.mean(true[-WINDOW:]):.3f}"
                    + (
                        f", RM reward {statistics.mean(_curve(recs, RM_HEAD)[:WINDOW]):+.3f} -> "
                        f"{statistics.mean(_curve(recs, RM_HEAD)[-WINDOW:]):+.3f}"
                        if reward != "verifier"
                        else ""
                    ),
                    flush=True,
                )
        print(f"\n| reward | verifier accuracy, first {WINDOW} steps | last {WINDOW} steps (mean [range] over seeds) |")
        print("| --- | ---: | ---: |")
        for reward, rs in runs.items():
            first = [statistics.mean(_curve(r, TRUE_HEAD)[:WINDOW]) for r in rs]
            last = [statistics.mean(_curve(r, TRUE_HEAD)[-WINDOW:]) for r in rs]
            print(
                f"| {reward} | {100 * statistics.mean(first):.1f} | {100 * statistics.mean(last):.1f} "
                f"[{100 * min(last):.1f}-{100 * max(last):.1f}] |"
            )
        if args.out:
            _plot(runs, args.out)


def _plot(runs: dict[str, list[list[dict]]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_true, ax_rm) = plt.subplots(1, 2, figsize=(11, 4))
    for reward, rs in runs.items():
        for ax, head in ((ax_true, TRUE_HEAD), (ax_rm, RM_HEAD)):
            if head == RM_HEAD and reward == "verifier":
                continue
            n = min(len(r) for r in rs)
            curves = np.array([_curve(r, head)[:n] for r in rs])
            steps = [r["step"] for r in rs[0][:n]]
            (line,) = ax.plot(steps, curves.mean(axis=0), label=reward)
            ax.fill_between(steps, curves.min(axis=0), curves.max(axis=0), alpha=0.2, color=line.get_color())
    ax_true.set(xlabel="RL step", ylabel="verifier accuracy of the step's samples", title="what is true")
    ax_rm.set(xlabel="RL step", ylabel="reward model's mean score", title="what the RM says")
    ax_true.legend()
    ax_rm.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
