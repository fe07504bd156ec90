"""Rules of the rollout-path recipes: POLARIS (`rollout.temperature_stages`, `rollout.polaris`,
`data.drop_solved_above`) and EDGE-GRPO's guided error correction (`rollout.gec`).

All of them act on the synchronous rollout (`runtime/rollout_manager.py`); the asynchronous runtime
draws ahead of the learner (one batch can mix two temperature stages) and scores groups one by one,
so each key refuses `rollout.runtime: async` by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mcore_rl.config.rules import Errors, check_stage_starts

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import RLConfig


def check_recipes(cfg: RLConfig, errors: Errors) -> None:
    r, d = cfg.rollout, cfg.data
    sync = r.runtime == "sync"
    check_stage_starts(r.temperature_stages, "rollout.temperature_stages", errors)
    for k, st in enumerate(r.temperature_stages):
        key = f"rollout.temperature_stages[{k}]"
        errors.need(math.isfinite(st.temperature) and st.temperature > 0, f"{key}.temperature",
                    f"must be a finite number > 0, got {st.temperature}")
    if r.temperature_stages:
        errors.need(sync, "rollout.temperature_stages",
                    "needs rollout.runtime=sync: the asynchronous runtime draws ahead of the learner, so one batch "
                    "can hold groups of two stages, and the learner computes π at one temperature per batch")
        errors.need(not d.domains, "rollout.temperature_stages",
                    "with data.domains, stage the temperature with data.mixture.stages[k].temperature")
    if d.drop_solved_above is not None:
        errors.need(0 <= d.drop_solved_above <= 1, "data.drop_solved_above",
                    f"must be in [0, 1] (an accuracy), got {d.drop_solved_above}")
        errors.need(not d.domains, "data.drop_solved_above",
                    "with data.domains, use data.mixture.stages[k].drop_solved_above")
        errors.need(any(st.start_step > 0 for st in r.temperature_stages), "data.drop_solved_above",
                    "drops prompts entering a stage: it needs rollout.temperature_stages with a stage after step 0")
    p = r.polaris
    for name, on in (("rescue", p.rescue), ("substitute", p.substitute)):
        errors.need(not on or sync, f"rollout.polaris.{name}",
                    "repairs the groups of one synchronous batch; it needs rollout.runtime=sync")
    errors.need(p.rescue_buffer_prompts >= 1, "rollout.polaris.rescue_buffer_prompts",
                f"must be >= 1, got {p.rescue_buffer_prompts}")
    errors.need(math.isfinite(p.correct_reward), "rollout.polaris.correct_reward",
                f"must be finite, got {p.correct_reward}")
    g = r.gec
    if not g.enabled:
        return
    errors.need(sync, "rollout.gec.enabled", "repairs the wrong responses of a synchronous batch; it needs "
                "rollout.runtime=sync")
    probs = list(g.probs)
    errors.need(len(probs) == 3 and min(probs, default=-1) >= 0 and abs(sum(probs) - 1) <= 1e-9, "rollout.gec.probs",
                f"must be three non-negative probabilities (reflect, reflect + answer, reference) summing to 1, "
                f"got {probs}")
    if len(probs) == 3 and probs[1] > 0:
        try:
            g.answer_hint.format(answer="1")
        except (KeyError, IndexError, ValueError) as err:
            errors.need(False, "rollout.gec.answer_hint", f"must be a format string with only {{answer}}: {err!r}")
    errors.need(not r.sampling_mask_replay, "rollout.gec.enabled",
                "a reference solution (op 3) was not sampled, so it has no sampling mask; turn off "
                "rollout.sampling_mask_replay")
    errors.need(cfg.algorithm.routing_replay != "r3", "rollout.gec.enabled",
                "repaired responses have no engine routing of their training context; use algorithm.routing_replay "
                "r2 or none")
