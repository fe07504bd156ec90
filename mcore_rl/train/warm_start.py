"""Where the RL policy starts: a model-only checkpoint, then (optionally) a few SFT steps on the task.

The SFT warm start is `mcore-rl sft`'s step (`sft.sft_step`) on the task's prompt/answer pairs
(packed rows, prompt tokens masked), with its own AdamW and schedule (`init.sft`), so the RL
optimizer starts fresh afterwards.
"""

from __future__ import annotations

import time
from typing import Any
from collections.abc import Callable, Collection

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.progress import progress
from mcore_rl.train import checkpoint
from mcore_rl.train.hf_provenance import read_provenance


def load_initial_weights(
    path: str, chunks: list, log: Callable[[str], None], skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Weights only (any optimizer state in the checkpoint is ignored; the modules in `skip` keep
    theirs: `checkpoint.load_checkpoint`); returns the checkpoint's HF provenance, which the run's
    checkpoints carry (train/hf_provenance.py)."""

    found = checkpoint.latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"init.checkpoint {path!r} holds no checkpoint")
    common = checkpoint.load_checkpoint(found, chunks, None, skip)
    log(f"initial weights from {found}")
    return read_provenance(common, found)


def sft_warm_start(
    cfg: RLConfig,
    chunks: list,
    tokenizer: Any,
    world_size: int,
    log: Callable[[str], None],
    exclude: Collection[str] = (),
    log_every: int | None = None,
) -> dict[str, float]:
    """`init.sft.train.train_iters` SFT steps on the task (with `data.domains`: on every task domain's
    answers and the scripted players' turns of the environment domains, `agent/demonstrations.py`);
    returns the last loss and the time taken. Problems whose prompt is in `exclude` (the held-out
    evaluation set) are left out."""
    from megatron.core import parallel_state as ps

    from mcore_rl.data.sft import SFTBatches, build_rows, task_examples, tokenize_example  # lazy: numpy
    from mcore_rl.train.optimizer import build_optimizer  # lazy: numpy
    from mcore_rl.train.sft import sft_step  # lazy: megatron

    sft = cfg.sft_view(world_size)
    t, d = sft.train, sft.data
    played: list[tuple[list[int], list[int]]] = []  # environment domains: their scripted players' turns
    if cfg.data.domains:  # every task domain's answers, shared by the mixture weights
        from mcore_rl.agent.demonstrations import environment_rows  # lazy: the engine stack
        from mcore_rl.data.domains import sft_examples  # lazy: numpy
        from mcore_rl.envs import env_has_player  # lazy: every environment module

        examples = sft_examples(cfg, tokenizer, d.synthetic_num_examples, t.seed, exclude, env_has_player)
        played = environment_rows(cfg, tokenizer, d.synthetic_num_examples, t.seed)
    else:
        examples = task_examples(d.synthetic_task, d.synthetic_max_digits, d.synthetic_num_examples, t.seed, exclude)
    tokenized = [tokenize_example(ex, tokenizer, True) for ex in examples] + played
    rows = build_rows(tokenized, t.seq_length, True, tokenizer.pad_id)
    dp = ps.get_data_parallel_world_size()
    batches = SFTBatches(
        rows,
        t.micro_batch_size,
        t.global_batch_size // (t.micro_batch_size * dp),
        ps.get_data_parallel_rank(),
        dp,
        t.seed,
    )
    optimizer = build_optimizer(chunks, sft.optimizer, t.precision, t.train_iters)
    log_every = log_every or max(1, t.train_iters // 5)
    start = time.perf_counter()
    loss = float("nan")
    out: dict[str, float] = {}
    with progress(t.train_iters, "sft warm start", "step") as bar:
        for it in range(1, t.train_iters + 1):
            out = sft_step(chunks, optimizer, batches, t)  # t: the MTP heads' loss, if the model has them
            loss = out["loss"]
            bar.update(1)
            if it % log_every == 0 or it == t.train_iters:
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                log(f"sft warm start {it:>5}/{t.train_iters} | loss {loss:.4f}")
    heads = {f"init/sft_{k}": v for k, v in out.items() if k.startswith("mtp_")}
    return {"init/sft_loss": loss, "init/sft_seconds": time.perf_counter() - start, **heads}
