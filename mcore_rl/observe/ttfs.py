"""Time to first step: where the seconds between starting the process and the end of the first
optimizer step go, by phase, in the log and as `ttfs/<phase>_s` metrics (with `ttfs/total_s`).

The clock starts when this module is first imported, which `cli.py` does before anything heavy:
`config_check` is the recipe's loading, validation and preflight (with the registries it imports),
`imports` the trainer's modules, torch and megatron-core. Each `mark(phase)` closes the phase that
ran since the previous mark; a phase marked twice adds up. After `report()` the marks stop: later
steps are not "first".
"""

from __future__ import annotations

import time
from collections.abc import Callable

# the phases in the order a run meets them (a run skips those it does not have)
PHASES = (
    "config_check",
    "imports",
    "distributed_init",
    "model_build",
    "data",
    "metrics_setup",
    "checkpoint_load",
    "warm_start",
    "reference_model",
    "critic",
    "engine_start",
    "first_weight_sync",
    "eval_at_start",
    "first_rollout",
    "first_train_step",
)

_start = time.perf_counter()


class TimeToFirstStep:
    def __init__(self, start: float | None = None) -> None:
        self.start = self.last = _start if start is None else start
        self.phases: dict[str, float] = {}
        self.done = False

    def mark(self, phase: str) -> None:
        if self.done:
            return
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def metrics(self) -> dict[str, float]:
        out = {f"ttfs/{name}_s": s for name, s in self.phases.items()}
        out["ttfs/total_s"] = self.last - self.start
        return out

    def report(self, log: Callable[[str], None]) -> dict[str, float]:
        """The breakdown as a log line and as metrics; marks stop counting afterwards."""
        metrics = self.metrics()
        self.done = True
        parts = " | ".join(f"{name} {s:.1f}" for name, s in self.phases.items())
        log(f"time to first step: {metrics['ttfs/total_s']:.1f} s ({parts})")
        return metrics


TTFS = TimeToFirstStep()  # the process's clock (one run per process; tests that run several reset it)


def mark(phase: str) -> None:
    TTFS.mark(phase)


def begin_run() -> TimeToFirstStep:
    """The clock of the run starting now: the process's (a phase `imports` ends here), or, for a
    run after a finished one in the same process (tests), a fresh clock starting now."""
    global TTFS
    if TTFS.done:
        TTFS = TimeToFirstStep(time.perf_counter())
    else:
        TTFS.mark("imports")
    return TTFS
