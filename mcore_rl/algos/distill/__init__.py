"""On-policy distillation as pure tensor functions, one module per paper, registered as kind "distill".

Every function has the one signature of `base.py`: it takes a `DistillBatch` (student, old-policy
and teacher log-probs on the sequence view, optionally the top-k of the teacher) and returns
`DistillTerms` — a per-token advantage term added to the RL advantage (computed once per batch,
no gradient), a differentiable loss term (computed per micro-batch), and/or a token mask. The
learner adds whatever a registered function returns; nothing there branches on a method's name.
"""

from mcore_rl.algos.distill import (  # noqa: F401  (imported for their registrations)
    antisd,
    direct_opd,
    effopd,
    popd,
    power_opd,
    reverse_kl,
    rlrt,
    sdar,
    seed,
    stepopsd,
    tropd,
    ui_mopd,
)
from mcore_rl.algos.distill.base import DistillBatch, DistillTerms

__all__ = ["DistillBatch", "DistillTerms"]
