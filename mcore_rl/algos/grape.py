"""GRAPE — "The Best Instruction-Tuning Data are Those That Fit" (UIUC, NeurIPS 2025): among the
candidate responses to an instruction, keep the one the target model finds most likely.

Responses from other models that are far from the base model's distribution are hard to learn
from; GRAPE scores each candidate y^j by its length-normalised log-likelihood under the target
base model π_θ0 (one forward, no gradient),

    Score(y^j | x) = (1/N) Σ_t log π_θ0(y^j_t | x, y^j_<t),   y* = argmax_j Score  (= argmin perplexity),

and trains SFT on the kept pairs. Where it applies here: choosing the SFT warm start's answers or
the reference solutions of a recipe from several sources (`tools/grape_select.py` scores a jsonl of
candidates with the embedded engine's prompt scoring, a `/generate` server, or the reference model).
"Reverse-GRAPE" (the paper's baseline) keeps the lowest score.

Choices: ties go to the first candidate (lowest index), so a selection is reproducible; a candidate
without a score (NaN: nothing to score, the scorer failed) is never kept unless a group has nothing
else (then the group keeps nothing, -1). The paper warns that self-generated candidates hurt;
nothing here can tell where a candidate came from, so that is the caller's to respect. Token-level
GRAPE (token probabilities as loss weights) is not built: the summary we worked from does not give its weighting.
"""

from __future__ import annotations

import torch

from mcore_rl.algos.multi_reward import group_index


def grape_scores(token_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Score [C] float64: the mean log-prob over each candidate's response tokens ([C, T], `mask`
    1 on them); NaN for a candidate with no token."""
    m = mask.double()
    count = m.sum(1)
    total = (torch.nan_to_num(token_logp.double()) * m).sum(1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full((), float("nan"), dtype=torch.float64))


def perplexity(scores: torch.Tensor) -> torch.Tensor:
    """exp(-Score): the candidate's per-token perplexity under the model."""
    return torch.exp(-scores.double())


def select(scores: torch.Tensor, group_ids: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Per group (sorted group-id order) the index of its kept candidate [K]: the highest score
    (the lowest with `reverse`: Reverse-GRAPE), ties to the lowest index, NaN never, -1 if none."""
    inverse, k = group_index(group_ids)
    out = torch.full((k,), -1, dtype=torch.long)
    s = scores.double()
    for g in range(k):
        idx = torch.nonzero((inverse == g) & ~s.isnan()).flatten()
        if idx.numel():
            vals = s[idx]
            best = vals.min() if reverse else vals.max()
            out[g] = idx[torch.nonzero(vals == best).flatten()[0]]
    return out
