"""Algorithms of the zoo against a GRPO baseline on the demo task, same seeds, same warm start.

    .venv/bin/python benchmarks/compare_algorithms.py --sft-steps 300 --work runs/compare_algorithms_weak \
        --png docs/algorithms_weak.png                               # the docs/algorithms.md run (weak warm start)
    .venv/bin/python benchmarks/compare_algorithms.py                     # from the demo's warm start (near the ceiling)
    .venv/bin/python benchmarks/compare_algorithms.py --methods grpo w_reinforce --seeds 1 2 3 --steps 60
    .venv/bin/python benchmarks/compare_algorithms.py --method mine="algorithm.advantage=rloo" --methods grpo mine
    .venv/bin/python benchmarks/compare_algorithms.py -- rollout.quantization=none   # extra overrides for every run

1. One SFT warm start (the demo's), saved as a checkpoint, so every method starts from the same weights.
2. For each seed and method: `mcore-rl train RECIPE init.sft_steps=0 init.checkpoint=WORK/sft <the
   method's overrides> train.seed=SEED run_dir=WORK/METHOD_sSEED`. The seed fixes the prompt order
   and the sampling seeds, so the methods see the same prompts; their rollouts diverge once their
   weights do. Runs alternate methods within each seed.
3. One PNG (training reward, held-out greedy pass@1, avg@k and pass@k, entropy, |advantage|) and a
   markdown table: per method the mean over seeds of the last three evaluations, with the seeds' min–max,
   and the difference to GRPO per seed (paired: same seed, same prompts at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "benchmarks"))

from compare_mismatch import mean, run, series, smooth  # noqa: E402  (after the sys.path entries above)
from mcore_rl.observe.sinks import read_metrics  # noqa: E402  (as above)

# each method: the dotted overrides that turn it on in configs/demo.yaml (GRPO, PPO-clip with
# clip-higher, TIS against the FP8 engine, 2 optimizer steps per rollout batch)
PRESETS: dict[str, list[str]] = {
    "grpo": [],
    # PPO-clip form (keeps the demo's 2 mini-batches on-policy-corrected); `algorithm.policy_loss=reinforce` is the
    # paper's plain REINFORCE
    "w_reinforce": ["algorithm.advantage=w_reinforce", "algorithm.advantage_options={lam: 0.1}"],
    "entropy_adv": ["algorithm.advantage_shaping=[{name: entropy_adv, options: {alpha: 0.4, kappa: 2.0}}]"],
    "edge_grpo": ["algorithm.advantage_shaping=[{name: edge_eda}]", "rollout.gec.enabled=true"],
    "polaris": [
        "rollout.temperature_stages=[{start_step: 0, temperature: 1.0}, {start_step: 20, temperature: 1.1},"
        " {start_step: 40, temperature: 1.2}]",
        "data.drop_solved_above=0.9",
        "rollout.polaris.rescue=true",
        "rollout.polaris.substitute=true",
    ],
    "unlikeliness": ["algorithm.reward_shaping=[{name: unlikeliness, options: {beta_rank: 0.25}}]"],
    # plain SGD at the median of AdamW's effective per-coordinate rate lr/(sqrt(v̂)+ε) on this task, as the paper
    # sets it: `mcore-rl diagnose adam_effective_lr` on a 20-step AdamW checkpoint from the weak warm start gave 4.1
    "sgd": ["optimizer.name=sgd", "optimizer.lr=4.0"],
    # ablations and a learning-rate sweep (the docs/algorithms.md tables)
    "edge_eda": ["algorithm.advantage_shaping=[{name: edge_eda}]"],
    "edge_gec": ["rollout.gec.enabled=true"],
    "sgd_lr1": ["optimizer.name=sgd", "optimizer.lr=1.0"],
    "sgd_lr0.3": ["optimizer.name=sgd", "optimizer.lr=0.3"],
    "w_reinforce_pg": [
        "algorithm.advantage=w_reinforce",
        "algorithm.advantage_options={lam: 0.1}",
        "algorithm.policy_loss=reinforce",
        "algorithm.num_minibatches=1",
    ],
}
COLORS = [
    "tab:gray",
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
]


def evals(records: list[dict]) -> list[dict]:
    return [r for r in records if "eval/score" in r]


def plot(results: dict[str, dict[int, list[dict]]], k: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward/mean", "training reward (sampled), 5-step mean", 5),
        ("eval/greedy_pass@1", "held-out greedy pass@1", 1),
        (f"eval/avg@{k}", f"held-out avg@{k} (sampled)", 1),
        (f"eval/pass@{k}", f"held-out pass@{k} (sampled)", 1),
        ("entropy/mean", "policy entropy on the rollouts, 5-step mean", 5),
        ("advantage/abs_mean", "mean |advantage| (per sample), 5-step mean", 5),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
    for ax, (key, label, k_smooth) in zip(axes.flat, panels):
        for i, (method, by_seed) in enumerate(results.items()):
            for j, (_, recs) in enumerate(sorted(by_seed.items())):
                xs, ys = series(recs, key)
                if not xs:
                    continue
                ax.plot(
                    xs,
                    smooth(ys, k_smooth),
                    color=COLORS[i % len(COLORS)],
                    alpha=0.9 if j == 0 else 0.4,
                    marker="o" if key.startswith("eval/") else None,
                    markersize=3,
                    label=method if j == 0 else None,
                )
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def late(recs: list[dict], key: str) -> float:
    """The mean of the last three evaluations (one evaluation of 200 prompts moves by a few points)."""
    return mean([r.get(key) for r in evals(recs)[-3:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/demo.yaml")
    parser.add_argument("--methods", nargs="+", default=list(PRESETS))
    parser.add_argument(
        "--method",
        action="append",
        default=[],
        metavar="NAME=OVERRIDE[;OVERRIDE...]",
        help="define (or redefine) a method by its overrides, separated by ';'",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=60, help="rollout steps per run")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="SFT steps of the shared warm start (default: the recipe's init.sft_steps)",
    )
    parser.add_argument("--work", default="runs/compare_algorithms", help="run directories go here")
    parser.add_argument("--png", default="docs/algorithms.png")
    parser.add_argument("--reuse", action="store_true", help="skip runs whose metrics.jsonl is complete")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every run (after --)")
    args = parser.parse_args()

    presets = dict(PRESETS)
    for spec in args.method:
        name, _, body = spec.partition("=")
        presets[name.strip()] = [o.strip() for o in body.split(";") if o.strip()]
    unknown = [m for m in args.methods if m not in presets]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; presets: {', '.join(presets)} (or define one with --method)")
    if "grpo" not in args.methods:
        args.methods.insert(0, "grpo")

    cli = [sys.executable, "-m", "mcore_rl.cli", "train", args.recipe]
    common = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false", *args.overrides]
    work = os.path.join(HERE, args.work)
    os.makedirs(work, exist_ok=True)
    sft_dir = os.path.join(work, "sft")
    times: dict[str, float] = {}
    summary_path = os.path.join(work, "summary.json")
    if args.reuse and os.path.exists(summary_path):
        with open(summary_path) as f:
            times.update(json.load(f).get("times", {}))
    if not (args.reuse and os.path.exists(os.path.join(sft_dir, "latest"))):
        print("SFT warm start ...", flush=True)
        sft = [] if args.sft_steps is None else [f"init.sft_steps={args.sft_steps}"]
        times["sft"] = run(
            cli
            + [
                f"run_dir={work}/sft_run",
                "train.num_steps=0",
                f"checkpoint.save_dir={sft_dir}",
                "eval.at_start=true",
                *sft,
                *common,
            ],
            os.path.join(work, "sft.log"),
        )
    results: dict[str, dict[int, list[dict]]] = {m: {} for m in args.methods}
    k = 4
    for i, seed in enumerate(args.seeds):
        order = args.methods if i % 2 == 0 else args.methods[::-1]  # alternate the order between seeds
        for method in order:
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
                        *presets[method],
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
        f"{args.recipe}: {args.steps} rollout steps from one SFT warm start, seeds {args.seeds} "
        "(faint lines: further seeds)",
    )

    keys = {"greedy": "eval/greedy_pass@1", "avgk": f"eval/avg@{k}", "passk": f"eval/pass@{k}"}
    rows = []
    for method, by_seed in results.items():
        row: dict = {"method": method, "overrides": presets[method]}
        for name, key in keys.items():
            per_seed = {s: late(recs, key) for s, recs in by_seed.items()}
            base = {s: late(recs, key) for s, recs in results["grpo"].items()}
            diffs = [per_seed[s] - base[s] for s in per_seed if s in base]
            row[name] = mean(list(per_seed.values()))
            row[f"{name}_min"], row[f"{name}_max"] = min(per_seed.values()), max(per_seed.values())
            row[f"{name}_diff"] = mean(diffs)
            row[f"{name}_diff_min"], row[f"{name}_diff_max"] = min(diffs), max(diffs)
        row["before_greedy"] = mean([evals(recs)[0].get(keys["greedy"]) for recs in by_seed.values()])
        row["entropy_last10"] = mean([mean(series(recs, "entropy/mean")[1][-10:]) for recs in by_seed.values()])
        row["reward_last10"] = mean([mean(series(recs, "reward/mean")[1][-10:]) for recs in by_seed.values()])
        row["wall_s"] = mean([times.get(f"{method}_s{s}", float("nan")) for s in by_seed])
        rows.append(row)

    def cell(r: dict, name: str) -> str:
        return f"{r[name]:.1%} ({r[name + '_min']:.1%}–{r[name + '_max']:.1%})"

    def diff(r: dict, name: str) -> str:
        if r["method"] == "grpo":
            return "—"
        return f"{r[name + '_diff']:+.1%} ({r[name + '_diff_min']:+.1%} to {r[name + '_diff_max']:+.1%})"

    print(
        f"\n| method | greedy pass@1 | Δ vs GRPO | avg@{k} | Δ vs GRPO | pass@{k} | Δ vs GRPO | "
        "entropy, last 10 steps | train reward, last 10 steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['method']} | {cell(r, 'greedy')} | {diff(r, 'greedy')} | {cell(r, 'avgk')} | {diff(r, 'avgk')} | "
            f"{cell(r, 'passk')} | {diff(r, 'passk')} | {r['entropy_last10']:.3f} | {r['reward_last10']:.3f} |"
        )
    print(
        f"\nheld-out greedy pass@1 at the warm start: {rows[0]['before_greedy']:.1%}; cells: the mean over seeds of "
        "the last 3 evaluations (seeds' min–max); Δ: paired by seed"
    )
    print(
        "wall seconds per run (shared machine, indicative only): "
        + ", ".join(f"{name} {v:.0f}" for name, v in times.items())
    )
    with open(summary_path, "w") as f:
        json.dump(
            {
                "rows": rows,
                "seeds": args.seeds,
                "steps": args.steps,
                "times": times,
                "recipe": args.recipe,
                "overrides": args.overrides,
            },
            f,
            indent=1,
        )
    print(f"\n{png}\n{summary_path}")


if __name__ == "__main__":
    main()
