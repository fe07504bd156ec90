"""Held-out evaluation through the engine: what the *inference* policy (FP8 or not) scores.

Greedy pass@1 (one temperature-0 completion per prompt) and, with k > 0, k sampled completions per
prompt: avg@k (mean reward over all k·P completions, an estimate of sampled pass@1) and pass@k (a
prompt counts if any of its k completions is right). Rewards are those of the training reward
function(s) of each prompt's domain; a completion counts as right when its reward is >=
`eval.correct_threshold` (1 for 0/1 verifiers), or the domain's own `eval.correct_threshold`. A multi-domain run also reports every number per domain
(`eval/<domain>/score`, ...), with each domain's own sampling parameters; `eval/score` is then
the mean of the domains' scores, so a large domain does not hide a small one.
"""

from __future__ import annotations

import numpy as np

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.data.samples import Prompt, Sample
from mcore_rl.progress import progress
from mcore_rl.runtime.rollout_manager import SALT_EVAL, RolloutManager


def outcomes(group: list[Sample]) -> list[float]:
    """The rewards of a group's attempts: one per sample, or one per episode where the samples are an
    episode's (a multi-turn episode may be several samples, all carrying its return)."""
    seen: dict[int, float] = {}
    plain = []
    for s in group:
        if s.episode is None:
            plain.append(s.reward)
        else:
            seen.setdefault(s.episode, s.reward)
    return plain + list(seen.values())


def _scores(
    greedy: list[list[Sample]], sampled: list[list[Sample]], cfg: RLConfig, thresholds: list[float], prefix: str
) -> dict[str, float]:
    """`thresholds`: one per prompt (its domain's), in the order of `greedy` and `sampled`."""
    e, out = cfg.eval, {}
    if e.greedy:
        first = [(outcomes(g) or [0.0])[0] for g in greedy]
        out[f"{prefix}/greedy_pass@1"] = float(np.mean([r >= t for r, t in zip(first, thresholds)]))
        out[f"{prefix}/greedy_reward"] = float(np.mean(first))
    if e.k > 0:
        # (an episode lost untried: none)
        right = [[r >= t for r in outcomes(g)] for g, t in zip(sampled, thresholds)]
        out[f"{prefix}/avg@{e.k}"] = float(np.mean([float(x) for r in right for x in r] or [0.0]))
        out[f"{prefix}/pass@{e.k}"] = float(np.mean([any(r) for r in right]))
    out[f"{prefix}/score"] = out[f"{prefix}/greedy_pass@1"] if e.score == "greedy" else out[f"{prefix}/avg@{e.k}"]
    return out


def domain_threshold(cfg: RLConfig, domain: str | None) -> float:
    """The reward at or above which a completion of `domain` counts as right."""
    for d in cfg.data.domains:
        if d.name == domain and d.eval.correct_threshold is not None:
            return d.eval.correct_threshold
    return cfg.eval.correct_threshold


def evaluate(manager: RolloutManager, prompts: list[Prompt], cfg: RLConfig) -> dict[str, float]:
    e = cfg.eval
    with progress(len(prompts) * (int(e.greedy) + e.k), "evaluation", "sample") as bar:
        greedy = manager.generate(prompts, 1, 0.0, SALT_EVAL, on_done=bar.update) if e.greedy else []
        sampled: list[list[Sample]] = []
        if e.k > 0:
            temperature = e.temperature if e.temperature is not None else manager.temperature
            sampled = manager.generate(prompts, e.k, temperature, SALT_EVAL, on_done=bar.update)
    thresholds = [domain_threshold(cfg, p.domain) for p in prompts]
    out = _scores(greedy, sampled, cfg, thresholds, "eval")
    if not cfg.data.domains:
        return out
    domains = list(dict.fromkeys(p.domain for p in prompts))
    for d in domains:
        mine = [i for i, p in enumerate(prompts) if p.domain == d]
        out.update(
            _scores(
                [greedy[i] for i in mine] if greedy else [],
                [sampled[i] for i in mine] if sampled else [],
                cfg,
                [thresholds[i] for i in mine],
                f"eval/{d}",
            )
        )
    out["eval/score"] = float(np.mean([out[f"eval/{d}/score"] for d in domains]))
    return out
