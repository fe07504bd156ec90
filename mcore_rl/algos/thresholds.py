"""Scores against thresholds, compared at the precision the scores are kept in.

A reward or judge score travels as a Python float on the rollout side and as float32 in the
learner (`SequenceView.rewards`, the reward-head matrix, every reward-shaping output), while a
config threshold is a Python float (float64). A judge's 0.7 stored as float32 is 0.69999999, so
`score >= 0.7` fails exactly at the threshold, and `.double()` before comparing does not help: the
digits are already gone. Every comparison of a score with a configured threshold therefore goes
through this module, which rounds *both* sides to SCORE_DTYPE (or to the scores' own dtype when
that is coarser) before comparing. Rounding is monotone, so a score that reaches the threshold
still reaches it after rounding, whatever path (float64, float32, float32 then `.double()`) it
took; the cost is that a score within float32's resolution (~6e-8 relative) below the threshold
counts as reaching it, well below what a reward means. The rollout side (Python floats) and the
learner (float32) thus decide alike for the same sample. NaN reaches nothing.
"""

from __future__ import annotations


import torch

# the coarsest precision a score is kept in on its way to the learner
SCORE_DTYPE = torch.float32

Scores = torch.Tensor | float


def _rounded(scores: Scores, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.as_tensor(scores)
    if not s.is_floating_point():
        s = s.double()
    dtype = s.dtype if torch.finfo(s.dtype).eps > torch.finfo(SCORE_DTYPE).eps else SCORE_DTYPE
    return s.to(dtype), torch.tensor(float(threshold), dtype=torch.float64).to(dtype).to(s.device)


def at_least(scores: Scores, threshold: float) -> torch.Tensor:
    """scores >= threshold (bool, the shape of `scores`), at the scores' precision (module docstring)."""
    s, t = _rounded(scores, threshold)
    return s >= t
