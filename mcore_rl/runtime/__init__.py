"""Orchestration of `mcore-rl train`: the driver loop and what it needs beyond the parts below it.

- `loop`: the driver (rollouts -> learner -> weight sync -> MIPU accept/reject -> eval ->
  checkpoints, resume); it reads as the RL algorithm, the parts do the work:
  `mcore_rl.data` (prompt streams, tasks), `mcore_rl.rollout` (the engine pool),
  `mcore_rl.rewards`, `mcore_rl.train` (policy, RL step, weight sync);
- `rollout_manager`: G completions per prompt from the engine pool, scored, dynamic sampling;
- `evaluate`: held-out pass@1 / avg@k through the engine;
- `metrics`: metrics.jsonl, TensorBoard, the curves PNG.

The buffer and staleness gate of the asynchronous runtime will live here too.
"""

from mcore_rl.runtime.loop import run_rl

__all__ = ["run_rl"]
