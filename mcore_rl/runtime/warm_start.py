"""Where the policy starts: a model-only checkpoint, then (optionally) a few SFT steps on the task.

The SFT warm start uses the `mcore-rl sft` machinery on the synthetic task's prompt/answer pairs
(packed rows, prompt tokens masked), with its own AdamW and cosine schedule (`init.sft_*`), so the
RL optimizer starts fresh afterwards.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from mcore_rl.train import checkpoint


def load_initial_weights(path: str, chunks: list, log: Callable[[str], None]) -> None:
    """Weights only (any optimizer state in the checkpoint is ignored)."""
    found = checkpoint.latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"init.checkpoint {path!r} holds no checkpoint")
    checkpoint.load_checkpoint(found, chunks, None)
    log(f"initial weights from {found}")


def sft_warm_start(cfg: Any, chunks: list, tokenizer: Any, world_size: int, log: Callable[[str], None],
                   log_every: Optional[int] = None) -> dict[str, float]:
    """`init.sft_steps` SFT steps on the synthetic task; returns the last loss and the time taken."""
    from megatron.core import parallel_state as ps

    from mcore_rl.data.sft import SFTBatches, build_sft_rows
    from mcore_rl.train.forward_backward import forward_backward
    from mcore_rl.train.optimizer import build_optimizer

    sft = cfg.sft_view(world_size)
    t = sft.train
    rows = build_sft_rows(sft.data, t.seq_length, tokenizer, t.seed)
    dp = ps.get_data_parallel_world_size()
    batches = SFTBatches(rows, t.micro_batch_size, t.global_batch_size // (t.micro_batch_size * dp),
                         ps.get_data_parallel_rank(), dp, t.seed)
    optimizer = build_optimizer(chunks, sft.optimizer, t.precision, t.train_iters)
    log_every = log_every or max(1, t.train_iters // 5)
    start = time.perf_counter()
    loss = float("nan")
    for c in chunks:
        c.train()
    for it in range(1, t.train_iters + 1):
        loss = forward_backward(chunks, next(batches))["loss"]
        optimizer.step()
        if it % log_every == 0 or it == t.train_iters:
            log(f"sft warm start {it:>5}/{t.train_iters} | loss {loss:.4f}")
    return {"init/sft_loss": loss, "init/sft_seconds": time.perf_counter() - start}
