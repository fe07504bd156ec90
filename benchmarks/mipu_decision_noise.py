"""How noisy is MIPU's Step 2 decision on the demo, and how large a validation batch makes it stable?

    .venv/bin/python benchmarks/mipu_decision_noise.py            # the docs/mismatch_correction.md numbers
    .venv/bin/python benchmarks/mipu_decision_noise.py --at 0 5 --pool 256 --sizes 8 32 -- rollout.quantization=none

1. The demo's SFT warm start, saved as a checkpoint (reused if WORK/sft holds one):
   `mcore-rl train configs/demo.yaml train.num_steps=0 checkpoint.save_dir=WORK/sft`.
2. In this process, the demo with `algorithm.mismatch.name=mipu` from that checkpoint: RL steps
   with MIPU's Step 1 loss and a weight sync after each (Step 2 does not gate them here: every
   update is kept, so all sizes are measured on the same weights).
3. After `--at` RL steps: `--pool` fresh validation prompts × `--group-size` samples from the
   synced FP8 engine, exactly as `recipes/mipu.py: MIPU.after_sync` draws them (validation stream, its sampling
   salt), π recomputed by the learner, per-group terms s_g = -Σ ρ_i Â_i. The pool is cut into
   disjoint validation batches of K prompts for each K of `--sizes`: those are independent
   batches of the size the loop would draw (groups are i.i.d.), not bootstrap copies.
4. Per K: mean T̂_post over the batches, their empirical SD, the formula's SE (mean over batches),
   |mean|/SD, the accept rate of the plain rule at c = 1e-3 and c = 0 and of the "se" rule, how
   often two independent batches disagree (c = 1e-3), and the logged flip estimates (normal
   approximation, group bootstrap). The pooled T̂_post over all groups ± its SE says where the
   true value lies; K_needed is the batch size whose SE would be `--target` (SE ∝ 1/√K).

Writes WORK/noise.json and prints markdown tables.
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


def sft_checkpoint(recipe: str, work: str, common: list[str]) -> str:
    sft = os.path.join(work, "sft")
    if os.path.exists(os.path.join(sft, "latest")):
        return sft
    log = os.path.join(work, "sft.log")
    cmd = [
        sys.executable,
        "-m",
        "mcore_rl.cli",
        "train",
        recipe,
        f"run_dir={work}/sft_run",
        "train.num_steps=0",
        f"checkpoint.save_dir={sft}",
        "eval.at_start=false",
        "logging.plot=false",
        *common,
    ]
    print("SFT warm start ...", flush=True)
    with open(log, "w") as f:
        if subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE) != 0:
            raise SystemExit(f"SFT warm start failed, see {log}")
    return sft


def draw_pool(run, learner, prompts, group_size: int, chunk: int = 128):
    """(s_g, n_g, informative_g, mean reward) for validation groups from the synced engine: `prompts`
    fresh ones (an int) or these prompts (a list: the same sampling seeds as any earlier draw)."""
    import torch

    from mcore_rl.algos.mipu import validation_estimate
    from mcore_rl.runtime.rollout_manager import SALT_VALIDATION
    from mcore_rl.train.packing import sequence_view

    sums, counts, informative, rewards = [], [], [], []
    total = prompts if isinstance(prompts, int) else len(prompts)
    for start in range(0, total, chunk):
        if isinstance(prompts, int):
            batch = run.val_prompts.take(min(chunk, total - start))
        else:
            batch = prompts[start : start + chunk]
        groups = run.manager.generate(batch, group_size, run.manager.temperature, SALT_VALIDATION)
        samples = [s for g in groups for s in g]
        view = sequence_view(samples)
        pi, _ = learner.token_logprobs(samples, view.mask.shape[1])
        est = validation_estimate(
            pi, view.rollout_logp, view.mask * view.ok[:, None], view.rewards, view.group_ids, valid=view.ok.bool()
        )
        sums.append(est.group_sums)
        counts.append(est.group_counts)
        _, inv = torch.unique(view.group_ids[view.ok.bool()], return_inverse=True)
        r = view.rewards[view.ok.bool()].double()
        k = est.group_sums.numel()
        lo = torch.full((k,), math.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amin")
        hi = torch.full((k,), -math.inf, dtype=torch.float64).scatter_reduce(0, inv, r, "amax")
        informative.append(hi > lo)
        rewards.append(float(view.rewards.mean()))
    return torch.cat(sums), torch.cat(counts), torch.cat(informative), sum(rewards) / len(rewards)


def per_size(sums, counts, k: int, c: float, z: float, boot: int) -> dict:
    import torch

    from mcore_rl.algos.mipu import bootstrap_flip_rate, decide, flip_probability, ratio_se

    n = sums.numel() // k
    ts, ses, plain, plain0, se_rule, flips, bflips = [], [], [], [], [], [], []
    for b in range(n):
        s, m = sums[b * k : (b + 1) * k], counts[b * k : (b + 1) * k]
        t, se = ratio_se(s, m)
        ts.append(t)
        ses.append(se)
        plain.append(decide(t, se, c, "plain"))
        plain0.append(decide(t, se, 0.0, "plain"))
        se_rule.append(decide(t, se, c, "se", z))
        flips.append(flip_probability(t, se, c))
        bflips.append(bootstrap_flip_rate(s, m, c, boot, seed=b) if boot > 0 else float("nan"))
    tt = torch.tensor(ts, dtype=torch.float64)
    mean, sd = float(tt.mean()), float(tt.std()) if n > 1 else float("nan")
    p = sum(plain) / n
    return {
        "K": k,
        "batches": n,
        "mean_t": mean,
        "sd_t": sd,
        "mean_se": sum(ses) / n,
        "abs_mean_over_sd": abs(mean) / sd if sd and math.isfinite(sd) else float("nan"),
        "accept_plain_c": p,
        "accept_plain_0": sum(plain0) / n,
        "accept_se_rule": sum(se_rule) / n,
        "disagree_two_batches": 2 * p * (1 - p) * n / (n - 1) if n > 1 else float("nan"),
        "flip_prob_normal": sum(flips) / n,
        "flip_bootstrap": sum(bflips) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/demo.yaml")
    parser.add_argument("--work", default="runs/mipu_noise")
    parser.add_argument("--at", nargs="+", type=int, default=[0, 10, 30], help="measure after these RL steps")
    parser.add_argument("--pool", type=int, default=512, help="validation prompts drawn per measurement")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--sizes", nargs="+", type=int, default=[8, 32, 128], help="validation prompts per batch")
    parser.add_argument("--c", type=float, default=1e-3, help="tolerance c_t (the demo's c_start)")
    parser.add_argument("--z", type=float, default=2.0, help="the 'se' rule's z")
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--target", type=float, default=None, help="SE to size K_needed for (default c/3)")
    parser.add_argument("--out", default="noise.json", help="file name under WORK")
    parser.add_argument(
        "--crn",
        action="store_true",
        help="also: the same prompts and sampling seeds before and after one more update (common "
        "random numbers): how noisy is the change of T̂_post that one update makes",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides (after --)")
    args = parser.parse_args()
    target = args.target if args.target is not None else args.c / 3
    work = os.path.join(HERE, args.work)
    os.makedirs(work, exist_ok=True)
    common = ["logging.progress_bar=false", "logging.tensorboard=false", *args.overrides]
    sft = sft_checkpoint(args.recipe, work, common)

    import torch

    from mcore_rl.config import RLConfig, load_config, validate_rl_config
    from mcore_rl.algos.mipu import ratio_se
    from mcore_rl.parallel import setup
    from mcore_rl.runtime.loop import RLRun
    from mcore_rl.train.rl_step import Learner

    cfg = load_config(
        RLConfig,
        os.path.join(HERE, args.recipe),
        [
            f"run_dir={work}/probe_{os.path.splitext(args.out)[0]}",
            "init.sft_steps=0",
            f"init.checkpoint={sft}",
            "algorithm.mismatch.name=mipu",
            "eval.at_start=false",
            "eval.interval=0",
            "logging.plot=false",
            f"train.num_steps={max(max(args.at), 1)}",
            *common,
        ],
    )
    validate_rl_config(cfg, 1)
    run = RLRun(cfg)
    results = []
    t0 = time.perf_counter()
    try:
        run.initialise()
        learner = Learner(cfg, run.chunks, run.optimizer, run.ref_chunks, run.tokenizer.pad_id)
        step = 0
        for at in sorted(set(args.at)):
            while step < at:
                samples, _ = run.rollouts()
                learner.train(samples, step)
                run.sync()
                step += 1
                run.state.rl_step = step
            start = time.perf_counter()
            sums, counts, informative, reward = draw_pool(run, learner, args.pool, args.group_size)
            t_all, se_all = ratio_se(sums, counts)
            sd_g = se_all * math.sqrt(sums.numel())  # SE of one group: SE_K = sd_g / √K
            row = {
                "rl_step": at,
                "weight_version": run.state.version,
                "groups": sums.numel(),
                "validation_reward": reward,
                "informative_frac": float(informative.double().mean()),
                "pooled_t": t_all,
                "pooled_se": se_all,
                "K_needed": math.ceil((sd_g / target) ** 2),
                "target_se": target,
                "draw_s": time.perf_counter() - start,
                "sizes": [
                    per_size(sums, counts, k, args.c, args.z, args.bootstrap)
                    for k in args.sizes
                    if sums.numel() // k >= 2
                ],
            }
            if args.crn:
                fixed = run.val_prompts.take(args.pool)
                s0, n0, _, _ = draw_pool(run, learner, fixed, args.group_size)
                samples, _ = run.rollouts()
                learner.train(samples, step)
                run.sync()
                step += 1
                run.state.rl_step = step
                s1, n1, _, _ = draw_pool(run, learner, fixed, args.group_size)
                a, b = s0 / n0, s1 / n1
                d = b - a
                k = d.numel()
                row["crn"] = {
                    "groups": k,
                    "t_before": float(a.mean()),
                    "t_after": float(b.mean()),
                    "delta": float(d.mean()),
                    "se_delta_crn": float(d.std()) / math.sqrt(k),
                    "se_delta_independent": math.sqrt(float(a.var()) + float(b.var())) / math.sqrt(k),
                    "corr": float(torch.corrcoef(torch.stack([a, b]))[0, 1]),
                }
            results.append(row)
            print(
                f"step {at}: pooled T̂_post {t_all:+.2e} ± {se_all:.1e} over {sums.numel()} groups "
                f"({row['draw_s']:.0f} s)",
                flush=True,
            )
    finally:
        run.close()
        setup.destroy()
    out = {"args": vars(args), "results": results, "wall_s": time.perf_counter() - t0}
    with open(os.path.join(work, args.out), "w") as f:
        json.dump(out, f, indent=1)
    for row in results:
        print(
            f"\n### after {row['rl_step']} RL steps: pooled T̂_post = {row['pooled_t']:+.2e} ± {row['pooled_se']:.1e} "
            f"({row['groups']} groups × {args.group_size}, {100 * row['informative_frac']:.0f}% with mixed rewards, "
            f"validation reward {row['validation_reward']:.3f}); SE {target:.1e} needs K ≈ {row['K_needed']} prompts\n"
        )
        print(
            "| K prompts × G | batches | mean T̂_post | SD over batches | formula SE | abs(mean)/SD | "
            f"accept (c={args.c:g}) | accept (c=0) | accept ('se', z={args.z:g}) | two batches disagree | "
            "flip prob (normal) | flip (bootstrap) |"
        )
        print("| --- |" + " ---: |" * 11)
        for s in row["sizes"]:
            print(
                f"| {s['K']} × {args.group_size} | {s['batches']} | {s['mean_t']:+.2e} | {s['sd_t']:.2e} | "
                f"{s['mean_se']:.2e} | {s['abs_mean_over_sd']:.2f} | {100 * s['accept_plain_c']:.0f}% | "
                f"{100 * s['accept_plain_0']:.0f}% | {100 * s['accept_se_rule']:.0f}% | "
                f"{100 * s['disagree_two_batches']:.0f}% | {s['flip_prob_normal']:.2f} | {s['flip_bootstrap']:.2f} |"
            )
    crn = [row for row in results if "crn" in row]
    if crn:
        print("\n### common random numbers: the change of T̂_post over one update, same prompts and seeds\n")
        print(
            "| after RL step | groups | T̂ before | T̂ after | change | SE of change (CRN) | SE (independent batches) "
            "| corr(s_g before, after) | SE ratio at any K |"
        )
        print("| --- |" + " ---: |" * 8)
        for row in crn:
            c = row["crn"]
            print(
                f"| {row['rl_step']} → {row['rl_step'] + 1} | {c['groups']} | {c['t_before']:+.2e} | "
                f"{c['t_after']:+.2e} | {c['delta']:+.2e} | {c['se_delta_crn']:.1e} | {c['se_delta_independent']:.1e} | "
                f"{c['corr']:.2f} | {c['se_delta_crn'] / c['se_delta_independent']:.2f} |"
            )
    print(f"\nwall {out['wall_s']:.0f} s; {os.path.join(work, args.out)}")


if __name__ == "__main__":
    main()
