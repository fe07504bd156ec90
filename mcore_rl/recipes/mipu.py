"""MIPU's Step 2 ("Beyond Precision: ... Simple LR Scheduling Fixes It", NUS & Fudan, 2026): after
the step's weight sync, a validation batch sampled from the synced candidate gives T̂_post
(`algos/mipu.py: validation_estimate`), and `MIPUController` accepts the update or rolls back
trainer and engine. Step 1 (the PPO clip times min(π_k/μ, w_max)) is the registered mismatch
correction "mipu", a pure function; this module is the accept/rollback around it.

The validation samples are used for the decision only. The rollback needs that no training sample
comes from the update it may roll back: `rollout.max_staleness: 0`, in either schedule (the
asynchronous scheduler's gate admits the next batch's groups only after `step_done`, which the loop
calls after this decision); with a larger bound the engines would already sample training groups
from the candidate.
"""

from __future__ import annotations

import math
from typing import Any

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.mipu import MIPUController, validation_estimate
from mcore_rl.config.rules import Errors
from mcore_rl.hooks import Recipe
from mcore_rl.recipes.config.mipu import MIPUConfig
from mcore_rl.runtime.loop import broadcast
from mcore_rl.runtime.rollout_manager import SALT_VALIDATION
from mcore_rl.train.packing import sequence_view

NAME = "mipu"  # `algorithm.mismatch.name` of MIPU's Step 1


class MIPU(Recipe):
    """Snapshot before the update, decide after the sync, roll back (and re-sync) on a reject."""

    name = NAME
    state_key = "mipu"

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        return cfg.algorithm.mismatch.name == NAME

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        """A PPO clip times w = min(π_k/μ, w_max) (w_max = clip_high), validated on >= 2-sample
        groups, accepted or rolled back before the next rollout."""
        a, r = cfg.algorithm, cfg.rollout
        m = a.mismatch
        if m.name != NAME:
            return
        v = m.section(MIPUConfig)
        errors.need(
            r.runtime == "sync" or r.max_staleness == 0,
            "algorithm.mismatch.name",
            "mipu accepts or rolls back every update before the next rollout, so no sample may come from "
            f"the update it rolls back; it needs rollout.max_staleness=0 (got {r.max_staleness}) or "
            "rollout.runtime=sync",
        )
        errors.need(
            v.validation_prompts >= 1,
            "algorithm.mismatch.mipu_validation_prompts",
            f"must be >= 1, got {v.validation_prompts}",
        )
        if v.validation_group_size is None:
            errors.need(
                r.group_size >= 2, "rollout.group_size", "MIPU's validation advantages need >= 2 samples per prompt"
            )
        else:
            errors.need(
                v.validation_group_size >= 2,
                "algorithm.mismatch.mipu_validation_group_size",
                f"MIPU's validation advantages need >= 2 samples per prompt, got {v.validation_group_size}",
            )
        errors.need(
            math.isfinite(v.z) and v.z >= 0,
            "algorithm.mismatch.mipu_z",
            f"is the 'se' rule's number of standard errors; it must be finite and >= 0, got {v.z}",
        )
        errors.need(
            v.bootstrap >= 0,
            "algorithm.mismatch.mipu_bootstrap",
            f"must be >= 0 (0: no bootstrap flip rate), got {v.bootstrap}",
        )
        errors.need(
            m.level in (None, "token", "sequence"),
            "algorithm.mismatch.level",
            f"MIPU's weight is per token or per sequence, got {m.level!r}",
        )
        errors.need(
            a.policy_loss == "ppo_clip",
            "algorithm.policy_loss",
            f"MIPU Step 1 is a PPO clip on π_θ/π_k; it is not defined for {a.policy_loss!r}",
        )
        errors.need(
            m.clip_high is None or m.clip_high > 0,
            "algorithm.mismatch.clip_high",
            "is MIPU's w_max, the cap of its weight min(π_k/μ, w_max); it must be null (= 2) or > 0, "
            f"got {m.clip_high}",
        )
        for key in ("clip_low", "mask_low", "mask_high", "veto_threshold", "batch_normalize"):
            errors.need(
                getattr(m, key) is None,
                f"algorithm.mismatch.{key}",
                "is not used by MIPU (its only parameters are clip_high = w_max, level and mipu_*)",
            )

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.controller: MIPUController | None = None
        self._state: Any = None

    def setup(self, run: Any) -> None:
        v = self.cfg.algorithm.mismatch.section(MIPUConfig)
        self.controller = MIPUController(
            run.optimizer.snapshot,
            run.optimizer.restore,
            lambda: run.sync(new_version=True),
            c_start=v.c_start,
            c_end=v.c_end,
            anneal_steps=v.anneal_steps,
            count_rejected=v.count_rejected,
            rule=v.decision,
            z=v.z,
            bootstrap=v.bootstrap,
        )
        if self._state:
            self.controller.load_state_dict(self._state)

    def before_update(self) -> None:
        assert self.controller is not None
        self.controller.begin()

    def after_sync(self, run: Any, learner: Any) -> dict[str, float]:
        """Score a validation batch sampled from the synced candidate, accept or roll back."""
        assert self.controller is not None
        v, r = self.cfg.algorithm.mismatch.section(MIPUConfig), self.cfg.rollout
        payload = None
        if run.rank0:
            prompts = run.val_prompts.take(v.validation_prompts)
            g_val = v.validation_group_size or r.group_size
            groups = run.manager.generate(prompts, g_val, run.manager.temperature, SALT_VALIDATION)
            payload = ([s for g in groups for s in g], run.val_prompts.state_dict())
        samples, val_state = broadcast(payload)
        if not run.rank0:
            run.val_prompts.load_state_dict(val_state)
        view = sequence_view(samples)
        pi, _ = learner.token_logprobs(samples, view.mask.shape[1])
        est = validation_estimate(
            pi, view.rollout_logp, view.mask * view.ok[:, None], view.rewards, view.group_ids, valid=view.ok.bool()
        )
        decision = self.controller.decide(est)
        out = decision.metrics()
        out["mipu/validation_groups"] = float(est.group_counts.numel())
        out["mipu/informative_groups"] = float(est.informative_groups)  # non-constant rewards
        out.update(self.controller.metrics())
        out["mipu/validation_reward"] = float(view.rewards.mean())
        return out

    def state_dict(self) -> Any:
        return self.controller.state_dict() if self.controller is not None else None

    def load_state_dict(self, state: Any) -> None:
        self._state = state
        if self.controller is not None and state:
            self.controller.load_state_dict(state)
