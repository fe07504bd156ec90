"""EffOPD's weight extrapolation applied to the trainer's model chunks, and the recipe that runs it
after the optimizer steps of steps 1, 2, 4, ... (`distill.effopd`; the arithmetic and the
validation rule are the pure functions of `mcore_rl.algos.distill.effopd`).

The weights that count are the optimizer's fp32 masters when it keeps them (bf16 training with
`ModelParallelAdamW`): candidates are computed and restored there and copied into the model's
params, so a rejected candidate leaves params *and* masters bit-identical to before. Optimizer
state (Adam moments, step count) is left as it is; the summary we worked from does not say what
the paper does (docs/design.md#paper-methods).
Every rank extrapolates its own shards (the update is elementwise), so all ranks must take the
same decisions: the score `evaluate` returns must be the same on every rank.

How the recipe calls it (`EffOPD.after_optimizer`):

    ex = WeightExtrapolator(model_chunks, optimizer)  # after the initial weights are loaded,
                                                      # before the first update: W_0 is the anchor
    for step in 1, 2, …:                              # step = updates done so far
        … rollouts, the learner's update: the model now holds W_step …
        if ex.due(step):                              # steps 1, 2, 4, 8, …
            result = ex.run(step, evaluate)
            # the model holds the accepted weights (W_step if candidate 1 failed)
            if result.engine_stale:                   # the engine last saw a rejected candidate
                … push the weights to the engine again …
        … the usual weight sync for the next rollouts …

`evaluate()` pushes the model's *current* weights to the rollout engine, generates on the
validation set (the paper: 50 training samples) and returns its score (mean reward/accuracy);
`run` calls it once for W_step (unless `base_score` is given) and once per candidate tried.
`state_dict()`/`load_state_dict()` carry the anchor (one fp32 copy of the params) across
checkpoints; without it, a resumed run re-anchors at its resume weights (`reset_anchor()`).

Δ at step 2^n is measured from the weights training continued from at step 2^(n−1), i.e. after
that step's accepted extrapolation (the summary leaves pre/post open; measuring from the weights
before the jump would fold each jump into the next Δ and compound them). At step 1, Δ = W_1 − W_0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import torch

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.distill.effopd import NUM_CANDIDATES, SCALE, accepts, candidate, displacement, is_extrapolation_step
from mcore_rl.config.rules import Errors, need_positive
from mcore_rl.hooks import Recipe
from mcore_rl.recipes.config.effopd import EffOPDConfig
from mcore_rl.runtime.loop import broadcast
from mcore_rl.runtime.rollout_manager import SALT_VALIDATION


@dataclass
class ExtrapolationResult:
    step: int
    accepted: int  # candidates kept (0: the weights of `step` unchanged)
    coefficient: float  # the kept weights are W_step + coefficient · Δ
    base_score: float
    scores: list[float] = field(default_factory=list)  # of the candidates evaluated, in order
    engine_stale: bool = False  # the last weights `evaluate` saw are not the kept ones


def _trainable(model_chunks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class WeightExtrapolator:
    """Keeps the anchor weights between extrapolation steps and runs the accept/reject search."""

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any | None = None,
        *,
        num_candidates: int = NUM_CANDIDATES,
        scale: float = SCALE,
        offload: bool = False,
    ) -> None:
        """`offload=True` keeps the anchor (and, during `run`, W_step and Δ) in CPU memory instead
        of next to the params: two fp32 copies of the model's shards either way."""
        self.params = _trainable(model_chunks)
        if not self.params:
            raise ValueError("the model chunks have no trainable parameters")
        masters = {}
        if optimizer is not None and hasattr(optimizer, "main_params") and hasattr(optimizer, "model_params"):
            masters = {id(p): m for p, m in zip(optimizer.model_params, optimizer.main_params)}
        self.masters = [masters.get(id(p), p) for p in self.params]
        self.num_candidates = num_candidates
        self.scale = scale
        self.offload = offload
        self._anchor: list[torch.Tensor] = []
        self.reset_anchor()

    def due(self, step: int) -> bool:
        return is_extrapolation_step(step)

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the current weights as W_{2^(n−1)} for the next Δ."""
        self._anchor = self._copy()

    def _copy(self) -> list[torch.Tensor]:
        return [
            m.detach().to(device="cpu" if self.offload else m.device, dtype=torch.float32, copy=True)
            for m in self.masters
        ]

    @torch.no_grad()
    def _load(self, base: list[torch.Tensor], delta: list[torch.Tensor], k: int) -> None:
        for p, m, b, d in zip(self.params, self.masters, base, delta):
            m.copy_(candidate((b,), (d,), k, self.scale)[0])
            if m is not p:
                p.copy_(m)

    def run(self, step: int, evaluate: Callable[[], float], base_score: float | None = None) -> ExtrapolationResult:
        """Try candidates 1..num_candidates in order at an extrapolation step; keep the last one of
        the unbroken run that `accepts`, put back the kept weights after a rejection, and make
        them the next anchor. An exception from `evaluate` also restores the kept weights."""
        if not self.due(step):
            raise ValueError(f"EffOPD extrapolates at steps 1, 2, 4, 8, …; not at step {step}")
        score = float(evaluate()) if base_score is None else float(base_score)
        with torch.no_grad():
            base = self._copy()
            anchor: list[torch.Tensor | None] = list(self._anchor)
            self._anchor = []
            delta = []
            for i, b in enumerate(base):  # Δ replaces the anchor tensor by tensor: 2 copies at most
                prev = anchor[i]
                assert prev is not None  # each anchor tensor is dropped only after its Δ
                delta.append(displacement((b,), (prev,))[0])
                anchor[i] = None
        result = ExtrapolationResult(step=step, accepted=0, coefficient=0.0, base_score=score)
        best, loaded = score, 0
        try:
            for k in range(1, self.num_candidates + 1):
                self._load(base, delta, k)
                loaded = k
                s = float(evaluate())
                result.scores.append(s)
                if not accepts(s, best):
                    break
                best, result.accepted = s, k
        finally:
            if loaded != result.accepted:
                self._load(base, delta, result.accepted)
                result.engine_stale = bool(result.scores)
            result.coefficient = self.scale * result.accepted
            base.clear()
            delta.clear()
            with torch.no_grad():
                self._anchor = self._copy()
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.cpu() for a in self._anchor]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        anchor = state["anchor"]
        if len(anchor) != len(self.masters):
            raise ValueError(f"EffOPD anchor has {len(anchor)} tensors, the model {len(self.masters)}")
        self._anchor = [
            a.to(device="cpu" if self.offload else m.device, dtype=torch.float32, copy=True)
            for a, m in zip(anchor, self.masters)
        ]


class EffOPD(Recipe):
    """The extrapolator (anchored at the weights training starts or resumes from) and its fixed
    validation prompts; after the optimizer steps of a due step, each weights tried are synced to
    the engines as a new version and scored there (greedy, mean reward); the model keeps the
    accepted ones, which the step's usual sync then ships."""

    name = "effopd"

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        return cfg.distill.section(EffOPDConfig).enabled

    @classmethod
    def check(cls, cfg: RLConfig, errors: Errors) -> None:
        e = cfg.distill.section(EffOPDConfig)
        if not e.enabled:
            return
        r = cfg.rollout
        errors.need(
            r.runtime == "sync" or r.max_staleness == 0,
            "distill.effopd.enabled",
            "EffOPD scores candidate "
            "weights on the engines between updates; it needs rollout.max_staleness=0 (got "
            f"{r.max_staleness}) or rollout.runtime=sync (engines generating ahead would sample training groups "
            "from the candidates)",
        )
        errors.need(
            cfg.algorithm.mismatch.name != "mipu",
            "distill.effopd.enabled",
            "EffOPD and MIPU both accept or roll back weights after an update; use one of them",
        )
        need_positive(
            errors,
            [
                ("distill.effopd.validation_prompts", e.validation_prompts),
                ("distill.effopd.num_candidates", e.num_candidates),
            ],
        )
        errors.need(e.scale > 0, "distill.effopd.scale", f"must be > 0, got {e.scale}")

    def setup(self, run: Any) -> None:
        e = self.cfg.distill.section(EffOPDConfig)
        self.extrapolator = WeightExtrapolator(
            run.chunks, run.optimizer, num_candidates=e.num_candidates, scale=e.scale
        )
        self.prompts = run.val_prompts.take(e.validation_prompts)  # fixed for the run (every rank)

    def after_optimizer(self, run: Any, step: int) -> dict[str, float]:
        if not self.extrapolator.due(step):
            return {}

        def evaluate() -> float:
            run.sync(new_version=True)
            score = None
            if run.rank0:
                groups = run.manager.generate(self.prompts, 1, 0.0, SALT_VALIDATION)
                score = sum(g[0].reward for g in groups) / max(len(groups), 1)
            return float(broadcast(score))

        start = time.perf_counter()
        result = self.extrapolator.run(step, evaluate)
        return {
            "effopd/accepted": float(result.accepted),
            "effopd/coefficient": result.coefficient,
            "effopd/base_score": result.base_score,
            "effopd/candidates_scored": float(len(result.scores)),
            "effopd/best_score": max([result.base_score] + result.scores[: result.accepted]),
            "time/effopd_s": time.perf_counter() - start,
        }
