"""Synchronous vs asynchronous `mcore-rl train`: wall-clock time for the same number of steps.

Why: the asynchronous runtime exists to overlap generation with training. This runs the same
recipe with `rollout.runtime=sync` and with `rollout.runtime=async` at `max_staleness` 1 and 2,
alternating the three so that load from other processes hits them alike, and prints the median
(and min-max) wall time of each, the speed-up over sync, and the ideal-overlap bound: from the sync
runs' measured phase times, a schedule that overlapped generation and training perfectly would
take sum over steps of max(generation, training + sync) instead of their sum. The async runs' share
of that bound says how close the scheduler gets. It also writes the reward-vs-wall-clock curves
of all runs to one PNG, to show that the speed does not cost learning.

    .venv/bin/python benchmarks/bench_async.py                         # 3 rounds, ~10 min on 2 cores
    .venv/bin/python benchmarks/bench_async.py --rounds 1 --steps 6    # a quick look

Setup: engines are `mcore-rl serve` processes the trainer starts (disaggregated: the engine pinned
to one core, the trainer to the other, the same in every mode), the demo-sized model, a synthetic
prompt file whose budgets are long-tailed (a quarter of the prompts ask for 8x longer answers),
and the dense `digit_count` reward so there is something to learn. All runs use the same seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODES = {
    "sync": ["rollout.runtime=sync", "rollout.engine_processes=true"],
    "async s=1": ["rollout.runtime=async", "rollout.max_staleness=1"],
    "async s=2": ["rollout.runtime=async", "rollout.max_staleness=2"],
}


def write_prompts(path: str, n: int, short: int, long_factor: int, long_frac: float, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            a, b = rng.randrange(100), rng.randrange(100)
            budget = short * long_factor if rng.random() < long_frac else short
            f.write(json.dumps({"prompt": f"{a:02d}+{b:02d}=", "label": str(a + b), "max_new_tokens": budget}) + "\n")


def recipe(args: argparse.Namespace, run_dir: str, data: str) -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    engine_core = cores[-1]
    return [
        f"run_dir={run_dir}",
        f"data.path={data}",
        f"eval.path={data}",
        "eval.num_prompts=8",
        "eval.k=0",
        "eval.interval=0",
        "eval.at_start=false",
        "reward.name=tests.reward_fns:digit_count",
        f"train.num_steps={args.steps}",
        "train.seq_length=256",
        "train.micro_batch_size=4",
        f"rollout.group_size={args.group_size}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.max_new_tokens={args.short * args.long_factor}",
        "rollout.context_length=512",
        "rollout.quantization=none",
        f"rollout.engine_cores=[[{engine_core}]]",
        "rollout.engine_threads=1",
        f"algorithm.num_minibatches={args.minibatches}",
        "algorithm.mismatch.name=tis",
        "optimizer.lr=3e-4",
        "model.max_position_embeddings=512",
        f"train.seed={args.seed}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    ]


def run_once(args: argparse.Namespace, mode: str, run_dir: str, data: str) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    trainer_cores = set(cores[:-1]) or set(cores)
    cmd = [sys.executable, "-m", "mcore_rl.cli", "train", *recipe(args, run_dir, data), *MODES[mode]]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(len(trainer_cores)))
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, trainer_cores),
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(x) for x in f]
    steps = [r for r in recs if "time/step_s" in r]
    first = steps[0]["time/elapsed_s"] - steps[0]["time/step_s"]  # setup (imports, engines, first sync) excluded
    return {
        "process_s": time.perf_counter() - start,
        "loop_s": steps[-1]["time/elapsed_s"] - first,
        "gen_s": [r["time/rollout_wait_s"] for r in steps],
        "train_s": [r["time/train_s"] + r["time/sync_s"] for r in steps],
        "curve": [(r["time/elapsed_s"] - first, r["reward/mean"]) for r in steps],
        "staleness": max(r.get("async/staleness_max", 0.0) for r in steps),
        "engine_idle": statistics.mean(r.get("async/engine_idle_frac", float("nan")) for r in steps),
        "accounting": json.load(open(os.path.join(run_dir, "accounting.json"))),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--short", type=int, default=16, help="tokens of a short answer")
    p.add_argument("--long-factor", type=int, default=8)
    p.add_argument("--long-frac", type=float, default=0.25)
    p.add_argument("--minibatches", type=int, default=3, help="optimizer steps per rollout step (training cost)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "async_vs_sync.png"))
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="bench_async_")
    data = os.path.join(work, "prompts.jsonl")
    write_prompts(data, 2000, args.short, args.long_factor, args.long_frac, args.seed)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for k in range(args.rounds):
        for mode in MODES:
            out = run_once(args, mode, os.path.join(work, f"{mode.replace(' ', '_').replace('=', '')}_{k}"), data)
            results[mode].append(out)
            print(
                f"round {k + 1}/{args.rounds} {mode:>9}: loop {out['loop_s']:6.1f} s (process {out['process_s']:.1f} s)",
                flush=True,
            )

    sync = results["sync"]
    bound = [sum(max(g, t) for g, t in zip(r["gen_s"], r["train_s"])) for r in sync]
    serial = [sum(g + t for g, t in zip(r["gen_s"], r["train_s"])) for r in sync]
    med_sync = statistics.median(r["loop_s"] for r in sync)
    med_bound = statistics.median(bound)
    print(
        f"\n{args.steps} steps of {args.prompts} prompts x {args.group_size} samples, budgets {args.short} tokens "
        f"({args.long_frac:.0%} of prompts: {args.short * args.long_factor}); {args.rounds} rounds, median [min-max]"
    )
    print(
        f"sync phase times (median over rounds): generation {statistics.median(sum(r['gen_s']) for r in sync):.1f} s, "
        f"training+sync {statistics.median(sum(r['train_s']) for r in sync):.1f} s, their sum {statistics.median(serial):.1f} s; "
        f"ideal-overlap bound {med_bound:.1f} s = {med_sync / med_bound:.2f}x faster than sync"
    )
    print(
        f"{'mode':>10} {'loop s':>18} {'speed-up':>9} {'of bound':>9} {'max lag':>8} {'engine idle':>12} {'final reward':>13}"
    )
    for mode, runs in results.items():
        loops = [r["loop_s"] for r in runs]
        med = statistics.median(loops)
        print(
            f"{mode:>10} {med:7.1f} [{min(loops):5.1f}-{max(loops):5.1f}] {med_sync / med:8.2f}x {med_bound / med:8.0%} "
            f"{max(r['staleness'] for r in runs):8.0f} {statistics.median(r['engine_idle'] for r in runs):12.2f} "
            f"{statistics.median(r['curve'][-1][1] for r in runs):13.3f}"
        )
        for r in runs:
            assert r["accounting"]["balanced"], (mode, r["accounting"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for (mode, runs), color in zip(results.items(), ("tab:gray", "tab:blue", "tab:orange")):
            for i, r in enumerate(runs):
                xs, ys = zip(*r["curve"])
                ax.plot(xs, ys, color=color, alpha=0.7, label=mode if i == 0 else None)
        ax.set_xlabel("wall-clock s (after setup)")
        ax.set_ylabel("reward/mean (digit count)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"curves: {args.plot}")
    except ImportError:  # pragma: no cover
        pass


if __name__ == "__main__":
    main()
