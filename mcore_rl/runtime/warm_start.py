"""Where the policy starts: a model-only checkpoint, then (optionally) a few SFT steps on the task.

The SFT warm start uses the `mcore-rl sft` machinery on the synthetic task's prompt/answer pairs
(packed rows, prompt tokens masked), with its own AdamW and cosine schedule (`init.sft_*`), so the
RL optimizer starts fresh afterwards.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Optional

from mcore_rl.train import checkpoint


def load_initial_weights(path: str, chunks: list, log: Callable[[str], None]) -> None:
    """Weights only (any optimizer state in the checkpoint is ignored)."""
    found = checkpoint.latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"init.checkpoint {path!r} holds no checkpoint")
    checkpoint.load_checkpoint(found, chunks, None)
    log(f"initial weights from {found}")


def sft_warm_start(cfg: Any, chunks: list, tokenizer: Any, world_size: int, log: Callable[[str], None],
                   exclude: Collection[str] = (), log_every: Optional[int] = None) -> dict[str, float]:
    """`init.sft_steps` SFT steps on the synthetic task; returns the last loss and the time taken.
    Problems whose prompt is in `exclude` (the held-out evaluation set) are left out."""
    from megatron.core import parallel_state as ps

    from mcore_rl.data.sft import SFTBatches, SFTExample, build_rows, tokenize_example
    from mcore_rl.data.synthetic import make_addition_examples
    from mcore_rl.train.forward_backward import forward_backward
    from mcore_rl.train.optimizer import build_optimizer

    sft = cfg.sft_view(world_size)
    t, d = sft.train, sft.data
    drop = set(exclude)
    examples = [SFTExample(ex["prompt"], ex["response"], f"synthetic:{k}")
                for k, ex in enumerate(make_addition_examples(d.synthetic_num_examples, t.seed, d.synthetic_max_digits))
                if ex["prompt"] not in drop]
    rows = build_rows([tokenize_example(ex, tokenizer, True) for ex in examples], t.seq_length, True, tokenizer.pad_id)
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
