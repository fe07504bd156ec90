"""Learning-rate schedule: linear warmup, then constant / linear / cosine / step decay to `min_lr`.

`step` is the LR-decay baseline of MIPU ("Beyond Precision: Training-Inference Mismatch is
an Optimization Problem and Simple LR Scheduling Fixes It"): a constant rate, then, from update
`lr_step_start_iter` on, the rate times `lr_step_factor` (0.5: halved) every `lr_step_period` updates,
never below `min_lr` (the paper: 0.1·lr). The paper starts phase 2 when "a potential-instability
signal" appears, which the summary we worked from leaves unclear: here the start is an update number fixed beforehand
(from a pilot run's response length, as the paper finds its period), and the first halving happens
at that update itself (the signal is a reason to act at once).

Kept separate from the optimizer so it can be checkpointed, plotted and tested on its own.

Convention: `get_lr()` is the rate for the *next* optimizer update, numbered `num_steps`
(0-based). Warmup reaches `lr` at update `lr_warmup_iters - 1` and never returns 0, so the first
update is not wasted (megatron-core starts warmup at `init_lr=0`). Decay runs from update
`lr_warmup_iters` to update `total_iters`, after which the rate stays at `min_lr`.
"""

from __future__ import annotations

import math
from typing import Any

from mcore_rl.algos.mipu import lr_decay_baseline
from mcore_rl.config.schema import OptimizerConfig


class LRScheduler:
    """Stateless function of `num_steps`; `step()` only advances the counter."""

    def __init__(self, cfg: OptimizerConfig, total_iters: int) -> None:
        if total_iters < 0:
            raise ValueError(f"total_iters must be >= 0, got {total_iters}")
        if cfg.lr_warmup_iters < 0:
            raise ValueError(f"optimizer.lr_warmup_iters must be >= 0, got {cfg.lr_warmup_iters}")
        if cfg.min_lr > cfg.lr:
            raise ValueError(f"optimizer.min_lr ({cfg.min_lr}) must be <= optimizer.lr ({cfg.lr})")
        self.max_lr = float(cfg.lr)
        self.min_lr = float(cfg.min_lr)
        self.warmup_iters = int(cfg.lr_warmup_iters)
        self.decay_style = cfg.lr_decay_style
        if self.decay_style == "step" and (cfg.lr_step_period < 1 or not 0 < cfg.lr_step_factor < 1):
            raise ValueError(
                "optimizer.lr_decay_style=step needs lr_step_period >= 1 and lr_step_factor in (0, 1), "
                f"got {cfg.lr_step_period} and {cfg.lr_step_factor}"
            )
        self.step_start = int(cfg.lr_step_start_iter)
        self.step_period = int(cfg.lr_step_period)
        self.step_factor = float(cfg.lr_step_factor)
        self.total_iters = int(total_iters)
        self.num_steps = 0

    def lr_at(self, step: int) -> float:
        """Rate for update number `step` (0-based)."""
        if step < self.warmup_iters:
            return self.max_lr * (step + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if self.decay_style == "step":
            return lr_decay_baseline(
                step, self.max_lr, self.step_start, self.step_period, factor=self.step_factor, min_lr=self.min_lr
            )
        decay_iters = self.total_iters - self.warmup_iters
        if decay_iters <= 0:
            return self.min_lr
        progress = min(max((step - self.warmup_iters) / decay_iters, 0.0), 1.0)
        if self.decay_style == "linear":
            coeff = 1.0 - progress
        elif self.decay_style == "cosine":
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            raise ValueError(f"unknown optimizer.lr_decay_style {self.decay_style!r}")
        return self.min_lr + (self.max_lr - self.min_lr) * coeff

    def get_lr(self) -> float:
        return self.lr_at(self.num_steps)

    def step(self, increment: int = 1) -> float:
        """Advance after a successful update; returns the rate for the next one."""
        self.num_steps += increment
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_style": self.decay_style,
            "total_iters": self.total_iters,
            "step_start": self.step_start,
            "step_period": self.step_period,
            "step_factor": self.step_factor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only the position is restored: the schedule's shape follows the current config, so a
        resumed run may change lr/min_lr/total_iters on purpose."""
        self.num_steps = int(state["num_steps"])
