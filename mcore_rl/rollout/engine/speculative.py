"""Exact speculative sampling: accept a drafted token by rejection sampling against the target.

A drafter proposes tokens x_1..x_k after a request's sequence, each drawn from its own distribution
q_t (a point mass for prompt lookup, the draft model's processed distribution for a draft model).
The target scores the k + 1 positions in one forward; position t is then settled by
`verify_position` against the target's *processed* distribution p_t — the very weights the
engine's sampler would draw from there (penalties, `logit_bias`, the `min_new_tokens` mask,
temperature, top-k, top-p, min-p: `sampling.processed_weights`):

* accept x_t with probability min(1, p_t(x_t) / q_t(x_t));
* on rejection, draw from the residual max(0, p_t - q_t), renormalised, and stop;
* when every draft was accepted, draw the bonus token from p_{k+1} as plain decoding would.

Each emitted token is then distributed exactly as plain sampling's (Leviathan et al., "Fast
Inference from Transformers via Speculative Decoding", arXiv:2211.17192; Chen et al., "Accelerating
Large Language Model Decoding with Speculative Sampling", arXiv:2302.01318), whatever q is. A
greedy row's p is the point mass on the argmax of its processed logits, so it accepts a draft iff
the draft is that argmax and otherwise emits the argmax: token for token plain greedy decoding.

Everything the engine returns per token comes from the target's row at that position (raw
log-probs, the support of p_t for sampling-mask replay, the experts of the target's forward), so μ,
the masks and the routing are the target's, as without speculation. Only the random stream differs:
two uniforms per position (the acceptance test and the draw) instead of one, so a seeded request
reproduces itself, but not plain decoding's tokens for the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import BatchSampling, inverse_cdf, processed_weights
from .spec_schedule import SPECULATIVE_SCHEDULES

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN", "DFLASH")  # SGLang's names served here, and DFLASH (ours)
NO_DRAFT = -1  # the `drafts` entry of a row with nothing to verify here: its bonus token is drawn


@dataclass
class SpeculativeSettings:
    """The engine's speculative decoding (`mcore-rl serve --speculative-*`, SGLang's flag names):
    `algorithm` NGRAM (prompt lookup), STANDALONE (a separate draft model at `draft_model_path`) or
    NEXTN (the model's own MTP heads, `drafts.MTPDrafter`) or, in process only, DFLASH (DSpark's block
    drafter, `dflash.BlockHead` given as the draft model, `drafts.BlockDrafter`),
    `num_steps` tokens drafted per verification (SGLang's `--speculative-num-steps`), and the n-gram
    lengths prompt lookup tries (`--speculative-ngram-min/max-match-window-size`); `schedule` how many
    of the drafts a pass verifies: all (`fixed`) or DSpark's confidence schedule (`dspark`,
    `spec_schedule.py`), whose confidence is a trained head's when `confidence_head` names one."""

    algorithm: str = "NGRAM"
    num_steps: int = 4
    draft_model_path: str | None = None
    ngram_min: int = 1
    ngram_max: int = 3
    schedule: str = "fixed"
    confidence_head: str | None = None  # DSpark's trained head (JSON, `spec_confidence.py`); dspark only

    def check(self) -> None:
        """ValueError naming the setting that cannot be served."""
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm: {self.algorithm!r} is not served by the embedded engine "
                f"(choose from {list(SPECULATIVE_ALGORITHMS)})"
            )
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"speculative_num_steps: must be an integer >= 1, got {self.num_steps!r}")
        if self.schedule not in SPECULATIVE_SCHEDULES:
            raise ValueError(f"speculative_schedule: {self.schedule!r} is not one of {list(SPECULATIVE_SCHEDULES)}")
        if self.confidence_head and self.schedule != "dspark":
            raise ValueError(
                f"speculative_confidence_head: is set but speculative_schedule is {self.schedule!r} (only dspark reads it)"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"speculative_ngram_min/max_match_window_size: need 1 <= min ({self.ngram_min}) <= max "
                f"({self.ngram_max})"
            )


@dataclass
class Verdict:
    """How one position of each row was settled."""

    tokens: torch.Tensor  # [R] long: the token emitted here (the draft if accepted)
    accepted: torch.Tensor  # [R] bool: the row's draft was accepted (False for bonus rows)
    weights: torch.Tensor | None  # [R, V] the target's processed weights p (unnormalised); None if all greedy
    chance: (
        torch.Tensor
    )  # [R] the draft's acceptance probability sum_v min(p, q) (p(x) for a point mass; 0 for bonus rows)


def verify_position(
    logits: torch.Tensor,
    ctl: BatchSampling,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    u_accept: torch.Tensor,
    u_draw: torch.Tensor,
) -> Verdict:
    """Settle one position per row: `logits` [R, V] are the target's processed logits there
    (penalties and masks applied), `drafts` [R] the drafted ids (`NO_DRAFT`: draw the bonus token),
    `draft_probs` [R, V] the distributions the drafts were drawn from (None: every draft is a point
    mass), `u_accept` / `u_draw` [R] uniforms in [0, 1) (ignored by greedy rows). Row-local."""
    greedy_tokens = logits.argmax(-1)
    has_draft = drafts != NO_DRAFT
    safe = torch.where(has_draft, drafts, greedy_tokens)
    greedy_accept = has_draft & (safe == greedy_tokens)
    if ctl.all_greedy:
        return Verdict(greedy_tokens, greedy_accept, None, greedy_accept.double())
    w = processed_weights(logits, ctl)
    p = w.double() / w.double().sum(-1, keepdim=True)
    px = p.gather(-1, safe[:, None]).squeeze(-1)
    if draft_probs is None:
        qx = torch.ones_like(px)
        chance = px
        residual = p.scatter(-1, safe[:, None], 0.0)  # max(0, p - onehot(x))
    else:
        q = draft_probs.double()
        q = q / q.sum(-1, keepdim=True)
        qx = q.gather(-1, safe[:, None]).squeeze(-1)
        chance = torch.minimum(p, q).sum(-1)
        residual = (p - q).clamp_min(0.0)
    # p == q (to rounding) leaves no residual mass although a rejection was (barely) possible: draw from p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    accepted = has_draft & (u_accept.to(p.dtype) * qx < px)
    source = torch.where(has_draft[:, None], residual, p)
    drawn = inverse_cdf(source, u_draw)
    sampled = ctl.temperature > 0
    tokens = torch.where(sampled, torch.where(accepted, safe, drawn), greedy_tokens)
    chance = torch.where(has_draft, torch.where(sampled, chance, greedy_accept.to(chance.dtype)), 0.0)
    return Verdict(tokens, torch.where(sampled, accepted, greedy_accept), w, chance)
