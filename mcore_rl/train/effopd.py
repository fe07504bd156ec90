"""EffOPD's weight extrapolation applied to the trainer's model chunks (the arithmetic and the
validation rule are the pure functions of `mcore_rl.algos.distill.effopd`).

The weights that count are the optimizer's fp32 masters when it keeps them (bf16 training with
`ModelParallelAdamW`): candidates are computed and restored there and copied into the model's
params, so a rejected candidate leaves params *and* masters bit-identical to before. Optimizer
state (Adam moments, step count) is left as it is; the notes do not say what the paper does.
Every rank extrapolates its own shards (the update is elementwise), so all ranks must take the
same decisions: the score `evaluate` returns must be the same on every rank.

How the loop calls it (`runtime/loop.py`):

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
that step's accepted extrapolation (the notes leave pre/post open; measuring from the weights
before the jump would fold each jump into the next Δ and compound them). At step 1, Δ = W_1 − W_0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from mcore_rl.algos.distill.effopd import NUM_CANDIDATES, SCALE, accepts, candidate, displacement, is_extrapolation_step


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
    out = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class WeightExtrapolator:
    """Keeps the anchor weights between extrapolation steps and runs the accept/reject search."""

    def __init__(
        self, model_chunks: Sequence[torch.nn.Module], optimizer: Optional[Any] = None, *,
        num_candidates: int = NUM_CANDIDATES, scale: float = SCALE, offload: bool = False,
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
        return [m.detach().to(device="cpu" if self.offload else m.device, dtype=torch.float32, copy=True)
                for m in self.masters]

    @torch.no_grad()
    def _load(self, base: list[torch.Tensor], delta: list[torch.Tensor], k: int) -> None:
        for p, m, b, d in zip(self.params, self.masters, base, delta):
            m.copy_(candidate((b,), (d,), k, self.scale)[0])
            if m is not p:
                p.copy_(m)

    def run(self, step: int, evaluate: Callable[[], float], base_score: Optional[float] = None) -> ExtrapolationResult:
        """Try candidates 1..num_candidates in order at an extrapolation step; keep the last one of
        the unbroken run that `accepts`, put back the kept weights after a rejection, and make
        them the next anchor. An exception from `evaluate` also restores the kept weights."""
        if not self.due(step):
            raise ValueError(f"EffOPD extrapolates at steps 1, 2, 4, 8, …; not at step {step}")
        score = float(evaluate()) if base_score is None else float(base_score)
        with torch.no_grad():
            base = self._copy()
            anchor: list[Optional[torch.Tensor]] = list(self._anchor)
            self._anchor = []
            delta = []
            for i, b in enumerate(base):  # Δ replaces the anchor tensor by tensor: 2 copies at most
                delta.append(displacement((b,), (anchor[i],))[0])
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
        self._anchor = [a.to(device="cpu" if self.offload else m.device, dtype=torch.float32, copy=True)
                        for a, m in zip(anchor, self.masters)]
