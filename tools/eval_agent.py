"""Held-out accuracy of checkpoints on a recipe's environment domains, with the tools and without.

Builds the recipe's held-out prompts exactly as `mcore-rl train` does (`build_prompt_sets` with the
environments' own examples: the same questions, disjoint from the training pool) and runs one greedy
episode per question with the embedded engine, through the trainer's own episode code
(`agent.episodes.Episode`, the synchronous driver `run_lockstep`). Two modes per checkpoint:

- `tool`: the domain's environment as the recipe configures it (its tools, its tool-call format);
- `plain`: the same environment and questions with no tools offered and tool format `none`, so the
  first turn is the answer (the system prompt is the environment's tool-free one).

Per domain and mode it prints the accuracy (return >= 1), the tool-call rate (episodes with at least
one call the tools ran), the invalid-call rate (episodes with at least one invalid call: unparseable,
unknown tool, bad arguments), the mean number of model turns and how the episodes ended.

    .venv/bin/python tools/eval_agent.py configs/smollm2_python_tool.yaml \\
        --models base=runs/smollm2/hf rl=runs/smollm2_python_tool/hf --show 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mcore_rl.config.rl_schema import DomainConfig, EnvironmentConfig, RLConfig
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.progress import log_line
from mcore_rl.rollout.pool import Generation, GenRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eval_heldout import parse_recipe_args

MODES = ("tool", "plain")


class Generates(Protocol):
    """What runs the model turns: an `EmbeddedEnginePool` here (any batch generator in the tests)."""

    def generate(self, requests: Sequence[GenRequest]) -> list[Generation]: ...


@dataclass
class ModeResult:
    """One checkpoint, one mode, one domain: per-episode outcomes."""

    correct: list[bool] = field(default_factory=list)
    called: list[bool] = field(default_factory=list)  # the tools ran at least one call
    invalid: list[bool] = field(default_factory=list)  # at least one invalid call or turn
    turns: list[int] = field(default_factory=list)
    finish: Counter[str] = field(default_factory=Counter)
    shown: list[str] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        n = max(len(self.correct), 1)
        return {
            "n": float(len(self.correct)),
            "accuracy": sum(self.correct) / n,
            "tool_call_rate": sum(self.called) / n,
            "invalid_rate": sum(self.invalid) / n,
            "turns_mean": sum(self.turns) / n,
        }


def plain_environment(env: EnvironmentConfig) -> EnvironmentConfig:
    """The environment with no tools: the first turn is the final answer."""
    options = {k: v for k, v in env.options.items() if k != "system_prompt"}
    return dataclasses.replace(env, options={**options, "tools": []}, tool_format="none")


def mode_config(cfg: RLConfig, mode: str) -> RLConfig:
    """`cfg` with every environment domain in `mode`."""
    if mode == "tool":
        return cfg
    domains: list[DomainConfig] = [
        dataclasses.replace(d, environment=plain_environment(d.environment)) if d.environment is not None else d
        for d in cfg.data.domains
    ]
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, domains=domains))


def outcome(samples: list[Sample]) -> tuple[bool, bool, bool, int, str]:
    """(correct, called a tool, made an invalid call, turns, finish) of one episode's samples."""
    first = samples[0]
    info = first.info
    events = {k.removeprefix("episode/events/"): int(v) for k, v in info.items() if k.startswith("episode/events/")}
    called = events.get("tool_call", 0) > 0
    invalid = int(info.get("episode/invalid_turns", 0)) > 0 or events.get("invalid_call", 0) > 0
    return (
        float(info.get("episode/return", 0.0)) >= 1.0,
        called,
        invalid,
        int(info.get("episode/turns", 0)),
        str(info.get("episode/finish", "abort")),
    )


def run_mode(
    cfg: RLConfig, pool: Generates, tokenizer: Tokenizer, prompts: list[Prompt], show: int
) -> dict[str, ModeResult]:
    """One greedy episode per held-out prompt of the environment domains; per-domain results."""
    from mcore_rl.agent.episodes import run_lockstep  # lazy: the engine stack
    from mcore_rl.agent.groups import EpisodeGroups

    groups = EpisodeGroups.from_config(cfg, tokenizer)
    if groups is None:
        raise SystemExit("the recipe has no environment domain (data.domains[i].environment)")
    mine = [p for p in prompts if groups.handles(p)]
    episodes = [e for p in mine for e in groups.episodes(p, [{"temperature": 0.0}])]
    try:
        run_lockstep(episodes, pool.generate)
    finally:
        for e in episodes:
            e.close()
    results: dict[str, ModeResult] = {}
    for p, e in zip(mine, episodes):
        r = results.setdefault(p.domain, ModeResult())
        samples = e.samples()
        correct, called, invalid, turns, finish = outcome(samples)
        r.correct.append(correct)
        r.called.append(called)
        r.invalid.append(invalid)
        r.turns.append(turns)
        r.finish[finish] += 1
        if len(r.shown) < show:
            if e.settings.trajectory == "stepwise":  # each step's own prompt and turn
                text = "\n".join(
                    f"[step {t}] " + e.chat.decode(st.prompt_ids + st.out.ids) for t, st in enumerate(e.steps)
                )
            else:
                text = e.chat.decode(e.trajectory.current.all_ids)
            r.shown.append(
                f"--- {p.domain} (answer {p.label.get('answer') if isinstance(p.label, dict) else p.label!r}, "
                f"return {e.episode_return}, {finish}):\n{text}"
            )
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, with the recipe's dotted overrides allowed anywhere (as in `eval_heldout.py`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--models", nargs="+", required=True, help="name=HF checkpoint dir")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--show", type=int, default=0, help="print this many episodes per domain, mode and model")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument(
        "overrides", nargs="*", help="dotted overrides of the recipe, e.g. data.domains[0].eval.num_prompts=20"
    )
    return parse_recipe_args(ap, argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)

    from mcore_rl.agent.groups import environment_examples  # lazy: the engine stack
    from mcore_rl.config import load_config
    from mcore_rl.data.prompts import build_prompt_sets
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.pool import EmbeddedEnginePool

    cfg = load_config(RLConfig, args.config, args.overrides)
    tok = load_tokenizer(cfg.data.tokenizer_path)
    prompts = build_prompt_sets(cfg, tok, environment_examples).eval_prompts
    figures: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for spec in args.models:
        name, path = spec.split("=", 1)
        log_line(f"{name}: loading {path}")
        engine = EngineCore.from_model_path(
            path, dtype=args.dtype, max_running_requests=64, context_length=cfg.rollout.context_length
        )
        pool = EmbeddedEnginePool([engine])
        for mode in args.modes:
            t0 = time.perf_counter()
            results = run_mode(mode_config(cfg, mode), pool, tok, prompts, args.show)
            dt = time.perf_counter() - t0
            for domain, r in results.items():
                figures.setdefault(name, {}).setdefault(mode, {})[domain] = {**r.row(), "seconds": dt}
                for text in r.shown:
                    print(text)
                row = r.row()
                print(
                    f"{name:8s} {mode:5s} {domain:16s} n={int(row['n']):3d} accuracy {row['accuracy']:6.1%}  "
                    f"tool calls {row['tool_call_rate']:6.1%}  invalid {row['invalid_rate']:6.1%}  "
                    f"turns {row['turns_mean']:.2f}  {dict(r.finish)}  {dt:.0f} s",
                    flush=True,
                )
        del engine, pool
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
