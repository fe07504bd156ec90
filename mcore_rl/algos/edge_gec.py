"""EDGE-GRPO (Beihang, 2025): Guided Error Correction (GEC), the rollout half of the paper (EDA, its
advantage half, is a separate module).

All-wrong groups have zero GRPO advantage (advantage collapse). GEC gives them correct members: every
wrong response is, independently and at random,

* op 1 (P = 0.5): re-generated after a reflection prompt (the context continues with the response
  and "Wait!"); if the continuation is still wrong it stays a negative (reward 0);
* op 2 (P = 0.25): re-generated after the reflection prompt plus the ground-truth answer;
* op 3 (P = 0.25): replaced by a reference solution.

This module holds the decision (which op for which sample) as a pure, seeded function; the repair
itself (generation, the replaced tokens' μ) is `mcore_rl.recipes.gec`.

Chosen where the summary is unclear (docs/design.md#paper-methods; "which context the trainer
conditions on, whether injected text
is loss-masked"), documented again in `recipes/gec.py`:

* ops 1 and 2: the trainer conditions on the *repair context* (prompt + wrong response + reflection
  [+ answer hint]) and trains only on the new continuation, whose μ are the engine's log-probs of
  tokens it sampled: the injected text is context, so it is loss-masked by construction, and no
  token without a behaviour log-prob is trained on. The sample keeps its group (the original
  prompt's), so GRPO compares it with its siblings: the "different states" caveat of the summary.
* op 3: the trainer conditions on the original prompt and trains on the reference solution; its μ
  are the engine's log-probs of those tokens under the current policy (prompt scoring), so the
  mismatch correction sees them like sampled tokens (μ = π_old up to the engine's numerics).
* Ops are drawn per wrong response ("probabilities are per response, not per query"), seeded by
  (run seed, prompt stream index, sample index), so a rerun repairs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mcore_rl.algos.registry import register

KEEP, REFLECT, INJECT, REFERENCE = 0, 1, 2, 3
GEC_PROBS = (0.5, 0.25, 0.25)  # op 1, op 2, op 3


def gec_probabilities(probs: Sequence[float]) -> tuple[float, float, float]:
    """The three op probabilities, checked: non-negative and summing to 1."""
    p = tuple(float(x) for x in probs)
    if len(p) != 3 or min(p) < 0 or abs(sum(p) - 1.0) > 1e-9:
        raise ValueError(f"GEC probabilities: expected three non-negative numbers summing to 1, got {list(probs)}")
    return p


@register("group_repair", "edge_gec")
def gec_ops(
    wrong: Sequence[bool], keys: Sequence[tuple[int, int]], *, seed: int = 0, probs: Sequence[float] = GEC_PROBS
) -> list[int]:
    """The op of each sample: KEEP for a correct one, else REFLECT / INJECT / REFERENCE drawn with
    `probs`, independently per response: keys[i] = (prompt stream index, sample index j), and sample
    j of a prompt uses the j-th uniform of a generator seeded by (seed, prompt stream index)."""
    p = gec_probabilities(probs)
    draws: dict[int, np.ndarray] = {}
    ops = []
    for bad, (index, j) in zip(wrong, keys):
        if not bad:
            ops.append(KEEP)
            continue
        u = draws.get(int(index))
        if u is None or len(u) <= j:
            u = draws[int(index)] = np.random.default_rng([seed, 0x6EC, int(index)]).random(max(int(j) + 1, 16))
        ops.append(REFLECT if u[j] < p[0] else INJECT if u[j] < p[0] + p[1] else REFERENCE)
    return ops
