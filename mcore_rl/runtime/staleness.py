"""Bounded staleness, enforced when a request is submitted (AReaL's capacity gate).

The learner's step k trains on one batch of `batch_groups` groups with weight version k + 1 (the
first sync makes version 1). A sample generated with version v and trained at step k is
k + 1 - v versions behind. The gate admits a new group only while

    accepted + in_flight < (max_staleness + steps_done + 1) * batch_groups

where `accepted` counts groups trained or waiting in the buffer (filtered, failed and dropped
groups give their place back). So with `max_staleness` s, nothing is submitted for step k before
version k + 1 - s exists, and every sample the gate admits is at most s versions old when trained,
unless filtering delays it (then `is_too_stale` catches it at batch time). s = 0 is the
synchronous loop: the next batch is submitted only after the sync that follows the last step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessGate:
    batch_groups: int  # groups per training step
    max_staleness: int  # versions a sample may lag behind the weights it is trained with
    total_steps: int | None = None  # nothing is generated for steps the run will not train

    def __post_init__(self) -> None:
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def capacity(self, steps_done: int, accepted: int, in_flight: int) -> int:
        """How many more groups may be submitted now (never negative)."""
        steps = self.max_staleness + steps_done + 1
        if self.total_steps is not None:
            steps = min(steps, self.total_steps)
        return max(0, steps * self.batch_groups - accepted - in_flight)

    def lag(self, trainer_version: int, sample_version: int) -> int:
        return trainer_version - sample_version

    def is_too_stale(self, trainer_version: int, sample_version: int) -> bool:
        return self.lag(trainer_version, sample_version) > self.max_staleness
