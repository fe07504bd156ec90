"""Where a run's metrics go: `metrics.jsonl` always (one JSON object per optimizer step), TensorBoard
scalars and Weights & Biases optionally (`logging.tensorboard`, `logging.wandb`). Rank 0 writes;
other ranks no-op. W&B is an optional extra, imported only when asked for; its offline mode
(the default) writes `run_dir/wandb/` without touching the network (`wandb sync` uploads it later).
"""

from __future__ import annotations

import json
import math
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: TensorBoard and the config load when a run asks for them
    from torch.utils.tensorboard import SummaryWriter

    from mcore_rl.config.observability import ObservabilityConfig

logger = logging.getLogger(__name__)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class WandbSink:
    """One W&B run in `run_dir/wandb`; numbers only, keyed by the record's `step`."""

    def __init__(
        self,
        run_dir: str,
        project: str,
        name: str,
        mode: str,
        config: dict | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("logging.wandb=true needs the `wandb` package: pip install 'mcore-rl[wandb]'") from err
        os.makedirs(os.path.join(run_dir, "wandb"), exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name or os.path.basename(os.path.normpath(run_dir)),
            dir=run_dir,
            mode=mode,
            config=config or {},
            reinit="finish_previous",
        )

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self.run.log({k: v for k, v in record.items() if k != "step" and _number(v)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        tensorboard: bool,
        logging: ObservabilityConfig | None = None,
        config: dict | None = None,
    ) -> None:
        """`logging`: the run's `logging` section (config/observability.py), for the W&B sink."""
        self.run_dir, self.enabled = run_dir, enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb: SummaryWriter | None = None
        self.wandb: WandbSink | None = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            if tensorboard:
                self.tb = self._tensorboard()
            if logging is not None and logging.wandb:
                self.wandb = WandbSink(run_dir, logging.wandb_project, logging.wandb_name, logging.wandb_mode, config)

    def _tensorboard(self, purge_step: int | None = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(os.path.join(self.run_dir, "tensorboard"), purge_step=purge_step)

    def resume(self, step: int) -> None:
        """Continue the metrics of a run resumed from the checkpoint of optimizer step `step`: what
        was logged after it is dropped (jsonl) or hidden (TensorBoard), since it is written again."""
        if not self.enabled:
            return
        drop_records_after(self.path, step)
        if self.tb is not None:
            self.tb.close()
            self.tb = self._tensorboard(purge_step=step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(_clean(record)) + "\n")
        if self.tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and _number(value):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.write(record)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: write them as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_records_after(path: str, step: int) -> int:
    """Cut a `metrics.jsonl` back to the checkpoint a run resumes from: drop the records of steps
    after `step` (and a line torn by a kill), which a kill between writing metrics and saving left
    behind and which the resumed run writes again. Returns how many lines were dropped."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or (isinstance(record.get("step"), (int, float)) and record["step"] > step):
                dropped += 1
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        logger.warning("%s: dropped %d record(s) past step %d, the checkpoint resumed from", path, dropped, step)
    return dropped
