"""POLARIS ("POLARIS: a post-training recipe for scaling RL on advanced reasoning models", HKU &
ByteDance & Fudan, 2025): zero-signal groups of a rollout batch repaired by rollout
rescue and intra-batch substitution.

The decisions (which groups, which samples) are pure functions in `mcore_rl.algos.polaris`; this
module applies them to `Sample`s, after the batch is scored (its temperature stages and stage
filter are the prompt stream's, `data/domains.py`):

* **Rescue** (`rollout.polaris.rescue`): a `RescueBuffer` keeps, per prompt (domain, text), the latest
  correct rollout seen, bounded to `rescue_buffer_prompts` prompts (the least recently updated go).
  A rescued sample is that stored rollout as it was generated: its tokens, its μ and its (older)
  `policy_version`, so the mismatch correction weighs it by π_old/μ like any stale sample; it is
  marked `Sample.marks.rescued` and the loop exempts it from `rollout.max_staleness` (`stale_ok`:
  it is stale by design). The buffer is part of the checkpoint (`rl.group_repair`).
* **Substitution** (`rollout.polaris.substitute`): every constant-reward group is replaced by copies
  of a mixed group's samples; the copies keep the group id of the group they replace (so group
  statistics see each copy as its own group, as in the paper) and say where they came from in
  `Sample.marks.substituted_from`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, replace
from typing import Any
from collections.abc import Sequence

import torch

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.dynamic_sampling import DEFAULT_STD_TOLERANCE
from mcore_rl.algos.polaris import rescue_plan, substitution_plan
from mcore_rl.config.rules import Errors
from mcore_rl.data.samples import Sample
from mcore_rl.recipes.config.polaris import PolarisConfig
from mcore_rl.hooks import Recipe, RolloutContext
from mcore_rl.runtime.rollout_manager import split_groups
from mcore_rl.runtime.scheduler import sample_from_state


def _flat(groups: Sequence[Sequence[Sample]]) -> tuple[list[Sample], torch.Tensor, torch.Tensor]:
    flat = [s for g in groups for s in g]
    ids = torch.tensor([k for k, g in enumerate(groups) for _ in g], dtype=torch.long)
    return flat, torch.tensor([s.reward for s in flat], dtype=torch.float64), ids


def _key(s: Sample) -> tuple[str, str]:
    return s.prompt.domain, s.prompt.text


class RescueBuffer:
    """POLARIS's rescue buffer: per prompt, the latest correct rollout (a copy), at most `max_prompts`."""

    def __init__(self, max_prompts: int, correct_reward: float = 1.0) -> None:
        self.max_prompts, self.correct_reward = max_prompts, correct_reward
        self.entries: OrderedDict[tuple[str, str], Sample] = OrderedDict()

    def has(self, s: Sample) -> bool:
        return _key(s) in self.entries

    def update(self, groups: Sequence[Sequence[Sample]]) -> int:
        """Store the correct rollouts of `groups` (the last one of a prompt wins; rescued and repaired
        samples are not stored). Returns how many were stored."""
        n = 0
        for g in groups:
            for s in g:
                if (
                    s.reward < self.correct_reward
                    or s.reward_error is not None
                    or s.marks.rescued
                    or s.marks.corrected_by is not None
                    or s.marks.substituted_from is not None
                ):
                    continue
                key = _key(s)
                self.entries.pop(key, None)
                self.entries[key] = replace(s, teacher=None, info=dict(s.info))
                n += 1
        while len(self.entries) > self.max_prompts:
            self.entries.popitem(last=False)
        return n

    def rescue(self, groups: Sequence[Sequence[Sample]]) -> tuple[list[list[Sample]], int]:
        """Every all-wrong group with a stored rollout of its prompt: its last wrong sample replaced
        by that rollout (in the group's id and prompt). Returns the groups and how many were rescued."""
        flat, rewards, ids = _flat(groups)
        plan = rescue_plan(rewards, ids, [self.has(s) for s in flat], correct_reward=self.correct_reward)
        for i in plan.values():
            old, stored = flat[i], self.entries[_key(flat[i])]
            flat[i] = replace(
                stored,
                prompt=old.prompt,
                group=old.group,
                teacher=None,
                info=dict(stored.info),
                marks=replace(stored.marks, rescued=True),
            )
        return split_groups(flat, groups), len(plan)

    def state_dict(self) -> dict[str, Any]:
        return {"max_prompts": self.max_prompts, "entries": [asdict(s) for s in self.entries.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = OrderedDict()
        for d in state["entries"]:
            s = sample_from_state(d)
            self.entries[_key(s)] = s
        while len(self.entries) > self.max_prompts:
            self.entries.popitem(last=False)


def substitute(
    groups: Sequence[Sequence[Sample]], tol: float = DEFAULT_STD_TOLERANCE
) -> tuple[list[list[Sample]], int]:
    """POLARIS's intra-batch substitution: (groups, how many groups were replaced)."""
    flat, rewards, ids = _flat(groups)
    src = substitution_plan(rewards, ids, tol=tol)
    out = list(flat)
    replaced = set()
    for i, j in enumerate(src):
        if i != j:
            out[i] = replace(
                flat[j],
                group=flat[i].group,
                info=dict(flat[j].info),
                marks=replace(flat[j].marks, substituted_from=flat[j].group),
            )
            replaced.add(int(ids[i]))
    return split_groups(out, groups), len(replaced)


class Polaris(Recipe):
    """Rescue in every round of the rollout, substitution in the final batch."""

    name = "polaris"
    state_key = "group_repair"  # the checkpoint key of its rescue buffer

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        p = cfg.rollout.section(PolarisConfig)
        self.rescue_buffer = RescueBuffer(p.rescue_buffer_prompts, p.correct_reward) if p.rescue else None

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        p = cfg.rollout.section(PolarisConfig)
        return p.rescue or p.substitute

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        p = cfg.rollout.section(PolarisConfig)
        errors.need(
            p.rescue_buffer_prompts >= 1,
            "rollout.polaris.rescue_buffer_prompts",
            f"must be >= 1, got {p.rescue_buffer_prompts}",
        )
        errors.need(
            math.isfinite(p.correct_reward), "rollout.polaris.correct_reward", f"must be finite, got {p.correct_reward}"
        )

    async def repair_round(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        if self.rescue_buffer is None:
            return groups, {}
        groups, n = self.rescue_buffer.rescue(groups)
        return groups, {"rescued_groups": float(n)}

    def observe_round(self, groups: list[list[Sample]]) -> dict[str, float]:
        """The round's correct rollouts (after every repair) go into the rescue buffer."""
        if self.rescue_buffer is None:
            return {}
        self.rescue_buffer.update(groups)
        return {"rescue_buffer_prompts": float(len(self.rescue_buffer.entries))}

    def finish_batch(
        self, groups: list[list[Sample]], rollout: RolloutContext
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        if not self.cfg.rollout.section(PolarisConfig).substitute:
            return groups, {}
        groups, n = substitute(groups, self.cfg.algorithm.dynamic_sampling.std_tolerance)
        return groups, {"substituted_groups": float(n)}

    def stale_ok(self, sample: Sample) -> bool:
        return sample.marks.rescued

    def state_dict(self) -> dict[str, Any]:
        return {"rescue_buffer": self.rescue_buffer.state_dict() if self.rescue_buffer is not None else None}

    def load_state_dict(self, state: Any) -> None:
        if self.rescue_buffer is not None and state and state.get("rescue_buffer") is not None:
            self.rescue_buffer.load_state_dict(state["rescue_buffer"])
