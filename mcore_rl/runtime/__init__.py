"""Orchestration of `mcore-rl train`: the driver loop and what it needs beyond the parts below it.

- `loop`: the driver (rollouts -> learner -> weight sync -> eval -> checkpoints, resume), with
  the hooks of the run's recipes (`mcore_rl/hooks.py`, `mcore_rl/recipes/`) at fixed points; it
  reads as the RL algorithm, the parts do the work: `mcore_rl.data` (prompt streams, tasks),
  `mcore_rl.rollout` (the engine pool), `mcore_rl.rewards`, `mcore_rl.train` (policy, RL step,
  weight sync);
- `rollouts` over `scheduler` and `staleness`: the one rollout path, in the synchronous schedule
  (rounds) or the streaming one (buffer and gate), with the recipes' group and batch steps;
- `rollout_manager`: sampling parameters, seeds and rewards; evaluation and validation batches;
- `accounting`: where every drawn prompt went; `evaluate`: held-out pass@1 / avg@k.
"""

from mcore_rl.runtime.loop import run_rl

__all__ = ["run_rl"]
