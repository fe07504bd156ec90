"""S2L-PO — "Smaller Models are Natural Explorers for Policy-Level Diversity in GRPO" (THU & CUHK, 2026).

A frozen smaller model π_ω of the same family (and tokenizer) supplies part of every GRPO group
during the first T_mix steps, because a different policy perturbs whole trajectories (policy-level
diversity) where temperature only perturbs tokens. At (1-based) step i ≤ T_mix

    α_i = α_0 · (1 − (i − 1) / (T_mix − 1)),   G_w = ⌈α_i · G⌉ from π_ω,   G_s = G − G_w from π_θ,

and after T_mix steps G_w = 0: plain GRPO. The merged group gets the standard GRPO advantage
(`advantages.grpo`): nothing here changes the advantage or the loss, which is what makes "merged
group = plain GRPO" a property to test rather than a function to write.

Choices where the summary is unclear (docs/design.md#paper-methods):
- α_0 (`share`, default 1 as in the paper's schedule, α(1) = 1) scales the whole ramp; the trainer's
  0-based `rl_step` is the paper's i − 1.
- G_w is the paper's ceil (not a round); ⌈·⌉ is taken with a 1e-9 tolerance so that 0.75 · 8, which
  is 6.000000000000001 in floating point, gives 6 and not 7.
- T_mix ≤ 1 would divide by zero: it means pure GRPO (no explorer sample at any step).
- The explorer's samples are off-policy for π_θ and the summary gives no correction for them
  (**[note-writer]**: "they need correction and are likely to be pushed down as negatives").
  `behaviour_logp` decides what μ the mismatch correction sees for them: "explorer_logp" (default)
  keeps the small model's own log-probs, so the configured `algorithm.mismatch` (TIS: w =
  clamp(π_old/μ_ω, 0, C)) weights them as the off-policy samples they are; "none" replaces μ by
  π_old on the explorer rows (w = 1: the paper's plain GRPO on the merged group, the PPO ratio
  against π_old recomputed by the trainer on the small model's tokens).

Registered as kind "explorer_schedule" (name "s2l_po"): `fn(step, group_size, *, mix_steps, share)
-> G_w`, the count the rollout manager asks the explorer engines for (`rollout.explorer`).
"""

from __future__ import annotations

import math

import torch

from mcore_rl.algos.multi_reward import need
from mcore_rl.algos.registry import register

CORRECTIONS = ("explorer_logp", "none")
_CEIL_TOL = 1e-9


def explorer_share(step: int, *, mix_steps: int, share: float = 1.0) -> float:
    """α at the 0-based training step `step`: α_0 · (1 − step / (T_mix − 1)) while step < T_mix, else
    0; T_mix ≤ 1 is pure GRPO (0 at every step)."""
    need(mix_steps >= 0, "mix_steps", f"must be >= 0, got {mix_steps}")
    need(0.0 <= share <= 1.0, "share", f"must be in [0, 1], got {share}")
    if mix_steps <= 1 or step >= mix_steps or step < 0:
        return 0.0
    return share * (1.0 - step / (mix_steps - 1))


@register("explorer_schedule", "s2l_po")
def s2l_po_explorer_count(step: int, group_size: int, *, mix_steps: int, share: float = 1.0) -> int:
    """G_w = ⌈α · G⌉ samples of a group of `group_size` from the explorer at 0-based `step`."""
    need(group_size >= 1, "group_size", f"must be >= 1, got {group_size}")
    alpha = explorer_share(step, mix_steps=mix_steps, share=share)
    return min(group_size, max(0, math.ceil(alpha * group_size - _CEIL_TOL)))


def behaviour_logp(
    rollout_logp: torch.Tensor, old_logp: torch.Tensor, explorer_rows: torch.Tensor, correction: str = "explorer_logp"
) -> torch.Tensor:
    """The μ [N, T] the mismatch correction sees: the engines' log-probs, except on the explorer's
    rows with `correction` "none", where it is π_old (IS weight 1: the samples count as π_old's)."""
    need(correction in CORRECTIONS, "correction", f"must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
    if correction == "explorer_logp" or not bool(explorer_rows.any()):
        return rollout_logp
    return torch.where(explorer_rows.bool()[:, None], old_logp.detach().to(rollout_logp.dtype), rollout_logp)
