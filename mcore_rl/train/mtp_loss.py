"""Training the MTP draft heads (`models/mtp.py`) beside the policy: the forward step that adds
their loss (`algos/mtp_draft.py`) to the policy's in `mcore-rl sft` and the SFT warm start of RL
(`train.mtp_loss`), and, co-trained, to the RL learner's (`algorithm.mtp_heads_coeff` > 0) on the
rollout's tokens, where they draft.

The heads learn the policy's own next-token distributions, detached: depth d at position t is
compared with the policy's distribution at t + d, the one that verifies that draft. Their gradient
stops at the policy (the decoder's output, the embedding and the output layer enter the heads
detached), so the policy trains exactly as without heads and the heads follow it.

Rows count where every depth's target lies inside the same packed document, the policy's token
there is trained (`loss_mask`), and within the row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel

from mcore_rl.algos.mtp_draft import MTPLoss, expected_accepted_length, mtp_draft_loss
from mcore_rl.models.mtp import has_mtp_heads, mtp_depths, mtp_logits
from mcore_rl.models.shards import unwrap_model
from mcore_rl.train.forward_backward import _forward_step as policy_forward_step  # SFT's own step

Batch = dict[str, torch.Tensor]
StepFn = Callable[[Iterator[Batch], torch.nn.Module], tuple]


def heads_rows(loss_mask: torch.Tensor, segment_ids: torch.Tensor | None, depths: int) -> torch.Tensor:
    """[b, s] bool: anchor positions t whose every depth d = 1..depths has its verifying policy row
    t + d in t's document and trained (`loss_mask[t + d]`), inside the row."""
    b, s = loss_mask.shape
    ok = torch.zeros(b, s, dtype=torch.bool, device=loss_mask.device)
    if s <= depths:
        return ok
    ok[:, : s - depths] = True
    for d in range(1, depths + 1):
        ok[:, : s - depths] &= loss_mask[:, d : s - depths + d].bool()
        if segment_ids is not None:
            ok[:, : s - depths] &= segment_ids[:, d : s - depths + d] == segment_ids[:, : s - depths]
    return ok


def mtp_losses(
    module: Any, tokens: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor, kind: MTPLoss
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss [N], acceptance [γ, N]) over the `rows` [b, s] of the module's last forward."""
    policy, draft = mtp_logits(module, tokens, position_ids, detach_policy=True)  # each [s, b, V/tp]
    if parallel_state.get_tensor_model_parallel_world_size() > 1:  # full vocabulary rows for d_TV
        draft = [tensor_parallel.gather_from_tensor_model_parallel_region(x) for x in draft]
        policy = tensor_parallel.gather_from_tensor_model_parallel_region(policy)
    s = tokens.shape[1]
    depths = len(draft)
    anchor = rows.t()  # [s, b] like the logits
    policy_at = [policy[d : s - depths + d][anchor[: s - depths]] for d in range(1, depths + 1)]
    draft_at = [x[: s - depths][anchor[: s - depths]] for x in draft]
    return mtp_draft_loss(policy_at, draft_at, kind)


class MTPForwardStep:
    """A `forward_backward` step function: `base` (the policy's own step: SFT's, or the RL learner's),
    then the heads' loss added to its loss. Keeps the heads' summed loss, acceptance per depth and
    row count since `reset` (for metrics). `mask_key`: the batch's mask of trained policy tokens."""

    def __init__(self, kind: MTPLoss, coeff: float, base: StepFn | None = None, mask_key: str = "loss_mask") -> None:
        self.kind, self.coeff, self.mask_key = kind, coeff, mask_key
        self.base: StepFn = base if base is not None else policy_forward_step
        self.reset()

    def reset(self) -> None:
        self.loss_sum, self.rows = 0.0, 0
        self.alpha_sum: torch.Tensor | None = None  # [γ]
        self.length_sum = 0.0  # Σ over rows of the expected accepted length

    def metrics(self) -> dict[str, float]:
        """mtp_loss (per row), mtp_alpha_{d} (acceptance of depth d), mtp_accept_len (expected
        accepted tokens per verification, drafts only) over the rows since `reset`."""
        if not self.rows or self.alpha_sum is None:
            return {}
        out = {"mtp_loss": self.loss_sum / self.rows, "mtp_accept_len": self.length_sum / self.rows}
        out.update({f"mtp_alpha_{d + 1}": float(a) / self.rows for d, a in enumerate(self.alpha_sum)})
        return out

    def __call__(self, data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple:
        batch = next(data_iterator)
        output, base_loss = self.base(iter([batch]), model)
        module = unwrap_model(model)
        if not has_mtp_heads(module):  # not the last pipeline stage: the policy's loss only
            return output, base_loss
        rows = heads_rows(batch[self.mask_key], batch.get("segment_ids"), mtp_depths(module))

        def heads() -> tuple[torch.Tensor, torch.Tensor]:
            return mtp_losses(module, batch["tokens"], batch["position_ids"], rows, self.kind)

        return output, partial(self._loss, base_loss, heads)

    def _loss(
        self,
        base_loss: Callable[[torch.Tensor], tuple],
        heads: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        output: Any,
    ) -> tuple:
        """The policy's loss plus coeff x the heads' summed row loss (megatron-core divides it by the
        policy's token count, as the policy's own sum)."""
        loss, count, reported = base_loss(output)
        if self.coeff == 0:  # frozen heads, only measured: no graph through them
            with torch.no_grad():
                head_loss, alphas = heads()
        else:
            head_loss, alphas = heads()
        self.loss_sum += float(head_loss.detach().sum())
        self.rows += head_loss.numel()
        alpha_sum = alphas.sum(1).cpu()
        self.alpha_sum = alpha_sum if self.alpha_sum is None else self.alpha_sum + alpha_sum
        self.length_sum += float(expected_accepted_length(alphas).sum())
        return (loss if self.coeff == 0 else loss + self.coeff * head_loss.sum()), count, reported
