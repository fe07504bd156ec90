"""DAPO's dynamic sampling: groups whose rewards are all equal have zero group-relative advantage
and only dilute the batch, so drop them and sample more prompts until the batch is full.

Two pieces: a pure selection function on tensors, and a small stateful helper that accumulates
surviving groups over several generation rounds and says how many prompts to ask for next.
"""

from __future__ import annotations

import math
from typing import Generic, TypeVar
from collections.abc import Sequence

import torch

from mcore_rl.algos.advantages import group_stats
from mcore_rl.algos.registry import register

T = TypeVar("T")

# A group counts as constant when its reward std is at most this. Not 0: rewards that are equal as
# numbers need not be equal in floating point after shaping or averaging ([0.1, 0.1, 0.1] in float64
# has a std of 1.4e-17), and such a group carries no advantage signal either.
DEFAULT_STD_TOLERANCE = 1e-6


@register("group_filter", "nonzero_std")
def nonzero_std_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor, tol: float = DEFAULT_STD_TOLERANCE
) -> torch.Tensor:
    """Keep mask [N]: True for samples whose group's reward std is > `tol` (singletons dropped)."""
    count, _, var = group_stats(rewards, group_ids)
    return (count > 1) & (var.sqrt() > tol)


def is_constant(rewards: Sequence[float], tol: float = DEFAULT_STD_TOLERANCE) -> bool:
    """Whether one group's rewards carry no group-relative signal: fewer than 2, or std <= `tol`."""
    return len(rewards) < 2 or _std(rewards) <= tol


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


class GroupRefill(Generic[T]):
    """Collect groups (lists of samples of one prompt) with non-constant rewards until `target`.

    Usage per training batch::

        refill = GroupRefill(target_groups=32)
        while not refill.done and not refill.exhausted:
            groups = generate(refill.prompts_to_request())
            refill.add(groups, [[s.reward for s in g] for g in groups])
        batch = refill.take()

    `prompts_to_request` over-samples by the keep rate seen so far (capped by `max_oversample`).
    Extra groups beyond the target are dropped by `take()`, or carried into the next batch with
    `carry_over=True` (they are then one batch staler). After `max_rounds` generation rounds the
    helper is `exhausted` and `take()` returns what it has, possibly fewer than the target.
    """

    def __init__(
        self,
        target_groups: int,
        max_rounds: int = 10,
        max_oversample: float = 4.0,
        tol: float = DEFAULT_STD_TOLERANCE,
        carry_over: bool = False,
    ) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups must be >= 1, got {target_groups}")
        self.target = target_groups
        self.max_rounds = max_rounds
        self.max_oversample = max_oversample
        self.tol = tol
        self.carry_over = carry_over
        self._kept: list[list[T]] = []
        self.rounds = 0
        self.seen_groups = 0
        self.kept_groups = 0

    @property
    def needed(self) -> int:
        return max(0, self.target - len(self._kept))

    @property
    def done(self) -> bool:
        return self.needed == 0

    @property
    def exhausted(self) -> bool:
        return self.rounds >= self.max_rounds

    @property
    def keep_rate(self) -> float:
        return self.kept_groups / self.seen_groups if self.seen_groups else 1.0

    def prompts_to_request(self) -> int:
        """How many prompts (groups) to generate next: needed / observed keep rate, capped."""
        if self.done:
            return 0
        factor = min(1.0 / max(self.keep_rate, 1e-9), self.max_oversample)
        return max(1, math.ceil(self.needed * factor))

    def add(self, groups: Sequence[Sequence[T]], rewards: Sequence[Sequence[float]]) -> int:
        """Add one generation round; returns how many of its groups were kept."""
        if len(groups) != len(rewards):
            raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
        self.rounds += 1
        kept = 0
        for group, rs in zip(groups, rewards):
            if len(group) != len(rs):
                raise ValueError(f"a group of {len(group)} samples has {len(rs)} rewards")
            self.seen_groups += 1
            if not is_constant(rs, self.tol):
                self._kept.append(list(group))
                kept += 1
        self.kept_groups += kept
        return kept

    def take(self) -> list[list[T]]:
        """The batch (at most `target` groups, in arrival order) and a reset for the next one."""
        batch, extra = self._kept[: self.target], self._kept[self.target :]
        self._kept = extra if self.carry_over else []
        self.rounds = 0
        return batch

    def metrics(self) -> dict[str, float]:
        return {"dynamic_sampling/keep_rate": self.keep_rate, "dynamic_sampling/rounds": float(self.rounds)}
