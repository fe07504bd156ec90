"""Reward-model figures of docs/reward_models.md, on one CPU rank.

1. Held-out pair accuracy of a reward model trained on addition pairs (verified answer vs a wrong
   one), plain and with a planted artefact on the correct answers (`data.artifact`: length, format),
   with or without RRM's augmentation (`+rrm`: `data.rrm=true`); the held-out pairs carry the
   artefact on the wrong answer, so a model that learned the artefact scores below chance there.
   Several seeds each.
2. Training throughput of `mcore-rl rm-train` against `mcore-rl sft` on the same model, sequence
   length and rows per step (a pair is two rows): median seconds per step, alternated A/B.

    python benchmarks/bench_reward_model.py --steps 60 --seeds 2 --throughput-steps 12 --rounds 2
    python benchmarks/bench_reward_model.py --steps 60 --seeds 2 --variants length+rrm,format+rrm --rounds 0
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128"]


def _rm(run_dir: str, artifact: str, seed: int, steps: int, extra: list[str] | None = None) -> list[dict]:
    from mcore_rl.config import load_config
    from mcore_rl.config.rm_schema import RMConfig
    from mcore_rl.train.reward_model import run_rm

    overrides = MODEL + [
        f"run_dir={run_dir}",
        f"train.seed={seed}",
        f"train.train_iters={steps}",
        "train.seq_length=40",
        "train.micro_batch_size=16",
        "train.global_batch_size=16",
        f"train.eval_interval={steps}",
        "train.eval_iters=16",  # 256 held-out pairs
        "train.log_interval=100000",
        "optimizer.lr=1e-3",
        "data.synthetic_max_digits=2",
        "data.synthetic_num_examples=4000",
        f"data.artifact={artifact}",
    ]
    return run_rm(load_config(RMConfig, None, overrides + (extra or [])))


def _sft(run_dir: str, steps: int) -> list[dict]:
    from mcore_rl.config import SFTConfig, load_config
    from mcore_rl.train.sft import run_sft

    overrides = MODEL + [
        f"run_dir={run_dir}",
        f"train.train_iters={steps}",
        "train.seq_length=40",
        "train.micro_batch_size=32",  # the rows of 16 pairs
        "train.global_batch_size=32",
        "train.log_interval=100000",
        "data.pack_sequences=false",
        "data.synthetic_max_digits=2",
        "data.synthetic_num_examples=4000",
    ]
    return run_sft(load_config(SFTConfig, None, overrides))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--throughput-steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3, help="A/B rounds of the throughput comparison (0: none)")
    ap.add_argument("--variants", default="none,length,format", help="data.artifact values, '+rrm' for RRM")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_rm_")
    rows = []
    for variant in args.variants.split(","):
        artifact, _, rrm = variant.partition("+")
        accs, trains = [], []
        for seed in range(args.seeds):
            extra = ["data.rrm=true"] if rrm else []
            records = _rm(f"{tmp}/{variant}_{seed}", artifact, 1234 + seed, args.steps, extra)
            accs.append(records[-1]["eval_accuracy"])
            trains.append(statistics.mean(r["accuracy"] for r in records[-20:]))
        rows.append((variant, accs, trains))
        print(f"{variant}: held-out {accs}, train (last 20 steps) {trains}", flush=True)
    print("\n| data.artifact | held-out pair accuracy (per seed) | median | train accuracy, last 20 steps (median) |")
    print("| --- | --- | --- | --- |")
    for variant, accs, trains in rows:
        per_seed = ", ".join(f"{a:.1%}" for a in accs)
        print(f"| {variant} | {per_seed} | {statistics.median(accs):.1%} | {statistics.median(trains):.1%} |")

    if not args.rounds:
        return
    rm_times, sft_times = [], []
    for r in range(args.rounds):  # alternate, so a neighbour's load hits both alike
        skip = 5  # the first steps warm up
        rm = _rm(f"{tmp}/tp_rm_{r}", "none", 1, args.throughput_steps, ["train.eval_interval=0"])
        rm_times.append(statistics.median(x["time/train_s"] for x in rm[skip:]))
        sft = _sft(f"{tmp}/tp_sft_{r}", args.throughput_steps)
        sft_times.append(statistics.median(x["time/train_s"] for x in sft[skip:]))
    print("\n| command | median s/step per round | median | spread (max-min) |")
    print("| --- | --- | --- | --- |")
    for name, times in (("rm-train (16 pairs = 32 rows x 40)", rm_times), ("sft (32 rows x 40)", sft_times)):
        print(
            f"| {name} | {', '.join(f'{t:.3f}' for t in times)} | {statistics.median(times):.3f} | "
            f"{max(times) - min(times):.3f} |"
        )


if __name__ == "__main__":
    main()
