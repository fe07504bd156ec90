"""The actor-learner RL loop (`mcore-rl train`), one idea per module:

- `samples`: samples with provenance (policy version, μ) and the resumable prompt streams;
- `engines`: embedded `EngineCore`s or SGLang-compatible HTTP servers, behind one interface;
- `rollout`: the rollout manager (G completions per prompt, rewards, dynamic sampling);
- `batch`: samples -> [N, T] sequence tensors and packed megatron-core micro-batches;
- `learner`: π_old/π_ref, advantages, mismatch correction, optimizer steps over mini-batches;
- `evaluate`: held-out pass@1 / avg@k through the engine;
- `warm_start`: initial weights and the SFT warm start;
- `metrics`: metrics.jsonl, TensorBoard, the curves PNG;
- `loop`: the driver (weight sync, MIPU accept/reject, checkpoints, resume).
"""

from mcore_rl.runtime.loop import run_rl

__all__ = ["run_rl"]
