"""Cross-field rules of an SFT config that would otherwise fail late, inside megatron-core.

`validate_sft_config` composes the shared section rules of `mcore_rl.config.rules` (model,
parallel layout, optimizer, task name) with the SFT batch rules below. All violated rules are
reported together in one `ConfigError`, one line per rule, each naming the dotted key to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.config.observability import check_observability
from mcore_rl.config.preemption import check_preempt_signals
from mcore_rl.config.rules import (
    Errors,
    check_layout,
    check_model_sizes,
    check_optimizer,
    check_parallel_sizes,
    check_task_name,
    need_positive,
)
from mcore_rl.config.schema import DataConfig, ParallelConfig, SFTConfig, TrainConfig


@dataclass(frozen=True)
class DerivedSizes:
    """Sizes that follow from the config and the world size; the trainer needs them anyway."""

    data_parallel_size: int
    expert_data_parallel_size: int
    num_microbatches: int


def validate_sft_config(cfg: SFTConfig, world_size: int, errors: Errors | None = None) -> DerivedSizes:
    """Raise `ConfigError` listing every impossible combination; otherwise return derived sizes.
    `errors` lets `mcore-rl profile` validate for a target cluster (`Errors(assume_transformer_engine=True)`)."""
    errors = errors if errors is not None else Errors()
    sizes_ok = check_parallel_sizes(cfg.parallel, world_size, errors)
    sizes_ok &= check_model_sizes(cfg.model, errors)
    sizes_ok &= check_train_sizes(cfg.train, errors)
    dp = edp = num_microbatches = 0
    if sizes_ok:  # the rules below divide by these sizes
        dp, edp = check_layout(cfg.model, cfg.parallel, cfg.train.seq_length, world_size, errors)
        num_microbatches = check_batch(cfg.train, cfg.parallel, dp, errors)
    check_optimizer(cfg.optimizer, errors)
    check_data(cfg.data, errors)
    check_observability(cfg.logging, errors)  # observability
    check_preempt_signals(cfg.checkpoint, errors)  # launch: pre-emption signals
    errors.raise_if_any()
    return DerivedSizes(dp, edp, num_microbatches)


def check_train_sizes(t: TrainConfig, errors: Errors) -> bool:
    """Row length and batch sizes must be positive before batches are divided into micro-batches."""
    ok = need_positive(
        errors,
        [
            ("train.seq_length", t.seq_length),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.global_batch_size", t.global_batch_size),
        ],
    )
    errors.need(t.train_iters >= 0, "train.train_iters", f"must be >= 0, got {t.train_iters}")
    return ok


def check_batch(t: TrainConfig, p: ParallelConfig, dp: int, errors: Errors) -> int:
    """A global batch is whole micro-batches on every DP rank; returns their number (0 = undefined)."""
    if not dp:  # the world size does not divide; reported by check_parallel
        return 0
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    per_step = t.micro_batch_size * dp
    if not errors.need(
        t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} is not divisible by micro_batch_size ({t.micro_batch_size}) x "
        f"data parallel size ({dp}) = {per_step}",
    ):
        return 0
    num_microbatches = t.global_batch_size // per_step
    if vpp is not None and pp > 1:
        errors.need(
            num_microbatches % pp == 0,
            "train.global_batch_size",
            f"gives {num_microbatches} micro-batches per step, which the interleaved pipeline "
            f"schedule needs to be a multiple of pipeline_model_parallel_size {pp}",
        )
    return num_microbatches


def check_data(d: DataConfig, errors: Errors) -> None:
    """The synthetic task is picked by name from the task registry."""
    check_task_name(d.synthetic_task, errors)
