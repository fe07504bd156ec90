"""Supervised fine-tuning (and pre-training from scratch) on megatron-core: the `mcore-rl sft` loop."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_rl.config import SFTConfig, save_config, validate_sft_config
from mcore_rl.config.schema import TrainConfig
from mcore_rl.data.sft import SFTBatches, build_sft_rows
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.observe import ttfs
from mcore_rl.observe.run import RunObserver
from mcore_rl.parallel.preemption import preempted, stop_requested
from mcore_rl.train import checkpoint
from mcore_rl.models.mtp import has_mtp_heads
from mcore_rl.models.shards import unwrap_model
from mcore_rl.train.forward_backward import forward_backward
from mcore_rl.train.mtp_loss import MTPForwardStep
from mcore_rl.train.hf_provenance import carry_provenance, read_provenance
from mcore_rl.train.policy import build_policy
from mcore_rl.config import config_to_dict
from mcore_rl.data.tasks import get_task

logger = logging.getLogger(__name__)


@dataclass
class Trainer:
    """Everything one rank holds during training: model chunks, optimizer, data stream."""

    cfg: SFTConfig
    chunks: list[torch.nn.Module]
    optimizer: Any
    batches: SFTBatches
    eval_rows: dict[str, torch.Tensor] | None
    tokenizer: Tokenizer
    iteration: int = 0
    hf_provenance: dict[str, Any] = field(default_factory=dict)  # carried into every save (hf_provenance.py)


def _split_eval_rows(rows: dict[str, torch.Tensor], cfg: SFTConfig, dp: int) -> tuple[dict, dict | None]:
    """Hold out the rows evaluation needs (a fixed set, never trained on)."""
    t = cfg.train
    if t.eval_interval <= 0:
        return rows, None
    n_eval = t.eval_iters * t.micro_batch_size * dp
    n = next(iter(rows.values())).shape[0]
    if n_eval >= n:
        raise ValueError(f"train.eval_iters={t.eval_iters} needs {n_eval} rows; the data has only {n}")
    return {k: v[: n - n_eval] for k, v in rows.items()}, {k: v[n - n_eval :] for k, v in rows.items()}


def build_trainer(cfg: SFTConfig) -> Trainer:
    """Initialise parallel state, data, model, optimizer; resume from a checkpoint if configured."""
    from megatron.core import parallel_state as ps

    policy = build_policy(cfg, validate_sft_config, cfg.train.train_iters)
    chunks, optimizer, tokenizer = policy.chunks, policy.optimizer, policy.tokenizer
    rows = build_sft_rows(cfg.data, cfg.train.seq_length, tokenizer, cfg.train.seed)
    dp = policy.sizes.data_parallel_size
    train_rows, eval_rows = _split_eval_rows(rows, cfg, dp)
    batches = SFTBatches(
        train_rows,
        cfg.train.micro_batch_size,
        policy.sizes.num_microbatches,
        ps.get_data_parallel_rank(),
        dp,
        cfg.train.seed,
    )
    trainer = Trainer(cfg, chunks, optimizer, batches, eval_rows, tokenizer)
    ttfs.mark("data")

    if cfg.checkpoint.load_dir:
        path = checkpoint.latest_checkpoint(cfg.checkpoint.load_dir)
        if path is None:
            raise FileNotFoundError(f"checkpoint.load_dir {cfg.checkpoint.load_dir!r} holds no checkpoint")
        common = checkpoint.load_checkpoint(path, chunks, optimizer)
        trainer.hf_provenance = read_provenance(common, path)
        optimizer.reload_model_params()
        if common.get("data_seed") == cfg.train.seed:
            batches.load_state_dict(common["data"])
        trainer.iteration = int(common["iteration"])
        ttfs.mark("checkpoint_load")
        _log0(f"resumed from {path} at iteration {trainer.iteration}")
    return trainer


def save(trainer: Trainer) -> str:
    common = {
        "data": trainer.batches.state_dict(),
        "data_seed": trainer.cfg.train.seed,
        "model": config_to_dict(trainer.cfg.model),
    }  # lets `mcore-rl convert mcore-to-hf` read it
    save_dir = trainer.cfg.checkpoint.save_dir
    if save_dir is None:
        raise ValueError("checkpoint.save_dir: not set, so there is nowhere to save")
    common = carry_provenance(trainer.hf_provenance, common, save_dir)
    return checkpoint.save_checkpoint(save_dir, trainer.iteration, trainer.chunks, trainer.optimizer, common)


def sft_step(
    chunks: list[torch.nn.Module], optimizer: Any, batches: SFTBatches, train: TrainConfig | None = None
) -> dict[str, float]:
    """One optimizer step on the next global batch (the SFT warm start of RL uses it too). With MTP
    draft heads on the model, `train`'s `mtp_loss` trains them beside the policy (train/mtp_loss.py)."""
    for chunk in chunks:
        chunk.train()
    if train is not None and any(has_mtp_heads(unwrap_model(c)) for c in chunks):
        step = MTPForwardStep(train.mtp_loss, train.mtp_loss_coeff)
        result = forward_backward(chunks, next(batches), forward_step=step)
        stats = {**optimizer.step(), **step.metrics()}
    else:
        result = forward_backward(chunks, next(batches))
        stats = optimizer.step()
    return {"loss": result["loss"], "num_tokens": result["num_tokens"], **stats}


def train_step(trainer: Trainer) -> dict[str, float]:
    out = sft_step(trainer.chunks, trainer.optimizer, trainer.batches, trainer.cfg.train)
    trainer.iteration += 1
    return out


@torch.no_grad()
def evaluate(trainer: Trainer) -> float:
    """Token-mean loss on the held-out rows."""
    from megatron.core import parallel_state as ps

    rows, mbs = trainer.eval_rows, trainer.cfg.train.micro_batch_size
    assert rows is not None
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = next(iter(rows.values())).shape[0] // dp
    mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in rows.items()}
    microbatches = [{k: v[i : i + mbs] for k, v in mine.items()} for i in range(0, per_rank, mbs)]
    for chunk in trainer.chunks:
        chunk.eval()
    return forward_backward(trainer.chunks, microbatches, forward_only=True)["loss"]


def run_sft(cfg: SFTConfig) -> list[dict[str, Any]]:
    """Train as configured; returns the logged records (on every rank). Metrics go to the sinks of
    `logging` (metrics.jsonl always), with per-phase times, tokens/s and MFU per device (the tokens
    of the global batch's packed rows) and, after the first step, the time to first step."""
    ttfs.begin_run()
    trainer = build_trainer(cfg)
    t = cfg.train
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.run_dir, "config.yaml"))
    observer = RunObserver(cfg, rank0, dist.get_world_size(), t.seq_length, _log0)
    try:
        return _train(trainer, observer)
    finally:
        observer.close()


def _train(trainer: Trainer, observer: RunObserver) -> list[dict[str, Any]]:
    cfg, t = trainer.cfg, trainer.cfg.train
    if cfg.checkpoint.load_dir:
        observer.writer.resume(trainer.iteration)
    records: list[dict[str, Any]] = []
    accuracy = _task_accuracy(trainer)
    if accuracy is not None:
        _log0(f"{cfg.data.synthetic_task} accuracy before training: {accuracy:.1%}")
    window_tokens, window_start = 0.0, time.perf_counter()
    timer, batch_tokens = observer.timer, t.global_batch_size * t.seq_length
    while trainer.iteration < t.train_iters:
        with observer.profile(trainer.iteration + 1, trainer.iteration + 1), timer.phase("train"):
            step = train_step(trainer)
        window_tokens += step["num_tokens"]
        record: dict[str, Any] = {
            "step": trainer.iteration,
            "loss": step["loss"],
            "lr": step["lr"],
            "grad_norm": step["grad_norm"],
            "skipped": step["skipped"],
        }
        record.update(observer.perf(batch_tokens, timer.seconds["train"]))
        record.update(observer.first_step_done())
        if t.eval_interval > 0 and (trainer.iteration % t.eval_interval == 0 or trainer.iteration == t.train_iters):
            with timer.phase("eval"):
                record["eval_loss"] = evaluate(trainer)
                accuracy = _task_accuracy(trainer)
            if accuracy is not None:
                record["eval_accuracy"] = accuracy
        if trainer.iteration % t.log_interval == 0 or trainer.iteration == t.train_iters or "eval_loss" in record:
            elapsed = time.perf_counter() - window_start
            record["tokens_per_s"] = window_tokens / max(elapsed, 1e-9)
            window_tokens, window_start = 0.0, time.perf_counter()
            _log0(_format(record, t.train_iters))
        record.update(timer.take())  # this step's train and eval, the previous step's checkpoint
        records.append(record)
        observer.writer.write(record)
        interval = cfg.checkpoint.save_interval
        stop = stop_requested() if trainer.iteration < t.train_iters else None  # launch: pre-emption (collective)
        if cfg.checkpoint.save_dir and ((interval > 0 and trainer.iteration % interval == 0) or stop):
            with timer.phase("checkpoint"):
                _log0(f"saved {save(trainer)}")
        if stop:
            saved = (
                checkpoint.checkpoint_dir(cfg.checkpoint.save_dir, trainer.iteration)
                if cfg.checkpoint.save_dir
                else None
            )
            raise preempted(cfg.run_dir, trainer.iteration, stop, saved)
    if cfg.checkpoint.save_dir and (
        cfg.checkpoint.save_interval <= 0 or trainer.iteration % cfg.checkpoint.save_interval
    ):
        _log0(f"saved {save(trainer)}")
    if records and "eval_accuracy" in records[-1]:
        _log0(
            f"{cfg.data.synthetic_task} accuracy after training: {records[-1]['eval_accuracy']:.1%} "
            "(greedy, 200 freshly drawn problems)"
        )
    return records


def _task_accuracy(trainer: Trainer) -> float | None:
    """Greedy accuracy on the task's held-out problems; None when training on a data file."""
    cfg = trainer.cfg
    if cfg.data.path is not None or cfg.train.eval_interval <= 0:
        return None
    from mcore_rl.train.task_accuracy import greedy_task_accuracy  # lazy: transformers

    task = get_task(cfg.data.synthetic_task, max_digits=cfg.data.synthetic_max_digits)
    return greedy_task_accuracy(trainer.chunks, cfg.model, task, trainer.tokenizer, cfg.train.seed)


def _format(r: dict[str, Any], total: int) -> str:
    parts = [f"step {r['step']:>5}/{total}", f"loss {r['loss']:.4f}"]
    if "eval_loss" in r:
        parts.append(f"eval_loss {r['eval_loss']:.4f}")
    if "eval_accuracy" in r:
        parts.append(f"eval_acc {r['eval_accuracy']:.1%}")
    parts += [f"lr {r['lr']:.2e}", f"grad_norm {r['grad_norm']:.3f}"]
    if "tokens_per_s" in r:
        parts.append(f"{r['tokens_per_s']:.0f} tok/s")
    return " | ".join(parts)


def _log0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
