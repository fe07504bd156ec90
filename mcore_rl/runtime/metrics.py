"""Run metrics: `metrics.jsonl` (one JSON object per optimizer step), TensorBoard scalars, and a PNG
of the reward, evaluation score and mismatch curves at the end (per domain too in a multi-domain
run: the `<kind>/<domain>/<name>` keys). Rank 0 writes; other ranks no-op.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool) -> None:
        self.run_dir, self.enabled = run_dir, enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tb: Any = None
        if enabled:
            os.makedirs(run_dir, exist_ok=True)
            if tensorboard:
                self.tb = self._tensorboard()

    def _tensorboard(self, purge_step: Optional[int] = None) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(os.path.join(self.run_dir, "tensorboard"), purge_step=purge_step)

    def resume(self, step: int) -> None:
        """Continue the metrics of a run resumed from the checkpoint of optimizer step `step`: what
        was logged after it is dropped (jsonl) or hidden (TensorBoard), since it is written again."""
        if not self.enabled:
            return
        from mcore_rl.train.checkpoint import drop_records_after

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
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: write them as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def domains_of(records: Iterable[dict[str, Any]]) -> list[str]:
    """The domains a multi-domain run logged (`reward/<domain>/mean`), in order of appearance."""
    seen: dict[str, None] = {}
    for r in records:
        for key in r:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean":
                seen.setdefault(parts[1])
    return list(seen)


def plot_curves(records: list[dict[str, Any]], path: str, title: Optional[str] = None) -> str:
    """Training reward (per rollout batch), held-out eval score, mismatch K3 and, in a multi-domain
    run, the response length: one line for the run and one per domain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = domains_of(records)
    panels = [("reward/mean", "reward/{}/mean", "training reward (mean over rollouts)"),
              ("eval/score", "eval/{}/score", "held-out eval score"),
              ("mismatch/k3", "mismatch/{}/k3", "mismatch K3 (exp(d)-d-1, d = log π - log μ)")]
    if domains:
        panels.append(("response/length_mean", "response/{}/length_mean", "response length (tokens)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, per_domain, label) in zip(axes, panels):
        lines = [(key, "all" if domains else None)] + [(per_domain.format(d), d) for d in domains]
        for k, name in lines:
            xs, ys = _series(records, k)
            if xs:
                ax.plot(xs, ys, marker="o" if key == "eval/score" else None, markersize=3, label=name,
                        linewidth=2 if name == "all" else 1)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if domains:
            ax.legend(fontsize=8)
        ys_all = [y for k, _ in lines for y in _series(records, k)[1]]
        if key == "mismatch/k3" and ys_all and min(ys_all) > 0:
            ax.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
