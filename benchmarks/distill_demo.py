"""The multi-domain RL and on-policy distillation demos, side by side, over seeds.

    python benchmarks/distill_demo.py [--seeds 1234 1235] [--steps 40] [--variants rl reverse_kl ...]

1. The teacher (configs/distill_teacher.yaml: 4 layers, 128 wide, SFT on the three domains of
   configs/domains.yaml), exported as an HF checkpoint; cached in runs/distill_teacher/hf.
2. For each seed and variant, the student (configs/domains.yaml's 2-layer, 64-wide model after the
   same short SFT warm start) trained for `--steps` rollout steps by:
     rl              GRPO on the domains' rewards (configs/domains.yaml: the multi-domain RL demo)
     reverse_kl      reverse-KL OPD alone, as an advantage term (configs/distill.yaml)
     reverse_kl+rl   reverse-KL OPD added to GRPO's advantages
     topk_fkl        forward KL over the teacher's top-8 tokens alone, a loss term (TrOPD's, every token)
3. Prints the per-domain held-out avg@4 before and after (median and range over seeds) as a
   markdown table and draws docs/distill_demo.png (per-domain eval curves, one line per variant).

Every run is a real `mcore-rl train` process (the teacher an `mcore-rl serve` process it starts);
the variants of one seed are run one after another, alternating their order between seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER_DIR = os.path.join(ROOT, "runs", "distill_teacher")

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "rl": ("configs/domains.yaml", []),
    "reverse_kl": ("configs/distill.yaml", []),
    "reverse_kl+rl": ("configs/distill.yaml", ["distill.rl=true"]),
    "topk_fkl": ("configs/distill.yaml", ["distill.losses=[{name: tropd_fkl, coef: 1.0, options: {weight: all}}]"]),
}


def _cli(*args: str) -> None:
    cmd = [sys.executable, "-m", "mcore_rl.cli", *args]
    print("$ mcore-rl " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def teacher(retrain: bool) -> str:
    hf = os.path.join(TEACHER_DIR, "hf")
    if retrain or not os.path.exists(os.path.join(hf, "config.json")):
        start = time.perf_counter()
        _cli("train", "configs/distill_teacher.yaml", "logging.progress_bar=false", "logging.plot=false")
        _cli("convert", "mcore-to-hf", "--input", os.path.join(TEACHER_DIR, "checkpoint"), "--output", hf)
        print(f"teacher trained and exported in {time.perf_counter() - start:.0f} s", flush=True)
    return hf


def _evals(run_dir: str) -> list[dict[str, float]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "eval/score" in r]


def run_variant(name: str, seed: int, steps: int, hf: str, out: str) -> dict:
    config, extra = VARIANTS[name]
    run_dir = os.path.join(out, f"{name}-s{seed}")
    args = [
        "train",
        config,
        f"run_dir={run_dir}",
        f"train.seed={seed}",
        f"train.num_steps={steps}",
        "logging.progress_bar=false",
        "logging.plot=false",
        *extra,
    ]
    if config.endswith("distill.yaml"):
        args.append(f"teachers=[{{name: big, kind: engine, model_path: {hf}, top_k: 8, engine_threads: 1}}]")
    start = time.perf_counter()
    _cli(*args)
    wall = time.perf_counter() - start
    evals = _evals(run_dir)
    domains = sorted(
        {k.split("/")[1] for k in evals[0] if k.startswith("eval/") and k.endswith("/score") and k.count("/") == 2}
    )
    return {
        "variant": name,
        "seed": seed,
        "wall_s": wall,
        "domains": domains,
        "curve": [
            {"step": r["rl_step"], **{d: r[f"eval/{d}/score"] for d in domains}, "all": r["eval/score"]} for r in evals
        ],
    }


def _fmt(values: list[float]) -> str:
    values = sorted(values)
    return f"{100 * statistics.median(values):.1f}" + (
        f" [{100 * values[0]:.1f}, {100 * values[-1]:.1f}]" if len(values) > 1 else ""
    )


def table(results: list[dict]) -> str:
    domains = results[0]["domains"] + ["all"]
    lines = [
        "| variant | " + " | ".join(f"{d} before → after" for d in domains) + " | wall s |",
        "|---|" + "---|" * (len(domains) + 1),
    ]
    for name in dict.fromkeys(r["variant"] for r in results):
        rs = [r for r in results if r["variant"] == name]
        cells = [f"{_fmt([r['curve'][0][d] for r in rs])} → {_fmt([r['curve'][-1][d] for r in rs])}" for d in domains]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.median(r['wall_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = results[0]["domains"] + ["all"]
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.4), sharey=True)
    colors = dict(zip(VARIANTS, ["tab:gray", "tab:blue", "tab:purple", "tab:orange"]))
    for ax, d in zip(axes, domains):
        for r in results:
            xs = [p["step"] for p in r["curve"]]
            ax.plot(
                xs,
                [100 * p[d] for p in r["curve"]],
                color=colors[r["variant"]],
                alpha=0.8,
                label=r["variant"] if r["seed"] == results[0]["seed"] else None,
            )
        ax.set_title(f"{d}: held-out avg@4" if d != "all" else "mean of the domains")
        ax.set_xlabel("rollout step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("%")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "distill_demo"))
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "distill_demo.png"))
    ap.add_argument("--retrain-teacher", action="store_true")
    args = ap.parse_args()
    hf = teacher(args.retrain_teacher)
    results = []
    for i, seed in enumerate(args.seeds):
        order = args.variants if i % 2 == 0 else list(reversed(args.variants))
        for name in order:
            results.append(run_variant(name, seed, args.steps, hf, args.out))
            print(
                f"  {name} seed {seed}: "
                + ", ".join(
                    f"{d} {100 * results[-1]['curve'][0][d]:.1f}->{100 * results[-1]['curve'][-1][d]:.1f}"
                    for d in results[-1]["domains"] + ["all"]
                )
                + f" ({results[-1]['wall_s']:.0f} s)",
                flush=True,
            )
    results.sort(key=lambda r: (args.variants.index(r["variant"]), r["seed"]))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    plot(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
