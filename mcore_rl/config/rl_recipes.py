"""Rules of the single-stream stage schedule: `rollout.temperature_stages` (the sampling temperature
per stage) and `data.drop_solved_above` (prompts solved above an accuracy leave the stream at each
stage). The prompt stream applies them (`data/domains.py`); the asynchronous runtime draws ahead of
the learner (one batch can mix two temperature stages), so the stages refuse `rollout.runtime: async`.
The rollout repairs of recipes check their own keys (`mcore_rl/recipes/`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mcore_rl.config.rules import Errors, check_stage_starts

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import RLConfig


def check_stages(cfg: RLConfig, errors: Errors) -> None:
    r, d = cfg.rollout, cfg.data
    sync = r.runtime == "sync"
    check_stage_starts(r.temperature_stages, "rollout.temperature_stages", errors)
    for k, st in enumerate(r.temperature_stages):
        key = f"rollout.temperature_stages[{k}]"
        errors.need(
            math.isfinite(st.temperature) and st.temperature > 0,
            f"{key}.temperature",
            f"must be a finite number > 0, got {st.temperature}",
        )
    if r.temperature_stages:
        errors.need(
            sync,
            "rollout.temperature_stages",
            "needs rollout.runtime=sync: the asynchronous runtime draws ahead of the learner, so one batch "
            "can hold groups of two stages, and the learner computes π at one temperature per batch",
        )
        errors.need(
            not d.domains,
            "rollout.temperature_stages",
            "with data.domains, stage the temperature with data.mixture.stages[k].temperature",
        )
    if d.drop_solved_above is not None:
        errors.need(
            0 <= d.drop_solved_above <= 1,
            "data.drop_solved_above",
            f"must be in [0, 1] (an accuracy), got {d.drop_solved_above}",
        )
        errors.need(
            not d.domains, "data.drop_solved_above", "with data.domains, use data.mixture.stages[k].drop_solved_above"
        )
        errors.need(
            any(st.start_step > 0 for st in r.temperature_stages),
            "data.drop_solved_above",
            "drops prompts entering a stage: it needs rollout.temperature_stages with a stage after step 0",
        )
