"""What one `mcore-rl sft` / `mcore-rl train` process observes of its run, in one object: the
metrics sinks, the per-phase timer, tokens/s and MFU, the profiled steps and time to first step.
Every rank builds one (the profiler and the timers run on every rank); rank 0 writes the metrics.
"""

from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import Callable, Iterator

from mcore_rl.observe import ttfs
from mcore_rl.observe.profiling import StepProfiler
from mcore_rl.observe.sinks import MetricsWriter
from mcore_rl.observe.throughput import Throughput
from mcore_rl.observe.timers import PhaseTimer
from mcore_rl.config import config_to_dict


class RunObserver:
    def __init__(self, cfg: Any, rank0: bool, world_size: int, seq_length: int, log: Callable[[str], None]) -> None:
        lg = cfg.logging
        self.log, self.rank0 = log, rank0
        self.clock = ttfs.TTFS  # begun by the run's driver (`ttfs.begin_run()`) before the model was built
        self.writer = MetricsWriter(cfg.run_dir, rank0, lg.tensorboard, lg, config_to_dict(cfg) if lg.wandb else None)
        self.timer = PhaseTimer()
        self.profiler = StepProfiler(cfg.run_dir, lg.profile_steps, lg.memory_snapshot_steps)
        self.throughput = (
            Throughput.for_run(
                cfg.model, seq_length, cfg.train.recompute, cfg.train.precision, lg.peak_flops_per_device, world_size
            )
            if rank0
            else None
        )
        self.clock.mark("metrics_setup")  # TensorBoard, W&B, the CPU peak's probe
        if self.throughput is not None:
            log(self.throughput.describe())

    def perf(self, tokens: float, seconds: float) -> dict[str, float]:
        """tokens/s and MFU per device of `tokens` trained in `seconds` (rank 0; {} elsewhere)."""
        return self.throughput.metrics(tokens, seconds) if self.throughput is not None else {}

    @contextlib.contextmanager
    def profile(self, first_step: int, last_step: int) -> Iterator[None]:
        """Profile optimizer steps first_step..last_step (one trace) if any of them was chosen."""
        chosen = [s for s in range(first_step, last_step + 1) if self.profiler.wants(s)]
        if not chosen:
            yield
            return
        with self.profiler.step(chosen[0]):
            yield

    def first_step_done(self) -> dict[str, float]:
        """Call after each step: the time-to-first-step metrics after the first, {} afterwards."""
        if self.clock.done:
            return {}
        self.clock.mark("first_train_step")
        return self.clock.report(self.log)

    def close(self) -> None:
        self.writer.close()
