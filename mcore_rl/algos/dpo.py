"""DPO (Rafailov et al. 2023), the preference loss AutoIF trains with (offline and online DPO on
pairs judged by its verification functions, `rewards/instruction_following.py: preference_pairs`).

    L = -log σ(β [(log πθ(y_w) - log π_ref(y_w)) - (log πθ(y_l) - log π_ref(y_l))])

with π_ref the frozen SFT model. Kind "preference": `fn(policy_chosen, policy_rejected,
ref_chosen, ref_rejected, **options) -> loss` on summed sequence log-probs, one value per pair [P].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_rl.algos.registry import register


@register("preference", "dpo")
def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> torch.Tensor:
    """Per-pair DPO loss; log 2 wherever the policy equals the reference."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    return -F.logsigmoid(beta * margin)
