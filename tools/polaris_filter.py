"""POLARIS's offline difficulty filter: sample 8 rollouts per training prompt with the embedded
engine, score them with the recipe's reward, keep the prompts the model does not solve every time.

Reads the recipe's training pool exactly as `mcore-rl train` does (a `data.path` file or the
synthetic task's pool, held-out prompts removed; one data source), renders and encodes each prompt
the same way, generates `--rollouts` samples per prompt at `rollout.temperature` (or
`--temperature`) with per-sample seeds, and scores them in the reward workers. Writes the kept
prompts as jsonl (`prompt_key`, `label_key`, plus `pass_rate`) and prints the pass-rate histogram
(also written next to the output as `<out>.histogram.json`).

Selections (`algos/polaris.py: offline_selection`): `below_one` keeps every prompt with pass rate
< 1 (8/8 dropped, 0/8 kept); `mirrored_j` thins those to a histogram that never rises with the
pass rate (skewed to hard prompts, the shape POLARIS aims for).

    .venv/bin/python tools/polaris_filter.py configs/demo.yaml --model-path runs/demo/hf \
        --out runs/demo/polaris_pool.jsonl --num 2000 [key=value ...]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch


def sample_pool(
    cfg: Any, engine: Any, tok: Any, pool: list, rollouts: int, temperature: float, seed: int
) -> list[list[float]]:
    """Rewards [prompt][rollout] of `rollouts` samples of every (text, label) in `pool`."""
    from mcore_rl.data.prompts import PromptSource
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.rollout.engine import Request, SamplingParams
    from mcore_rl.runtime.rollout_manager import build_reward_runner, sample_seed

    d = cfg.data
    domain = d.synthetic_task if d.path is None else d.path
    src = PromptSource(pool, tok, seed, d.add_bos, domain)
    prompts = [Prompt(i, text, src.encode(text), label, domain) for i, (text, label, *_) in enumerate(pool)]
    r = cfg.rollout
    for p in prompts:
        for j in range(rollouts):
            sp = SamplingParams(
                max_new_tokens=r.max_new_tokens,
                temperature=temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                sampling_seed=sample_seed(seed, 5, p.index, j),
            )
            engine.add_request(Request(f"{p.index}-{j}", list(p.ids), sp))
    outs: dict[str, Any] = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                outs[o.rid] = o
    samples = [
        Sample(p, p.index, list(outs[f"{p.index}-{j}"].output_ids), [], 0, "stop", outs[f"{p.index}-{j}"].text or "")
        for p in prompts
        for j in range(rollouts)
    ]
    rewards = build_reward_runner(cfg)
    try:
        rewards.score_sync(samples)
    finally:
        rewards.close()
    return [[s.reward for s in samples[i * rollouts : (i + 1) * rollouts]] for i in range(len(prompts))]


def training_pool(cfg: Any, tok: Any) -> list:
    """The recipe's training pool, (text, label, ...) tuples, as `build_prompt_sets` builds it."""
    from mcore_rl.data.prompts import build_prompt_sets

    if cfg.data.domains:
        raise SystemExit("polaris_filter: one data source only (data.path or data.synthetic_task), not data.domains")
    train = build_prompt_sets(cfg, tok).train
    return list(train.pool if hasattr(train, "pool") else next(iter(train.sources.values())).pool)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--model-path", default=None, help="an HF checkpoint dir (None: the built-in demo model)")
    ap.add_argument("--out", required=True, help="the kept prompts (.jsonl)")
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--num", type=int, default=0, help="the first N prompts of the pool (0 = all)")
    ap.add_argument("--mode", default="below_one", choices=["below_one", "mirrored_j"])
    ap.add_argument("--temperature", type=float, default=None, help="default: rollout.temperature")
    ap.add_argument("--correct-reward", type=float, default=1.0, help="a rollout is correct when reward >= this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)

    from mcore_rl.algos.polaris import histogram, offline_selection, pass_rates
    from mcore_rl.config import load_config
    from mcore_rl.config.rl_schema import RLConfig
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine import EngineCore

    cfg = load_config(RLConfig, args.config, args.overrides)
    tok = load_tokenizer(cfg.data.tokenizer_path if args.model_path is None else args.model_path)
    pool = training_pool(cfg, tok)
    if args.num:
        pool = pool[: args.num]
    engine = EngineCore.from_model_path(
        args.model_path, max_running_requests=256, context_length=cfg.rollout.context_length, random_seed=args.seed
    )
    temperature = args.temperature if args.temperature is not None else cfg.rollout.temperature
    rewards = sample_pool(cfg, engine, tok, pool, args.rollouts, temperature, args.seed)
    flat = torch.tensor([x for row in rewards for x in row], dtype=torch.float64)
    ids = torch.arange(len(pool)).repeat_interleave(args.rollouts)
    rates_by = pass_rates(flat, ids, args.correct_reward)
    rates = [rates_by[i] for i in range(len(pool))]
    keep = offline_selection(rates, args.mode, bins=args.rollouts, seed=args.seed)
    d = cfg.data
    with open(args.out, "w") as f:
        for i in keep:
            text, label = pool[i][0], pool[i][1]
            f.write(json.dumps({d.prompt_key: text, d.label_key: label, "pass_rate": rates[i]}) + "\n")
    report = {
        "prompts": len(pool),
        "kept": len(keep),
        "mode": args.mode,
        "rollouts": args.rollouts,
        "histogram": histogram(rates, args.rollouts),
        "kept_histogram": histogram([rates[i] for i in keep], args.rollouts),
    }
    with open(args.out + ".histogram.json", "w") as f:
        json.dump(report, f, indent=1)
    print(f"{len(pool)} prompts, {args.rollouts} rollouts each; kept {len(keep)} ({args.mode}) -> {args.out}")
    print("pass rate | prompts | kept")
    for k, (n, m) in enumerate(zip(report["histogram"], report["kept_histogram"])):
        print(f"{k}/{args.rollouts:<7d} | {n:7d} | {m:4d}")
    return report


if __name__ == "__main__":
    main()
