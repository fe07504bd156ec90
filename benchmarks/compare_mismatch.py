"""No correction vs TIS vs MIS vs MIPU on the demo task with FP8 rollouts, same seeds.

    .venv/bin/python benchmarks/compare_mismatch.py                       # the docs/mismatch_correction.md run
    .venv/bin/python benchmarks/compare_mismatch.py --seeds 1 2 3 --steps 60 --methods none tis
    .venv/bin/python benchmarks/compare_mismatch.py -- rollout.quantization=none   # extra overrides for every run
    .venv/bin/python benchmarks/compare_mismatch.py --recipe configs/demo_moe.yaml --work runs/mismatch_moe \
        --png docs/mismatch_moe.png --seeds 1 2 3 --methods none tis mis mipu r3 mask r3_mask_tis
                                                # the issue-12 experiment: MoE, FP8, T=1, top-p 0.9

1. One SFT warm start (the demo's), saved as a checkpoint, so every method starts from the same
   weights: `mcore-rl train configs/demo.yaml train.num_steps=0 checkpoint.save_dir=WORK/sft`.
2. For each seed and method: `mcore-rl train configs/demo.yaml init.sft_steps=0
   init.checkpoint=WORK/sft algorithm.mismatch.name=METHOD train.seed=SEED run_dir=WORK/METHOD_sSEED`
   (`PRESETS` names other methods by their overrides: r3 / r2 routing replay, mask = sampling-mask replay)
   (the seed fixes the prompt order and every sampling seed, so the methods see the same prompts;
   their rollouts diverge once their weights do).
3. One PNG with the training reward, held-out scores and mismatch curves of every run side by side,
   and a table (markdown) of the final numbers averaged over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from mcore_rl.observe.sinks import read_metrics  # noqa: E402  (after the sys.path entry above)

COLORS = {
    "none": "tab:gray",
    "tis": "tab:blue",
    "mis": "tab:orange",
    "mipu": "tab:green",
    "icepop": "tab:red",
    "seq_tis": "tab:purple",
    "seq_mask_tis": "tab:brown",
    "slime_mis": "tab:pink",
    "seq_mis": "tab:olive",
    "r3": "tab:cyan",
    "mask": "tab:red",
    "r3_mask_tis": "black",
    "r2": "tab:purple",
}

# Methods that are not (only) a registered mismatch correction: their overrides. Any other name is
# `algorithm.mismatch.name=<name>`. R3 / R2 (MoE routing replay) and sampling-mask replay run
# without IS correction so that each shows its own effect; `r3_mask_tis` combines all three.
PRESETS = {
    "r3": ["algorithm.mismatch.name=none", "algorithm.routing_replay=r3"],
    "r2": ["algorithm.mismatch.name=none", "algorithm.routing_replay=r2"],
    "mask": ["algorithm.mismatch.name=none", "rollout.sampling_mask_replay=true"],
    "r3_mask_tis": ["algorithm.mismatch.name=tis", "algorithm.routing_replay=r3", "rollout.sampling_mask_replay=true"],
}


def method_overrides(method: str) -> list[str]:
    return PRESETS.get(method, [f"algorithm.mismatch.name={method}"])


def run(cmd: list[str], log: str) -> float:
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE)
    if rc != 0:
        raise SystemExit(f"command failed ({rc}), see {log}: {' '.join(cmd)}")
    return time.perf_counter() - start


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def smooth(ys: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(ys)):
        window = ys[max(0, i - k + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def series(records: list[dict], key: str, per_rollout: bool = True) -> tuple[list[float], list[float]]:
    """(rollout step, value); one point per rollout step (its last optimizer-step record)."""
    by_step: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            by_step[r["rl_step"]] = v
    xs = sorted(by_step)
    return xs, [by_step[x] for x in xs]


def plot(results: dict[str, dict[int, list[dict]]], k: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/mean", "training reward (sampled, T=1), 5-step mean", 5, False),
        (f"eval/avg@{k}", f"held-out avg@{k} (sampled, FP8 engine)", 1, False),
        ("eval/greedy_pass@1", "held-out greedy pass@1 (FP8 engine)", 1, False),
        ("mismatch/k3", "mismatch K3 = E[exp(d)-d-1], d = log π - log μ", 5, True),
        ("mismatch/is_weight_max", "max IS weight π_old/μ (after truncation / masking)", 1, True),
        ("train/grad_norm", "gradient norm, 5-step mean", 5, False),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
    for ax, (key, label, k_smooth, log) in zip(axes.flat, panels):
        for method, by_seed in results.items():
            for j, (seed, recs) in enumerate(sorted(by_seed.items())):
                xs, ys = series(recs, key)
                if not xs:
                    continue
                ys = smooth(ys, k_smooth)
                ax.plot(
                    xs,
                    ys,
                    color=COLORS.get(method),
                    alpha=0.9 if j == 0 else 0.45,
                    marker="o" if key.startswith("eval/") else None,
                    markersize=3,
                    label=method if j == 0 else None,
                )
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/demo.yaml")
    parser.add_argument("--methods", nargs="+", default=["none", "tis", "mis", "mipu"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 2345])
    parser.add_argument("--steps", type=int, default=60, help="rollout steps per run")
    parser.add_argument("--work", default="runs/compare_mismatch", help="run directories go here")
    parser.add_argument("--png", default="docs/mismatch_correction.png")
    parser.add_argument("--reuse", action="store_true", help="skip runs whose metrics.jsonl is complete")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args()

    cli = [sys.executable, "-m", "mcore_rl.cli", "train", args.recipe]
    common = ["logging.progress_bar=false", "logging.tensorboard=false", *args.overrides]
    work = os.path.join(HERE, args.work)
    os.makedirs(work, exist_ok=True)
    sft_dir = os.path.join(work, "sft")
    times: dict[str, float] = {}
    summary_path = os.path.join(work, "summary.json")
    if args.reuse and os.path.exists(summary_path):  # keep the timings of the runs being reused
        with open(summary_path) as f:
            times.update(json.load(f).get("times", {}))
    if not (args.reuse and os.path.exists(os.path.join(sft_dir, "latest"))):
        print("SFT warm start ...", flush=True)
        times["sft"] = run(
            cli
            + [
                f"run_dir={work}/sft_run",
                "train.num_steps=0",
                f"checkpoint.save_dir={sft_dir}",
                "eval.at_start=true",
                "logging.plot=false",
                *common,
            ],
            os.path.join(work, "sft.log"),
        )
    results: dict[str, dict[int, list[dict]]] = {m: {} for m in args.methods}
    k = 4
    for seed in args.seeds:
        for method in args.methods:
            run_dir = os.path.join(work, f"{method}_s{seed}")
            metrics = os.path.join(run_dir, "metrics.jsonl")
            done = (
                args.reuse
                and os.path.exists(metrics)
                and any(r.get("rl_step") == args.steps and "eval/score" in r for r in read_metrics(metrics))
            )
            if not done:
                if os.path.exists(metrics):
                    os.remove(metrics)
                print(f"{method} seed {seed} ...", flush=True)
                times[f"{method}_s{seed}"] = run(
                    cli
                    + [
                        f"run_dir={run_dir}",
                        "init.sft_steps=0",
                        f"init.checkpoint={sft_dir}",
                        *method_overrides(method),
                        f"train.seed={seed}",
                        f"train.num_steps={args.steps}",
                        *common,
                    ],
                    os.path.join(work, f"{method}_s{seed}.log"),
                )
            results[method][seed] = read_metrics(metrics)
            k = next(
                (int(key.split("@")[1]) for r in results[method][seed] for key in r if key.startswith("eval/avg@")), k
            )

    png = os.path.join(HERE, args.png)
    os.makedirs(os.path.dirname(png), exist_ok=True)
    plot(
        results,
        k,
        png,
        f"{args.recipe}: FP8 rollouts, {args.steps} rollout steps, seeds {args.seeds} (faint lines: further seeds)",
    )

    rows = []
    for method, by_seed in results.items():
        first = [next(r for r in recs if "eval/score" in r) for recs in by_seed.values()]
        last = [[r for r in recs if "eval/score" in r][-1] for recs in by_seed.values()]
        tail = [series(recs, "reward/mean")[1][-10:] for recs in by_seed.values()]
        k3 = [mean([r["mismatch/k3"] for r in recs if "mismatch/k3" in r]) for recs in by_seed.values()]
        acc = [mean([r.get("mipu/accepted") for r in recs if "mipu/accepted" in r]) for recs in by_seed.values()]
        touched = [
            mean(
                [
                    (r.get("mismatch/clipfrac") or 0) + (r.get("mismatch/maskfrac") or 0)
                    for r in recs
                    if "mismatch/k3" in r
                ]
            )
            for recs in by_seed.values()
        ]
        # per seed: the mean of the last 3 evaluations (one evaluation moves by ±3–5 points)
        late = [
            mean([x[f"eval/avg@{k}"] for x in [r for r in recs if "eval/score" in r][-3:]]) for recs in by_seed.values()
        ]
        late_greedy = [
            mean([x["eval/greedy_pass@1"] for x in [r for r in recs if "eval/score" in r][-3:]])
            for recs in by_seed.values()
        ]
        rows.append(
            {
                "method": method,
                "avgk_late": mean(late),
                "avgk_late_min": min(late),
                "avgk_late_max": max(late),
                "greedy_late": mean(late_greedy),
                "greedy_late_min": min(late_greedy),
                "greedy_late_max": max(late_greedy),
                "greedy_before": mean([f["eval/greedy_pass@1"] for f in first]),
                "greedy_after": mean([x["eval/greedy_pass@1"] for x in last]),
                "avgk_before": mean([f[f"eval/avg@{k}"] for f in first]),
                "avgk_after": mean([x[f"eval/avg@{k}"] for x in last]),
                "reward_last10": mean([mean(t) for t in tail]),
                "k3_mean": mean(k3),
                "mipu_accept": mean(acc),
                "touched": mean(touched),
                "wall_s": mean([times.get(f"{method}_s{s}", float("nan")) for s in by_seed]),
            }
        )
    print(
        f"\n| method | held-out greedy pass@1 (before -> after) | held-out avg@{k} (before -> after) | "
        f"avg@{k}, last 3 evals (seed min-max) | greedy, last 3 evals (seed min-max) | "
        "train reward, last 10 steps | mean K3 | tokens truncated or masked | MIPU accept rate |"
    )
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        acc = "-" if math.isnan(r["mipu_accept"]) else f"{r['mipu_accept']:.0%}"
        print(
            f"| {r['method']} | {r['greedy_before']:.1%} -> {r['greedy_after']:.1%} | "
            f"{r['avgk_before']:.1%} -> {r['avgk_after']:.1%} | "
            f"{r['avgk_late']:.1%} ({r['avgk_late_min']:.1%}-{r['avgk_late_max']:.1%}) | "
            f"{r['greedy_late']:.1%} ({r['greedy_late_min']:.1%}-{r['greedy_late_max']:.1%}) | "
            f"{r['reward_last10']:.3f} | {r['k3_mean']:.2e} | {r['touched']:.2%} | {acc} |"
        )
    print(
        "\nwall seconds per run (shared machine, indicative only): "
        + ", ".join(f"{k} {v:.0f}" for k, v in times.items())
    )
    with open(summary_path, "w") as f:
        json.dump({"rows": rows, "seeds": args.seeds, "steps": args.steps, "times": times}, f, indent=1)
    print(f"\n{png}\n{summary_path}")


if __name__ == "__main__":
    main()
