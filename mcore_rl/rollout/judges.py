"""The judge servers of a run (`judges:`): judge rewards name a group (`judge: <name>`) and call its
servers (`rewards/judge.py`: round-robin, the next one when one cannot be reached).

A group is running servers (`urls`) or `mcore-rl serve` processes the trainer starts on an HF
checkpoint (`model_path`), the same engine-group settings as the rollout engines, engine teachers
and the explorer (`EngineGroupConfig`). Judges are asked with text, so they keep their own
tokenizer. Started processes are the run's: they stop with it (and with its process, if it dies).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mcore_rl.config.rl_schema import JudgeConfig
from mcore_rl.rollout.engine_processes import EngineProcesses, start_engine_group


class JudgeEngines:
    """Each judge group's server URLs by name (`urls`); the processes started for groups with a
    `model_path` belong to this object until `close`."""

    def __init__(
        self, judges: Sequence[JudgeConfig], *, workdir: str, context_length: int, startup_timeout_s: float
    ) -> None:
        self.urls: dict[str, list[str]] = {}
        self._processes: list[EngineProcesses] = []
        try:
            for g in judges:
                procs = start_engine_group(
                    g,
                    workdir=os.path.join(workdir, f"judge_{g.name}"),
                    context_length=context_length,
                    startup_timeout_s=startup_timeout_s,
                )
                if procs is not None:
                    self._processes.append(procs)
                self.urls[g.name] = procs.urls if procs is not None else list(g.urls)
        except BaseException:
            self.close()  # the groups started before the one that failed
            raise

    def close(self) -> None:
        for procs in self._processes:
            procs.close()
        self._processes.clear()
