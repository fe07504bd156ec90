"""Per-phase wall time of a step, as `time/<phase>_s` metrics (what `tools/phase_breakdown.py` reads).

The phases of an RL step: `generate` (the engines, until the batch is complete), `reward`,
`logprobs` (the recompute of π_old and π_ref), `train` (forward + backward + optimizer over the
step's mini-batches), `sync` (weights to the engines), `eval`, `checkpoint`, and `idle` (the
trainer waiting for rollouts: the whole collection in the synchronous loop, the wait on the buffer
in the asynchronous one). SFT steps have `train`, `eval` and `checkpoint`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

PHASES = ("generate", "reward", "logprobs", "train", "sync", "eval", "checkpoint", "idle")


def phase_key(phase: str) -> str:
    return f"time/{phase}_s"


class PhaseTimer:
    """Sums the seconds spent in each phase until `take()` hands them out and starts over."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The phases timed since the last call, as metrics."""
        out = {phase_key(name): s for name, s in self.seconds.items()}
        self.seconds = {}
        return out
