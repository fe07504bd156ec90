"""The one rule of `checkpoint.preempt_signals` (docs/launch.md): names of catchable signals.

Checked with the rest of the config, so a typo fails before any worker starts rather than when
the cluster sends the signal."""

from __future__ import annotations

import signal

from mcore_rl.config.rules import Errors
from mcore_rl.config.schema import CheckpointConfig

# the trainer cannot catch these, or needs them for itself (SIGINT stays KeyboardInterrupt)
_UNCATCHABLE = {"SIGKILL", "SIGSTOP", "SIGINT", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"}


def check_preempt_signals(c: CheckpointConfig, errors: Errors) -> None:
    key = "checkpoint.preempt_signals"
    for name in c.preempt_signals:
        if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
            errors.need(False, key, f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1, SIGUSR2)")
        else:
            errors.need(
                name not in _UNCATCHABLE,
                key,
                f"{name} cannot be used (the trainer cannot catch it, or needs it itself)",
            )
    errors.need(
        len(set(c.preempt_signals)) == len(c.preempt_signals), key, f"lists a signal twice: {c.preempt_signals}"
    )
