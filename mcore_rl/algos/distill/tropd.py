"""TrOPD, "Trust Region On-Policy Distillation" (Samsung Research, Oxford & PKU, 2026): on-policy
distillation whose per-token objective (to maximise) is

    J_x = −I[x∼π_S] · M_x · log(π_S/π_T)                          trust-region reverse KL (K1)
          −I[x∼π_S] · (1 − M_x) · Σ_{v∈top-k(π_T)} π_T,v log(π_T,v/π_S,v)   outlier forward KL
          −β · I[x∼π_T] · log(π_T/π_S)                             teacher-prefix imitation

M_x ~ Bernoulli(min(π_T(x)/π_S(x), 1)) is speculative decoding's acceptance rule: a token the
teacher finds at least as likely as the student does is always trusted; one the teacher finds
impossible (π_T → 0, where K1's −log π_T explodes) always goes to the forward KL over the
teacher's top-k, which needs only the teacher's top-k log-probs and the student's at those ids.

Three registered functions, used together or alone:

* `tropd_trust` (phase "advantage"): draws M with a seeded generator once per batch and returns
  the K1 reward M · (log π_T − log π_S) as a token advantage: the policy-gradient form of the
  trust-region term (clipped and aggregated by the policy loss, as reverse-KL OPD is);
* `tropd_fkl` (phase "loss"): the top-k forward KL, weighted per token by the *probability* of
  being an outlier, 1 − P_trust, computed from the same detached log-probs. The loss phase runs
  per micro-batch and cannot see the advantage phase's draw; the expected weight keeps the
  expected objective exactly the paper's (P·RKL + (1 − P)·FKL) with less variance, but a token
  can contribute to both terms in one step;
* `tropd_imitation` (phase "loss"): β · (log π_T − log π_S) on teacher-generated prefix tokens
  (`batch.teacher_generated`), an SFT-like push; 0 when there is no prefix.

**Not used in training.** The imitation term needs mixed rollouts — the teacher generates the first
part of a response, the student continues — and no rollout of this trainer builds them: engine
teachers only *score* (prompt scoring), so no sample carries teacher-generated tokens and the
learner never fills `teacher_generated`. Config validation therefore refuses `tropd_imitation` in
`distill.losses` (`@needs("teacher_generated")`, an unfilled field) instead of training a term that
is always 0; the function and `prefix_length` (the annealing schedule of the prefix, max length →
0, linear: the paper gives no shape) are kept, tested, for when mixed rollouts exist. TrOPD in
training is `tropd_trust` + `tropd_fkl`, both on student tokens only. Tokens with
`teacher_generated` = 1 would be left out of the on-policy terms (I[x∼π_S]).
"""

from __future__ import annotations

import torch

from mcore_rl.algos.distill._common import detached, loss_sum, masked_mean, require, valid_tokens, zero_where_not
from mcore_rl.algos.distill.base import TOPK_FIELDS, DistillBatch, DistillTerms, needs, phase
from mcore_rl.algos.registry import register


def trust_probability(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """min(π_T/π_S, 1) = exp(min(log π_T − log π_S, 0)); 0 where log π_T = −inf."""
    return torch.exp((teacher_logp - student_logp).clamp_max(0.0))


def trust_mask(p_trust: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """Bernoulli(p_trust) draws (bool), reproducible from (seed, step) on any device: uniforms
    come from a CPU generator, so every rank (which holds the whole batch) draws the same mask."""
    gen = torch.Generator(device="cpu").manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63))
    u = torch.rand(p_trust.shape, generator=gen, dtype=torch.float64).to(p_trust.device)
    return u < p_trust.double()


def _on_policy(batch: DistillBatch) -> torch.Tensor:
    """Bool [n, T]: student-sampled tokens (I[x∼π_S])."""
    if batch.teacher_generated is None:
        return torch.ones_like(batch.mask, dtype=torch.bool)
    return batch.teacher_generated <= 0


def topk_forward_kl(
    teacher_topk_logp: torch.Tensor,
    student_topk_logp: torch.Tensor,
    tail: bool = False,
) -> torch.Tensor:
    """Σ_{v∈top-k} π_T,v (log π_T,v − log π_S,v) per position [n, T].

    As in the paper, the teacher's top-k probabilities are not renormalised; its gradient in the
    student's logits is that of the cross-entropy −Σ π_T,v log π_S,v. This sum is 0 when the
    student matches the teacher on the top-k ids but is not a divergence: a student with *more*
    mass on the top-k than the teacher makes it negative. `tail=True` adds the bucket of all other
    ids, (1 − m_T) log((1 − m_T)/(1 − m_S)) with m the top-k masses, which makes it the KL of the
    (k + 1)-bucket distributions: ≥ 0, and 0 only when the two agree on every top-k id."""
    p_t = torch.exp(teacher_topk_logp)
    has = p_t > 0
    t_lp = zero_where_not(has, teacher_topk_logp)
    s_lp = zero_where_not(has, student_topk_logp)
    kl = zero_where_not(has, p_t * (t_lp - s_lp)).sum(-1)
    if tail:
        tiny = torch.finfo(p_t.dtype).tiny
        rest_t = (1.0 - p_t.sum(-1)).clamp_min(0.0)
        rest_s = (1.0 - torch.exp(student_topk_logp).sum(-1)).clamp_min(tiny)
        kl = kl + zero_where_not(rest_t > 0, rest_t * (torch.log(rest_t.clamp_min(tiny)) - torch.log(rest_s)))
    return kl


def prefix_length(step: int, *, max_length: int, anneal_steps: int) -> int:
    """Teacher-prefix length at `step`: max_length at step 0, linearly down to 0 at anneal_steps."""
    if anneal_steps <= 0:
        return 0
    return int(round(max_length * max(0.0, 1.0 - step / anneal_steps)))


@register("distill", "tropd_trust")
@phase("advantage")
def tropd_trust(batch: DistillBatch, *, seed: int = 0) -> DistillTerms:
    """token_advantage = M · (log π_T − log π_S) on student tokens, M ~ Bernoulli(P_trust) drawn
    from (seed, batch.step). An untrusted token gets 0 without −log π_T being evaluated."""
    with torch.no_grad():
        student = detached(batch.student_logp)
        teacher = detached(batch.teacher_logp)
        # log π_T = -inf is allowed (π_T = 0: never trusted); NaN or +inf is not a log-prob
        ok = valid_tokens(batch, student) & _on_policy(batch) & (teacher < float("inf"))
        p = zero_where_not(ok, trust_probability(zero_where_not(ok, student), torch.where(ok, teacher, student)))
        m = trust_mask(p, seed, batch.step) & ok
        reward = zero_where_not(m, torch.where(m, teacher, student) - student)
        metrics = {
            "tropd/trust_prob": masked_mean(p, ok),
            "tropd/trusted_frac": masked_mean(m.float(), ok),
            "tropd/rkl_reward_mean": masked_mean(reward, m),
        }
    return DistillTerms(token_advantage=reward, metrics=metrics)


@register("distill", "tropd_fkl")
@phase("loss")
@needs(*TOPK_FIELDS)
def tropd_fkl(batch: DistillBatch, *, weight: str = "outlier", tail: bool = False) -> DistillTerms:
    """loss_sum = Σ_agg w_x · FKL_top-k(x) over student tokens, w_x = 1 − P_trust(x) (from the
    detached old-policy and teacher log-probs of the sampled token) with weight="outlier", or 1
    on every token with weight="all". Needs `teacher_topk_logp` and `student_topk_logp`."""
    if weight not in ("outlier", "all"):
        raise ValueError(f"distill 'tropd_fkl': weight must be 'outlier' or 'all', got {weight!r}")
    t_topk = require(batch, "teacher_topk_logp", "tropd_fkl").detach()
    s_topk = require(batch, "student_topk_logp", "tropd_fkl")
    # a position counts when the student's top-k log-probs are finite (the teacher's may be -inf)
    ok = valid_tokens(batch) & _on_policy(batch) & torch.isfinite(s_topk).all(-1) & (t_topk < float("inf")).all(-1)
    okk = ok[..., None]
    s_safe = zero_where_not(okk, s_topk)
    t_safe = torch.where(okk, t_topk.to(s_safe.dtype), torch.zeros((), dtype=s_safe.dtype, device=s_safe.device))
    fkl = zero_where_not(ok, topk_forward_kl(t_safe, s_safe, tail))
    with torch.no_grad():
        if weight == "outlier":
            old = batch.old_logp.detach().to(s_safe.dtype)
            teacher = batch.teacher_logp.detach().to(s_safe.dtype)
            fine = ok & torch.isfinite(old) & (teacher < float("inf"))
            p = trust_probability(zero_where_not(fine, old), torch.where(fine, teacher, old))
            w = zero_where_not(ok, torch.where(fine, 1.0 - p, torch.ones_like(p)))
        else:
            w = ok.to(s_safe.dtype)
    total = loss_sum(fkl, w, batch)
    metrics = {
        "tropd/fkl_mean": masked_mean(fkl, ok),
        "tropd/outlier_weight": masked_mean(w, ok),
    }
    return DistillTerms(loss_sum=total, metrics=metrics)


@register("distill", "tropd_imitation")
@phase("loss")
@needs("teacher_generated")  # no rollout fills it yet: validation refuses the term (module docstring)
def tropd_imitation(batch: DistillBatch, *, beta: float = 0.001) -> DistillTerms:
    """loss_sum = β · Σ_agg (log π_T − log π_S) over teacher-generated tokens: its gradient is
    −β ∇ log π_S there (the objective's +β ∇ log π_S, SFT on the teacher's prefix), 0 elsewhere.
    Without `teacher_generated` (prefix length 0, the end of annealing) it is 0. Not used in
    training yet: nothing generates teacher prefixes (module docstring)."""
    zero = torch.zeros((), dtype=batch.student_logp.dtype, device=batch.student_logp.device)
    if batch.teacher_generated is None:
        return DistillTerms(loss_sum=zero, metrics={"tropd/teacher_token_frac": zero.detach()})
    ok = valid_tokens(batch, batch.student_logp, batch.teacher_logp) & (batch.teacher_generated > 0)
    student = zero_where_not(ok, batch.student_logp)
    teacher = zero_where_not(ok, batch.teacher_logp.detach().to(student.dtype))
    total = beta * loss_sum(teacher - student, ok, batch)
    metrics = {
        "tropd/teacher_token_frac": masked_mean(ok.float(), batch.mask > 0),
        "tropd/imitation_k1": masked_mean(teacher - student, ok),
    }
    return DistillTerms(loss_sum=total, metrics=metrics)
