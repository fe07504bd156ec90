"""Held-out evaluation through the engine: what the *inference* policy (FP8 or not) scores.

Greedy pass@1 (one temperature-0 completion per prompt) and, with k > 0, k sampled completions per
prompt: avg@k (mean reward over all k·P completions, an estimate of sampled pass@1) and pass@k (a
prompt counts if any of its k completions is right). Rewards are those of the training reward
function; a completion counts as right when its reward is >= `threshold` (1 for 0/1 verifiers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mcore_rl.data.samples import Prompt
from mcore_rl.runtime.rollout_manager import SALT_EVAL, RolloutManager


def evaluate(manager: RolloutManager, prompts: list[Prompt], cfg: Any, threshold: float = 1.0) -> dict[str, float]:
    e = cfg.eval
    out: dict[str, float] = {}
    if e.greedy:
        groups = manager.generate(prompts, 1, 0.0, SALT_EVAL)
        out["eval/greedy_pass@1"] = float(np.mean([g[0].reward >= threshold for g in groups]))
        out["eval/greedy_reward"] = float(np.mean([g[0].reward for g in groups]))
    if e.k > 0:
        temperature = e.temperature if e.temperature is not None else cfg.rollout.temperature
        groups = manager.generate(prompts, e.k, temperature, SALT_EVAL)
        right = np.array([[s.reward >= threshold for s in g] for g in groups], dtype=np.float64)
        out[f"eval/avg@{e.k}"] = float(right.mean())
        out[f"eval/pass@{e.k}"] = float(right.max(axis=1).mean())
    out["eval/score"] = out["eval/greedy_pass@1"] if e.score == "greedy" else out[f"eval/avg@{e.k}"]
    return out
