"""A recipe's held-out sets scored for several HF checkpoints: per task, with paired confidence
intervals of the change.

Builds the recipe's prompt sets exactly as `mcore-rl train` does (`build_prompt_sets`: the same
held-out questions, disjoint from the training prompts, the same chat rendering and budgets),
generates with the embedded engine (greedy, and optionally `--k` samples per question at the
rollout temperature, one engine seed per `--seeds` entry), and scores each completion with the
domain's training rewards in the reward workers. For every checkpoint after the first it prints
the per-task change against the first with a 95% paired bootstrap interval over the questions
(10,000 resamples): the spread that comes from which questions were drawn. With several seeds,
the spread of sampled accuracy between evaluation runs is printed too.

    .venv/bin/python tools/eval_heldout.py configs/smollm2_reasoning.yaml \
        --models base=runs/smollm2/hf rl=runs/smollm2_reasoning/hf --k 4 --seeds 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import numpy as np

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.progress import log_line, progress

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from screen_tasks import generate


def score(cfg, engine, tok, rewards, prompts, n: int, temperature: float, seed: int, desc: str) -> np.ndarray:
    """[questions, n] rewards >= 1 (right) of n completions per held-out question; a progress bar
    of the completions (a real model's pass takes minutes)."""
    from mcore_rl.data.samples import Sample

    out = np.zeros((len(prompts), n))
    by_budget: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_budget.setdefault(
            min(p.max_new_tokens or cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens), []
        ).append(i)
    with progress(len(prompts) * n, desc, unit="completion") as bar:
        for budget, idx in by_budget.items():
            groups, _, _ = generate(engine, [prompts[i].ids for i in idx], n, temperature, budget, seed, bar)
            samples = [
                Sample(prompts[i], i, o.output_ids, [], 0, "stop", tok.decode(o.output_ids, skip_special_tokens=True))
                for i, g in zip(idx, groups)
                for o in g
            ]
            rewards.score_sync(samples)
            for k, s in enumerate(samples):
                out[idx[k // n], k % n] = float(s.reward >= 1.0)
    return out


def paired_ci(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    d = b - a
    means = d[rng.integers(0, len(d), (10_000, len(d)))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with the recipe's dotted overrides allowed anywhere: after `--models a=x b=y` or
    `--seeds 1 2` too, where argparse would read them as one more model or an invalid seed. A word
    is an override when the part before its `=` starts with a section of the recipe (`eval.k=1`,
    `run_dir=x`); a model is named so that it does not."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--models", nargs="+", required=True, help="name=HF checkpoint dir; the first is the baseline")
    ap.add_argument("--k", type=int, default=0, help="sampled completions per question (0 = greedy only)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("overrides", nargs="*", help="dotted overrides of the recipe, e.g. eval.num_prompts=50")
    return parse_recipe_args(ap, argv)


def parse_recipe_args(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`ap` (with `--models` and a positional `overrides`) over `argv`, the overrides taken out first
    wherever they stand; every model named `name=HF checkpoint dir` (also for `eval_agent.py`)."""
    sections = {f.name for f in dataclasses.fields(RLConfig)}
    is_override = [re.split(r"[.\[=]", w, maxsplit=1)[0] in sections and "=" in w for w in argv]
    args = ap.parse_args([w for w, o in zip(argv, is_override) if not o])
    args.overrides += [w for w, o in zip(argv, is_override) if o]
    for spec in args.models:
        if "=" not in spec:
            ap.error(f"--models: {spec!r} is not name=HF checkpoint dir")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    from mcore_rl.config import load_config
    from mcore_rl.data.prompts import build_prompt_sets
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine import EngineCore
    from mcore_rl.runtime.rollout_manager import build_reward_runner

    cfg = load_config(RLConfig, args.config, args.overrides)
    log_line(f"{args.config}: building the held-out sets and the reward workers")
    tok = load_tokenizer(cfg.data.tokenizer_path)
    prompts = build_prompt_sets(cfg, tok).eval_prompts
    domains = list(dict.fromkeys(p.domain for p in prompts))
    rewards = build_reward_runner(cfg)
    results: dict[str, dict[str, np.ndarray]] = {}
    try:
        for spec in args.models:
            name, path = spec.split("=", 1)
            log_line(f"{name}: loading {path}")
            engine = EngineCore.from_model_path(
                path, dtype=args.dtype, max_running_requests=64, context_length=cfg.rollout.context_length
            )
            results[name] = {"greedy": score(cfg, engine, tok, rewards, prompts, 1, 0.0, 0, f"{name} greedy")[:, 0]}
            for s in args.seeds if args.k else []:
                results[name][f"avg@{args.k} seed {s}"] = score(
                    cfg,
                    engine,
                    tok,
                    rewards,
                    prompts,
                    args.k,
                    cfg.rollout.temperature,
                    1000 * s,
                    f"{name} avg@{args.k} seed {s}",
                ).mean(axis=1)
            del engine
    finally:
        rewards.close()
    rng = np.random.default_rng(0)
    names = list(results)
    base = names[0]
    print(
        f"held-out sets of {args.config}: {', '.join(f'{d} {sum(p.domain == d for p in prompts)}' for d in domains)} "
        "questions"
    )
    for metric in results[base]:
        print(f"\n{metric}:")
        print("| task | " + " | ".join(names) + " | " + " | ".join(f"{n} - {base} (95% CI)" for n in names[1:]) + " |")
        print("| --- |" + " ---: |" * (2 * len(names) - 1))
        for d in [*domains, "mean"]:
            mine = np.array([d == "mean" or p.domain == d for p in prompts])
            if d == "mean":  # the mean of the tasks' accuracies (each task weighs the same)
                vals = {
                    n: np.mean([results[n][metric][[p.domain == x for p in prompts]].mean() for x in domains])
                    for n in names
                }
            else:
                vals = {n: results[n][metric][mine].mean() for n in names}
            cells = [f"{vals[n]:.1%}" for n in names]
            for n in names[1:]:
                if d == "mean":
                    per = [
                        (results[n][metric] - results[base][metric])[[p.domain == x for p in prompts]] for x in domains
                    ]
                    boots = np.mean([x[rng.integers(0, len(x), (10_000, len(x)))].mean(axis=1) for x in per], axis=0)
                    lo, hi = np.percentile(boots, 2.5), np.percentile(boots, 97.5)
                else:
                    lo, hi = paired_ci(results[base][metric][mine], results[n][metric][mine], rng)
                cells.append(f"{vals[n] - vals[base]:+.1%} ({lo:+.1%} .. {hi:+.1%})")
            print(f"| {d} | " + " | ".join(cells) + " |")
    seeds = [m for m in results[base] if m.startswith("avg@")]
    if len(seeds) > 1:
        print("\nspread of sampled accuracy between evaluation runs (mean over tasks, max - min over seeds):")
        for n in names:
            means = [np.mean([results[n][m][[p.domain == x for p in prompts]].mean() for x in domains]) for m in seeds]
            print(f"  {n}: {', '.join(f'{v:.1%}' for v in means)} (spread {max(means) - min(means):.1%})")


if __name__ == "__main__":
    main()
