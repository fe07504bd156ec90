"""Re-Math's early-stopped refresh ("A Local Perturbation Theory for Cross-Domain Interference
and Recovery in Multi-Domain RL"): after sequential multi-domain stages, a short GRPO stage on the
domain that degraded, stopped as soon as that domain's held-out score stops improving. The paper
gives no number of steps ("very few, early-stopped") and warns that a long refresh causes new
interference, so the stop is what matters.

A stage with `stop_patience: P > 0` (the last stage only, since stopping ends the run) watches
`stop_metric` (default `eval/<the stage's one domain>/score`) at every evaluation made in the stage:
the first one sets the best score, a later one improves it when it exceeds the best by more than
`stop_min_delta`, and the run ends after P evaluations in a row without an improvement. The
evaluation cadence is `eval.interval`; save a checkpoint at each evaluation
(`checkpoint.save_interval = eval.interval`) to keep the best one (`best_step` in the log). The
counter is not checkpointed: a resumed refresh starts counting afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.config.rl_schema import MixtureStageConfig, RLConfig
from mcore_rl.config.rules import Errors
from mcore_rl.hooks import Recipe
from mcore_rl.recipes.config.remath import RefreshStopConfig


@dataclass
class PatienceStop:
    start_step: int  # the stage's first training step (0-based); evals after fewer steps are not its own
    patience: int
    metric: str
    min_delta: float = 0.0
    best: float | None = None
    best_step: int | None = None
    bad: int = 0

    def observe(self, rl_step: int, metrics: dict[str, Any]) -> bool:
        """An evaluation after `rl_step` steps; True when the run should stop here."""
        if rl_step < self.start_step or self.metric not in metrics:
            return False
        value = float(metrics[self.metric])
        if self.best is None or value > self.best + self.min_delta:
            self.best, self.best_step, self.bad = value, rl_step, 0
            return False
        self.bad += 1
        return self.bad >= self.patience


def refresh_stop_metric(stage: MixtureStageConfig) -> str | None:
    """`stop_metric`, else `eval/<domain>/score` for a stage that trains one domain (None otherwise)."""
    metric = stage.section(RefreshStopConfig).metric
    if metric:
        return metric
    active = [d for d, w in stage.weights.items() if w > 0]
    return f"eval/{active[0]}/score" if len(active) == 1 else None


def from_config(cfg: RLConfig) -> PatienceStop | None:
    """The refresh stop of the run's last mixture stage, if it has `stop_patience` (validated before)."""
    stages = cfg.data.mixture.stages
    if not stages or stages[-1].section(RefreshStopConfig).patience <= 0:
        return None
    last = stages[-1]
    stop = last.section(RefreshStopConfig)
    metric = refresh_stop_metric(last)
    assert metric is not None, "validation requires a stop metric"
    return PatienceStop(last.start_step, stop.patience, metric, stop.min_delta)


class RefreshStop(Recipe):
    """Ends the run when the refresh stage's watched score stops improving."""

    name = "remath_refresh"

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        stop = from_config(cfg)
        assert stop is not None, "enabled() requires a stop_patience"
        self.stop = stop
        self.stopped = False

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        stages = cfg.data.mixture.stages
        return bool(stages) and stages[-1].section(RefreshStopConfig).patience > 0

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        """The last stage, evaluated, sync, with a metric to watch."""
        stages = cfg.data.mixture.stages
        names = [d.name for d in cfg.data.domains]
        for k, st in enumerate(stages):
            stop = st.section(RefreshStopConfig)
            if stop.patience == 0:
                continue
            key = f"data.mixture.stages[{k}]"
            errors.need(stop.patience > 0, f"{key}.stop_patience", f"must be >= 1 (0 = off), got {stop.patience}")
            errors.need(k == len(stages) - 1, f"{key}.stop_patience", "only the last stage can stop the run early")
            errors.need(cfg.eval.interval > 0, f"{key}.stop_patience", "needs periodic evaluations (eval.interval > 0)")
            errors.need(
                cfg.rollout.runtime == "sync",
                f"{key}.stop_patience",
                "needs rollout.runtime=sync (the asynchronous runtime has rollouts of later steps in flight)",
            )
            errors.need(stop.min_delta >= 0, f"{key}.stop_min_delta", f"must be >= 0, got {stop.min_delta}")
            metric = refresh_stop_metric(st)
            errors.need(
                metric is not None,
                f"{key}.stop_metric",
                f"the stage trains several domains {sorted(d for d, w in st.weights.items() if w > 0)}: "
                "name the metric to watch (e.g. eval/<domain>/score)",
            )
            if metric is not None and stop.metric is None:
                errors.need(metric.split("/")[1] in names, f"{key}.weights", f"unknown domain in {metric}")

    def after_eval(self, rl_step: int, metrics: dict[str, float]) -> tuple[dict[str, float], str | None]:
        s = self.stop
        if not s.observe(rl_step, metrics):
            return {}, None
        self.stopped = True
        return {"refresh/stopped": 1.0}, (
            f"early stop after step {rl_step}: {s.metric} has not improved for "
            f"{s.patience} evaluation(s); best {s.best:.4f} after step {s.best_step}"
        )

    def summary(self) -> dict[str, Any]:
        return {"refresh": {"stopped": self.stopped, "best": self.stop.best, "best_step": self.stop.best_step}}
