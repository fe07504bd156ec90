"""torch.profiler traces and memory snapshots of chosen optimizer steps (`logging.profile_steps`,
`logging.memory_snapshot_steps`), written under `run_dir/profile/`:

- `step_<n>.rank<r>.trace.json`: the Chrome/Perfetto trace of step n (CPU ops, and CUDA kernels on GPU);
- `step_<n>.rank<r>.memory.json` on CPU: the profiler's memory timeline (`profile_memory`, bytes per
  category over time); on CUDA `step_<n>.rank<r>.memory.pickle`, the allocator's snapshot
  (`torch.cuda.memory._record_memory_history` + `_dump_snapshot`, open it in pytorch.org/memory_viz).

A step with neither costs nothing: `step()` is then an empty context.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class StepProfiler:
    def __init__(self, run_dir: str, profile_steps: list[int], memory_snapshot_steps: list[int]) -> None:
        self.dir = os.path.join(run_dir, "profile")
        self.profile_steps, self.memory_steps = set(profile_steps), set(memory_snapshot_steps)
        self.written: list[str] = []

    def wants(self, step: int) -> bool:
        return step in self.profile_steps or step in self.memory_steps

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Profile what runs inside as optimizer step `step` (a step of several optimizer steps, as
        an RL rollout step, is profiled when any of them is chosen)."""
        if not self.wants(step):
            yield
            return
        os.makedirs(self.dir, exist_ok=True)
        stem = os.path.join(self.dir, f"step_{step}.rank{_rank()}")
        memory, cuda = step in self.memory_steps, torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if memory and cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        cpu_memory = memory and not cuda
        prof = torch.profiler.profile(
            activities=activities, record_shapes=cpu_memory, profile_memory=memory, with_stack=cpu_memory
        )
        try:
            with prof:
                yield
        finally:
            if step in self.profile_steps:
                prof.export_chrome_trace(stem + ".trace.json")
                self.written.append(stem + ".trace.json")
            if memory and cuda:
                torch.cuda.memory._dump_snapshot(stem + ".memory.pickle")
                torch.cuda.memory._record_memory_history(enabled=None)
                self.written.append(stem + ".memory.pickle")
            elif memory:
                with warnings.catch_warnings():  # deprecated for CUDA; the one memory timeline on CPU
                    warnings.simplefilter("ignore", FutureWarning)
                    prof.export_memory_timeline(stem + ".memory.json", device="cpu")
                self.written.append(stem + ".memory.json")
            logger.info("profile of step %d: %s", step, ", ".join(p for p in self.written if p.startswith(stem)))
