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
    python benchmarks/bench_reward_model.py --steps 60 --seeds 2 --variants length+rrm_filtered --rounds 0
"""

from __future__ import annotations

import argparse
from typing import Any
import statistics
import tempfile

RRM_SOURCE_PAIRS = 1000  # training pairs whose counterfactuals the base RM scores (rrm_filtered)
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128"]


def _rm(run_dir: str, artifact: str, seed: int, steps: int, extra: list[str] | None = None) -> list[dict]:
    from mcore_rl.train.reward_model import run_rm

    return run_rm(_rm_cfg(run_dir, artifact, seed, steps, extra))


def _rm_cfg(run_dir: str, artifact: str, seed: int, steps: int, extra: list[str] | None = None) -> Any:
    from mcore_rl.config import load_config
    from mcore_rl.config.rm_schema import RMConfig

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
    return load_config(RMConfig, None, overrides + (extra or []))


def _rrm_filtered(run_dir: str, artifact: str, seed: int, steps: int) -> tuple[list[dict], int, int]:
    """RRM as the paper runs it: a base RM trained on the plain pairs scores the augmented pairs,
    those it gets wrong by >= 0.2 join the training pairs, a second RM trains on them. The held-out
    pairs (artefact reversed) are the data file's last rows, as `rm-train` holds out a file's."""
    import json
    import random

    import torch

    from mcore_rl.algos.reward_model import rrm_keep
    from mcore_rl.data.preferences import pair_rows, pair_to_json, rrm_augment, task_pairs
    from mcore_rl.train import reward_model as rm

    _rm(f"{run_dir}/base", artifact, seed, steps, [f"checkpoint.save_dir={run_dir}/base_ckpt"])
    base = rm.build_trainer(
        _rm_cfg(f"{run_dir}/base", artifact, seed, steps, [f"checkpoint.load_dir={run_dir}/base_ckpt"])
    )
    train = task_pairs("addition", 4000, seed, 2, artifact)
    source = train[:RRM_SOURCE_PAIRS]  # scoring every augmented pair of 4000 is too slow on a CPU
    augmented = rrm_augment(source, seed)[len(source) :]
    rows = pair_rows(augmented, 40, base.tokenizer)
    first, second = (
        rm.score_rows(
            base.chunks, {"tokens": rows[f"{s}_tokens"], "index": rows[f"{s}_index"], "head": rows["head"]}, 64
        )
        for s in ("chosen", "rejected")
    )
    keep = rrm_keep(first, second, torch.where(rows["tie"], 0.5, 1.0)).tolist()
    kept = [p for p, k in zip(augmented, keep) if k]
    data = train + kept
    random.Random(seed).shuffle(data)
    held = task_pairs("addition", 256, seed + rm.HELD_OUT_SEED_OFFSET, 2, artifact, reverse_artifact=True)
    path = f"{run_dir}/pairs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for pair in data + held:
            f.write(json.dumps(pair_to_json(pair)) + "\n")
    return _rm(f"{run_dir}/rrm", "none", seed, steps, [f"data.path={path}"]), len(kept), len(augmented)


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
    ap.add_argument(
        "--variants",
        default="none,length,format",
        help="data.artifact values; '+rrm' adds RRM's pairs unfiltered, '+rrm_filtered' those a base RM gets wrong",
    )
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_rm_")
    rows = []
    for variant in args.variants.split(","):
        artifact, _, rrm = variant.partition("+")
        accs, trains = [], []
        for seed in range(args.seeds):
            if rrm == "rrm_filtered":
                records, kept, made = _rrm_filtered(f"{tmp}/{variant}_{seed}", artifact, 1234 + seed, args.steps)
                print(f"{variant} seed {seed}: kept {kept} of {made} augmented pairs", flush=True)
            else:
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
