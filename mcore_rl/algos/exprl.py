"""ExpRL — "ExpRL: Exploratory RL for LLM Mid-Training" (Stanford & CMU, 2026): ExpRL-Process's
per-segment delta advantages, as advantage shaping "exprl_segments".

A sparse 0/1 reward gives nothing on problems the policy never solves. ExpRL asks a judge to
*verify* each rollout against a step-level reference solution (1–5 → s = (s̃ − 1)/4; the judge and
its template are `rewards/judge.py`: "exprl_judge" for ExpRL-Outcome, which is then plain GRPO on
that reward, and "exprl_process"). ExpRL-Process splits the response at a delimiter ("###"),
scores every prefix y_<=t, and gives every token of segment t the advantage (DeltaNorm)

    A_1 = s_1 − s_T,    A_t = s_t − s_{t−1}  (t > 1),

with REINFORCE: no group normalisation, so the advantages *are* the raw deltas and they sum to 0
over a trajectory (a one-segment response gets 0). "end" (EndNorm, the appendix's alternative):
A_t = s_t − s_T.

How the segment scores reach the learner (chosen, since a reward head is one float per sample):
the "exprl_process" reward leaves its prefix scores and segment ends (character offsets) in
`Sample.info`; after the rollout, `recipes/judge_heads.py` turns them into reward heads
`<prefix>_s<k>` (the score of the k-th prefix, k = 0..T−1) and `<prefix>_e<k>` (the k-th segment's
end as a *token* index of the response, exclusive; the last one is the response length) using the
run's tokenizer. This function reads those heads, so it runs on any batch: a sample without them
(another domain, a judge error) keeps the advantage it came with; an invalid sample gets 0. The
incoming advantage of a sample *with* segments is replaced, not added to (REINFORCE path alongside
GRPO's: `algorithm.advantage` still sets what the other samples get). The KL to π_0 is the
trainer's usual `algorithm.kl_coef` with a reference model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from mcore_rl.algos.multi_reward import head_column, need
from mcore_rl.algos.registry import register

NORMS = ("delta", "end")


def segment_deltas(scores: torch.Tensor, norm: str = "delta") -> torch.Tensor:
    """Per-segment advantages [N, K] from prefix scores [N, K] (NaN after a sample's last segment;
    a row that is all NaN has no segments): DeltaNorm or EndNorm, NaN where there is no segment."""
    n, k = scores.shape
    s = scores.double()
    present = ~s.isnan()
    count = present.sum(1)
    last = s.gather(1, (count - 1).clamp_min(0)[:, None])  # s_T of each sample
    if norm == "end":
        out = s - last
    else:
        prev = torch.cat([last, s[:, :-1]], 1)  # s_T before segment 1, s_{t-1} after
        out = s - prev
    return torch.where(present, out, torch.full((), float("nan"), dtype=torch.float64))


def spread_segments(values: torch.Tensor, ends: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T]: every response token gets the value of its segment. `values`/`ends` [N, K] (NaN
    padded), `ends` the exclusive token end of each segment; token j is in segment k when
    e_{k-1} <= j < e_k, and tokens past the last end belong to the last segment. 0 off the mask
    and on rows without segments."""
    n, t = mask.shape
    present = ~values.isnan()
    count = present.sum(1)
    e = torch.where(present, ends.double(), torch.full((), float("inf"), dtype=torch.float64))
    pos = torch.arange(t, dtype=torch.float64)
    seg = (e[:, None, :] <= pos[None, :, None]).sum(2)  # [N, T]: ends at or before j
    seg = torch.minimum(seg, (count - 1).clamp_min(0)[:, None])
    out = torch.nan_to_num(values.double(), nan=0.0).gather(1, seg)
    return torch.where(count[:, None] > 0, out, torch.zeros(())) * mask


def segment_columns(
    reward_heads: torch.Tensor | None, head_names: Sequence[str], prefix: str, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [N, K], token ends [N, K]) from the heads `<prefix>_s<k>` / `<prefix>_e<k>`; K = 0
    when the batch has none. A score without its end (or the reverse) counts as no segment."""
    pat = re.compile(rf"{re.escape(prefix)}_s(\d+)")
    ks = [int(m.group(1)) for h in head_names if (m := pat.fullmatch(h))]
    k = max(ks) + 1 if ks else 0
    scores = (
        torch.stack([head_column(reward_heads, head_names, f"{prefix}_s{i}", n) for i in range(k)], 1)
        if k
        else torch.zeros(n, 0, dtype=torch.float64)
    )
    ends = (
        torch.stack([head_column(reward_heads, head_names, f"{prefix}_e{i}", n) for i in range(k)], 1)
        if k
        else torch.zeros(n, 0, dtype=torch.float64)
    )
    missing = scores.isnan() | ends.isnan()
    nan = torch.full((), float("nan"), dtype=torch.float64)
    return torch.where(missing, nan, scores), torch.where(missing, nan, ends)


def segment_heads(scores: Sequence[float], token_ends: Sequence[int], prefix: str = "exprl") -> dict[str, float]:
    """The reward heads that carry one sample's prefix scores and segment token ends."""
    if len(scores) != len(token_ends) or not scores:
        raise ValueError(f"{len(scores)} segment scores for {len(token_ends)} segment ends")
    out = {f"{prefix}_s{k}": float(s) for k, s in enumerate(scores)}
    out.update({f"{prefix}_e{k}": float(e) for k, e in enumerate(token_ends)})
    return out


@register("advantage_shaping", "exprl_segments")
def exprl_segments(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    rewards: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    domain_ids: torch.Tensor | None = None,
    reward_heads: torch.Tensor | None = None,
    head_names: Sequence[str] = (),
    entropy: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    prefix: str = "exprl",
    norm: str = "delta",
) -> torch.Tensor:
    """Per-token advantages [N, T]: the raw segment deltas on samples with segment heads, the
    incoming advantages elsewhere, 0 on invalid samples. (The other inputs: the kind's signature.)"""
    need(norm in NORMS, "norm", f"must be one of {', '.join(NORMS)}, got {norm!r}")
    need(isinstance(prefix, str) and bool(prefix), "prefix", f"must be a non-empty head-name prefix, got {prefix!r}")
    n = advantages.shape[0]
    scores, ends = segment_columns(reward_heads, head_names, prefix, n)
    out = advantages.double()
    if scores.shape[1]:
        has = ~scores[:, 0].isnan()
        out = torch.where(has[:, None], spread_segments(segment_deltas(scores, norm), ends, mask), out)
    if valid is not None:
        out = torch.where(valid.bool()[:, None], out, torch.zeros(()))
    return (out * mask).to(advantages.dtype)
