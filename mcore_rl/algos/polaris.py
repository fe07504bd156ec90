"""POLARIS (HKU & ByteDance & Fudan, 2025): a post-training recipe of small, independent knobs.

What it changes in the rollout path, and why:

* **Zero-signal groups.** A group whose G rewards are all equal has a zero group-relative advantage
  and teaches nothing. POLARIS repairs such groups instead of only dropping them (DAPO):
  - *rollout rescue*: an all-wrong group gets one wrong rollout replaced by the latest correct
    rollout of the same prompt from an earlier step (a per-prompt buffer), so it ends with G-1 wrong
    and 1 correct;
  - *intra-batch informative substitution*: every all-correct or all-wrong group is replaced by a
    copy of a mixed group of the same batch (index copies only, the batch size is unchanged).
* **Pass-rate filtering.** Offline, prompts the model solves 8/8 are dropped (pass rate < 1 kept,
  0/8 kept) or the kept ones are thinned to a "mirrored J" histogram skewed to hard prompts; online,
  entering a new stage, prompts whose accuracy is > 0.9 (0.9 itself kept) leave the stream.
* **Temperature stages** (the rollout's, `rollout.temperature_stages`) and the diversity score that
  picks them (`mcore_rl.data.domains.diversity_score`).

This module holds the decisions only, as pure functions of group ids and rewards -> indices; applying
them to `Sample`s is `mcore_rl.recipes.polaris`.

Chosen where the summary is unclear (docs/design.md#paper-methods):

* "correct" is reward >= `correct_reward` (1.0: POLARIS's 0/1 reward); "wrong" is everything else.
* Rescue replaces the *last* wrong sample of the group (the summary does not say which one); a group is
  rescued only when it is all wrong (an all-correct group is left to substitution).
* Substitution copies mixed groups of the same size in batch order, cycling when there are more
  zero-signal groups than mixed ones; a zero-signal group with no mixed group of its size is left
  unchanged. "Zero-signal" is a constant reward (std <= tolerance, as dynamic sampling's), which for
  0/1 rewards is exactly all-correct or all-wrong.
* The mirrored-J selection keeps every prompt of the hardest bin (0/8) and caps each easier bin k at
  the number kept in bin k-1 (a seeded random subset), so the histogram never rises with the pass
  rate; prompts with pass rate 1 are always dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mcore_rl.algos.dynamic_sampling import DEFAULT_STD_TOLERANCE
from mcore_rl.algos.registry import register
from mcore_rl.algos.thresholds import at_least


def _groups(group_ids: torch.Tensor) -> list[list[int]]:
    """Sample indices of each group, in order of first appearance."""
    order: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids.tolist()):
        order.setdefault(int(g), []).append(i)
    return list(order.values())


def _constant(values: torch.Tensor, tol: float) -> bool:
    return values.numel() < 2 or float(values.double().std()) <= tol


@register("group_repair", "polaris_rescue")
def rescue_plan(
    rewards: torch.Tensor, group_ids: torch.Tensor, buffered: Sequence[bool], *, correct_reward: float = 1.0
) -> dict[int, int]:
    """Rollout rescue: {group id: index of the sample to replace by its prompt's buffered correct
    rollout}, for every group that is all wrong and whose prompt has a buffer entry.
    `buffered[i]`: sample i's prompt has a stored correct rollout."""
    plan: dict[int, int] = {}
    for idx in _groups(group_ids):
        correct = at_least(rewards[idx], correct_reward).tolist()
        if not any(correct) and all(buffered[i] for i in idx):
            plan[int(group_ids[idx[0]])] = idx[-1]
    return plan


@register("group_repair", "polaris_substitute")
def substitution_plan(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, tol: float = DEFAULT_STD_TOLERANCE
) -> list[int]:
    """Intra-batch informative substitution: `src` [N] with sample i to become a copy of sample
    src[i] (src[i] == i: unchanged). Every zero-signal group's samples are replaced, position by
    position, by those of a mixed group of the same size (cycling through them in batch order)."""
    src = list(range(int(group_ids.numel())))
    groups = _groups(group_ids)
    mixed: dict[int, list[list[int]]] = {}
    for idx in groups:
        if not _constant(rewards[idx], tol):
            mixed.setdefault(len(idx), []).append(idx)
    used: dict[int, int] = {}
    for idx in groups:
        donors = mixed.get(len(idx))
        if not donors or not _constant(rewards[idx], tol):
            continue
        k = used.get(len(idx), 0)
        used[len(idx)] = k + 1
        for i, j in zip(idx, donors[k % len(donors)]):
            src[i] = j
    return src


def pass_rates(rewards: torch.Tensor, group_ids: torch.Tensor, correct_reward: float = 1.0) -> dict[int, float]:
    """Pass rate of each group: #correct / #samples (POLARIS: of 8 rollouts)."""
    return {
        int(group_ids[idx[0]]): float(np.mean(at_least(rewards[idx], correct_reward).tolist()))
        for idx in _groups(group_ids)
    }


def offline_selection(rates: Sequence[float], mode: str = "below_one", bins: int = 8, seed: int = 0) -> list[int]:
    """Indices of the prompts to keep, given each prompt's pass rate over `bins` rollouts.
    "below_one": every prompt with pass rate < 1 (8/8 dropped, 0/8 kept); "mirrored_j": of those,
    a seeded subset whose histogram over the pass rates k/bins never increases with k."""
    if mode not in ("below_one", "mirrored_j"):
        raise ValueError(f"mode: expected 'below_one' or 'mirrored_j', got {mode!r}")
    keep = [i for i, r in enumerate(rates) if r < 1.0]
    if mode == "below_one":
        return keep
    by_bin: dict[int, list[int]] = {}
    for i in keep:
        by_bin.setdefault(int(round(rates[i] * bins)), []).append(i)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    cap: int | None = None
    for k in range(bins):
        members = by_bin.get(k, [])
        if cap is not None and len(members) > cap:
            members = sorted(int(x) for x in rng.choice(members, size=cap, replace=False))
        out += members
        cap = len(members)
    return sorted(out)


def histogram(rates: Sequence[float], bins: int = 8) -> list[int]:
    """Prompts per pass rate k/bins, k = 0..bins."""
    counts = [0] * (bins + 1)
    for r in rates:
        counts[int(round(r * bins))] += 1
    return counts
