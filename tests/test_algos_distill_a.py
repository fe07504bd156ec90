"""Distillation methods RLRT, AntiSD, SDAR, TrOPD, StepOPSD and EffOPD: every testable property of
their papers (docs/papers.md; "property n" is the n-th property a test module lists for its
method), plus the contract of the
"distill" kind: padding contributes nothing, an empty mask gives zeros, loss-phase gradients reach
the student's masked tokens only and never the teacher.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import mcore_rl.algos  # noqa: F401  (registrations)
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.distill import antisd as antisd_mod
from mcore_rl.algos.distill import effopd, tropd
from mcore_rl.algos.distill.antisd import AntiSDGate, antisd_phi, gate_update, jsd_generator_derivative
from mcore_rl.algos.distill.base import DistillBatch
from mcore_rl.algos.distill.rlrt import rlrt_weight, rlsd_weight
from mcore_rl.algos.distill.sdar import sdar_gate
from mcore_rl.algos.distill.stepopsd import mix_schedule, stepopsd_weight
from mcore_rl.algos.policy_loss import ppo_clip
from mcore_rl.algos.registry import get, names

LN2 = math.log(2.0)
MINE = ("antisd", "rlrt", "sdar", "stepopsd", "tropd_fkl", "tropd_imitation", "tropd_trust")


def call(name: str, batch: DistillBatch, **options):
    fn = get("distill", name)
    if hasattr(fn, "make_state") and "state" not in options:
        options["state"] = fn.make_state()
    return fn(batch, **options)


def token_batch(
    student: list[float], teacher: list[float], *, adv: float = 1.0, reward: float = 1.0, step: int = 0
) -> DistillBatch:
    """One sequence whose tokens have the given log-probs, RL advantage `adv` and reward."""
    s = torch.tensor([student], dtype=torch.float64)
    return DistillBatch(
        student_logp=s,
        old_logp=s.clone(),
        teacher_logp=torch.tensor([teacher], dtype=torch.float64),
        mask=torch.ones_like(s),
        rewards=torch.tensor([reward]),
        advantages=torch.tensor([adv], dtype=torch.float64),
        step=step,
    )


def random_batch(n: int = 4, t: int = 6, k: int = 3, vocab: int = 8, seed: int = 0, pad: int = 2):
    """Student and teacher logits over a small vocabulary; the last `pad` positions of odd rows are
    padding filled with garbage (NaN, -inf) that must never matter. Returns (batch, logits)."""
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(n, t, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(n, t, vocab, generator=g, dtype=torch.float64) * 1.5
    tokens = torch.randint(0, vocab, (n, t), generator=g)
    s_lp = torch.log_softmax(s_logits, -1)
    t_lp = torch.log_softmax(t_logits, -1)
    topk_ids = t_lp.topk(k, -1).indices
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[1::2, t - pad :] = 0
    pad_pos = mask == 0
    garbage = torch.full((n, t), float("nan"), dtype=torch.float64)
    student = torch.where(pad_pos, garbage, s_lp.gather(-1, tokens[..., None])[..., 0])
    teacher = torch.where(pad_pos, -torch.full_like(garbage, float("inf")), t_lp.gather(-1, tokens[..., None])[..., 0])
    batch = DistillBatch(
        student_logp=student,
        old_logp=student.detach().clone(),
        teacher_logp=teacher,
        mask=mask,
        teacher_topk_logp=torch.where(pad_pos[..., None], float("nan"), t_lp.gather(-1, topk_ids)),
        student_topk_logp=torch.where(pad_pos[..., None], float("nan"), s_lp.gather(-1, topk_ids)),
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0][:n]),
        group_ids=torch.tensor([0, 0, 1, 1][:n]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5][:n], dtype=torch.float64),
        teacher_entropy=-(t_lp.exp() * t_lp).sum(-1),
        student_entropy=-(s_lp.exp() * s_lp).sum(-1).detach(),
    )
    return batch, s_logits


# ------------------------------------------------------------------------------ the contract


def test_registered_names_and_phases() -> None:
    assert set(MINE) <= set(names("distill"))
    phases = {n: get("distill", n).phase for n in MINE}
    assert phases == {
        "antisd": "advantage",
        "rlrt": "advantage",
        "stepopsd": "advantage",
        "tropd_trust": "advantage",
        "sdar": "loss",
        "tropd_fkl": "loss",
        "tropd_imitation": "loss",
    }
    assert isinstance(get("distill", "antisd").make_state(), AntiSDGate)


@pytest.mark.parametrize("name", MINE)
def test_padding_contributes_nothing(name: str) -> None:
    """Garbage (NaN, -inf) on padding changes nothing: results are finite, advantages are 0 there,
    and a loss equals the one computed with the padded rows cut to their real length."""
    batch, _ = random_batch()
    teacher_generated = torch.zeros_like(batch.mask)
    teacher_generated[:, :2] = 1
    batch.teacher_generated = teacher_generated
    terms = call(name, batch)
    for v in terms.metrics.values():
        assert torch.isfinite(v).all()
    pad = batch.mask == 0
    if get("distill", name).phase == "advantage":
        assert torch.isfinite(terms.token_advantage).all()
        assert (terms.token_advantage[pad] == 0).all()
    else:
        assert torch.isfinite(terms.loss_sum)
        fields = {
            f: getattr(batch, f)
            for f in ("student_logp", "old_logp", "teacher_logp", "teacher_topk_logp", "student_topk_logp")
        }
        clean = replace(
            batch, **{f: torch.where(pad if v.ndim == 2 else pad[..., None], 0.0, v) for f, v in fields.items()}
        )
        assert torch.allclose(terms.loss_sum, call(name, clean).loss_sum)


@pytest.mark.parametrize("name", MINE)
def test_empty_mask_gives_zeros(name: str) -> None:
    batch, _ = random_batch()
    batch.mask = torch.zeros_like(batch.mask)
    batch.teacher_generated = torch.ones_like(batch.mask)
    terms = call(name, batch)
    for v in terms.metrics.values():
        assert torch.isfinite(v).all()
    if get("distill", name).phase == "advantage":
        assert torch.equal(terms.token_advantage, torch.zeros_like(batch.mask))
    else:
        assert terms.loss_sum.item() == 0.0


@pytest.mark.parametrize("name", ["sdar", "tropd_fkl", "tropd_imitation"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_loss_gradients_reach_masked_student_tokens_only(name: str, agg: str) -> None:
    batch, s_logits = random_batch()
    batch.agg = agg
    batch.teacher_logp.requires_grad_(True)
    batch.teacher_topk_logp.requires_grad_(True)
    if name == "tropd_imitation":
        batch.teacher_generated = torch.ones_like(batch.mask)
    loss = call(name, batch, **({"weight": "all"} if name == "tropd_fkl" else {})).loss_sum
    assert loss.requires_grad
    loss.backward()
    grad_norm = s_logits.grad.norm(dim=-1)
    assert torch.isfinite(s_logits.grad).all()
    assert (grad_norm[batch.mask == 0] == 0).all() and (grad_norm[batch.mask > 0] > 0).all()
    assert batch.teacher_logp.grad is None or (batch.teacher_logp.grad == 0).all()
    assert batch.teacher_topk_logp.grad is None or (batch.teacher_topk_logp.grad == 0).all()


@pytest.mark.parametrize("name", ["antisd", "rlrt", "stepopsd", "tropd_trust"])
def test_advantage_phase_is_detached(name: str) -> None:
    batch, s_logits = random_batch()
    terms = call(name, batch, **({"gate": False} if name == "antisd" else {}))
    assert not terms.token_advantage.requires_grad and terms.token_advantage.grad_fn is None


# ------------------------------------------------------------------------------ RLRT


def test_rlrt_wrong_rollouts_and_lambda_zero_keep_grpo() -> None:
    """Property 1: r = 0 keeps A exactly whatever P_T is; λ = 0 keeps A for every token."""
    batch, _ = random_batch(pad=0)
    batch.teacher_logp = batch.teacher_logp * 7.0 - 3.0  # far from the student
    delta = call("rlrt", batch).token_advantage
    wrong = batch.rewards < 1
    assert (delta[wrong] == 0).all() and (delta[~wrong] != 0).any()
    a = batch.advantages[:, None].expand_as(delta)
    assert torch.equal((a + delta)[wrong], a[wrong])
    assert torch.equal(call("rlrt", batch, lam=0.0).token_advantage, torch.zeros_like(delta))


@pytest.mark.parametrize("lam,eps_w", [(0.5, 0.2), (1.0, 1.0), (0.3, 0.5)])
def test_rlrt_equal_logps_keep_advantage(lam: float, eps_w: float) -> None:
    """Property 2: log P_S = log P_T gives w = 1 and A_t = A for any λ, ε_w."""
    batch, _ = random_batch(pad=0)
    batch.teacher_logp = batch.student_logp.detach().clone()
    assert torch.equal(call("rlrt", batch, lam=lam, eps_w=eps_w).token_advantage, torch.zeros_like(batch.mask))


def test_rlrt_worked_example() -> None:
    """Property 3: r = 1, A = 1, λ = 0.5, ε_w = 0.2: a log-ratio of ln 2 gives w = 2 → 1.2,
    A_t = 1.1; of −ln 2 gives w = 0.5 → 0.8, A_t = 0.9; the sign is kept."""
    batch = token_batch([-1.0, -1.0], [-1.0 - LN2, -1.0 + LN2])
    a_t = 1.0 + call("rlrt", batch, lam=0.5, eps_w=0.2).token_advantage[0]
    assert a_t.tolist() == pytest.approx([1.1, 0.9], abs=1e-12)
    assert (a_t > 0).all()
    w = rlrt_weight(batch.student_logp, batch.teacher_logp, torch.ones(1, 2, dtype=torch.float64))
    assert w[0].tolist() == pytest.approx([2.0, 0.5])


def test_rlrt_is_the_inverse_of_rlsd() -> None:
    """Property 4: without clipping, w^RLRT · w^RLSD = 1 elementwise (both advantage signs)."""
    g = torch.Generator().manual_seed(1)
    s, t = -torch.rand(50, generator=g, dtype=torch.float64) * 5, -torch.rand(50, generator=g, dtype=torch.float64) * 5
    adv = torch.randn(50, generator=g, dtype=torch.float64)
    assert torch.allclose(rlrt_weight(s, t, adv) * rlsd_weight(s, t, adv), torch.ones(50, dtype=torch.float64))


@pytest.mark.parametrize("adv", [1.3, -0.7])
def test_rlrt_eps_one_bounds(adv: float) -> None:
    """Property 5: ε_w = 1 clips w to [0, 2], so A_t lies between (1 − λ)A and (1 + λ)A."""
    g = torch.Generator().manual_seed(2)
    s = -torch.rand(200, generator=g, dtype=torch.float64) * 10
    t = -torch.rand(200, generator=g, dtype=torch.float64) * 10
    lam = 0.4
    a_t = adv + call("rlrt", token_batch(s.tolist(), t.tolist(), adv=adv), lam=lam, eps_w=1.0).token_advantage[0]
    lo, hi = sorted([(1 - lam) * adv, (1 + lam) * adv])
    assert (a_t >= lo - 1e-12).all() and (a_t <= hi + 1e-12).all()
    assert a_t.min() < adv < a_t.max()  # both directions occur


def test_rlrt_derives_grpo_advantage_and_needs_rewards() -> None:
    batch, _ = random_batch()
    given = call("rlrt", replace(batch, advantages=grpo(batch.rewards, batch.group_ids))).token_advantage
    assert torch.allclose(call("rlrt", replace(batch, advantages=None)).token_advantage, given)
    with pytest.raises(ValueError, match="rewards"):
        call("rlrt", replace(batch, rewards=None))


# ------------------------------------------------------------------------------ AntiSD


def test_antisd_equal_logps_and_closed_gate_give_grpo() -> None:
    """Property 1: φ(0) = 0, so u = 0 leaves A_seq; λ = 0 (gate closed, or λ_max = 0) is GRPO."""
    assert antisd_phi(torch.zeros(())).item() == 0.0
    batch, _ = random_batch(pad=0)
    same = replace(batch, teacher_logp=batch.student_logp.detach().clone())
    assert torch.equal(call("antisd", same, gate=False).token_advantage, torch.zeros_like(batch.mask))
    assert (call("antisd", batch, gate=False).token_advantage != 0).any()
    assert torch.equal(call("antisd", batch, gate=False, lam_max=0.0).token_advantage, torch.zeros_like(batch.mask))
    # during the warm-up the gate is closed: λ = 0
    assert torch.equal(call("antisd", batch).token_advantage, torch.zeros_like(batch.mask))


def test_antisd_phi_values_and_bounds() -> None:
    """Property 2: −φ(u) ≤ ½ log 2, −φ(u) > 0 iff u < 0, −φ strictly decreasing, and the check
    values at u = −1, 1, 10."""
    u = torch.linspace(-60, 60, 24001, dtype=torch.float64)
    neg = -antisd_phi(u)
    assert (neg <= 0.5 * LN2).all()
    assert torch.equal(neg > 0, u < 0)
    body = (u > -20) & (u < 60)  # below -20 the fp64 steps of −φ drop under one ulp of ½ log 2
    assert (neg[body][1:] < neg[body][:-1]).all() and (neg[1:] <= neg[:-1]).all()
    checks = -antisd_phi(torch.tensor([-1.0, 1.0, 10.0], dtype=torch.float64))
    assert checks.tolist() == pytest.approx([0.18994, -0.31006, -4.65345], abs=1e-5)
    # the same through the registered function (λ_max = 1): token advantage = −φ(u)
    batch = token_batch([-2.0, -2.0, -12.0], [-3.0, -1.0, -2.0])
    assert call("antisd", batch, gate=False).token_advantage[0].tolist() == pytest.approx(
        [0.18994, -0.31006, -4.65345], abs=1e-5
    )


def test_antisd_is_the_jsd_generator_derivative() -> None:
    """Property 3: −φ(u) = f′(e^{−u}) with f′(r) = ½ log(2r/(1+r))."""
    u = torch.linspace(-20, 20, 401, dtype=torch.float64)
    assert torch.allclose(-antisd_phi(u), jsd_generator_derivative(torch.exp(-u)), rtol=0, atol=1e-12)


def test_antisd_gate_hysteresis() -> None:
    """Property 4: 0 → 1 only at H ≥ H_warm, 1 → 0 only at H < 0.93 H_warm, and in between g
    keeps its previous value."""
    hw = 2.0
    assert gate_update(0, hw, hw) == 1 and gate_update(0, hw - 1e-9, hw) == 0
    assert gate_update(1, 0.93 * hw, hw) == 1 and gate_update(1, 0.93 * hw - 1e-9, hw) == 0
    for h in (0.93 * hw, 0.95 * hw, hw - 1e-9):
        assert gate_update(0, h, hw) == 0 and gate_update(1, h, hw) == 1
    # the stateful gate: 5 warm-up batches at λ = 0 fix H_warm (median of their medians), then it
    # starts open and follows the rule above
    gate = AntiSDGate()
    assert [gate.update(h) for h in (1.0, 3.0, 2.0, 2.5, 1.5)] == [0] * 5
    assert gate.warm_entropy == 2.0
    seq = [1.9, 1.85, 1.86, 1.9, 1.99, 2.0, 1.9, 1.0]
    assert [gate.update(h) for h in seq] == [1, 0, 0, 0, 0, 1, 1, 0]
    again = AntiSDGate()
    again.load_state_dict(gate.state_dict())
    assert again.state_dict() == gate.state_dict() and again.update(2.0) == gate.update(2.0) == 1


def test_antisd_gate_in_the_registered_function() -> None:
    """λ follows the gate driven by the batch's median teacher entropy, across calls sharing state."""
    batch, _ = random_batch(pad=0)
    fn = get("distill", "antisd")
    state = fn.make_state()
    median = float(batch.teacher_entropy.median())
    for _ in range(5):
        assert torch.equal(fn(batch, state=state, lam_max=0.5).token_advantage, torch.zeros_like(batch.mask))
    assert state.warm_entropy == pytest.approx(median)
    opened = fn(batch, state=state, lam_max=0.5)
    assert opened.metrics["antisd/lambda"].item() == 0.5
    assert torch.allclose(opened.token_advantage, 0.5 * fn(batch, gate=False).token_advantage)
    low = replace(batch, teacher_entropy=batch.teacher_entropy * 0.5)
    assert fn(low, state=state).metrics["antisd/gate"].item() == 0.0
    with pytest.raises(ValueError, match="state"):
        fn(batch)
    with pytest.raises(ValueError, match="teacher_entropy"):
        fn(replace(batch, teacher_entropy=None, teacher_topk_logp=None), state=fn.make_state())
    # an engine teacher without the full entropy: the top-k entropy stands in
    assert antisd_mod.median_teacher_entropy(replace(batch, teacher_entropy=None)) < median


def test_antisd_stop_gradient() -> None:
    """Property 5: the surrogate's gradient is A_{i,t} ∇ log π_S(y_t) with A_{i,t} a constant:
    nothing flows through the student log-prob inside u_t or through the teacher."""
    g = torch.Generator().manual_seed(3)
    s_logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, 5, (2, 3), generator=g)
    s_lp = torch.log_softmax(s_logits, -1).gather(-1, tok[..., None])[..., 0]
    t_lp = torch.log_softmax(t_logits, -1).gather(-1, tok[..., None])[..., 0]
    a_seq = torch.tensor([0.7, -1.2], dtype=torch.float64)
    batch = DistillBatch(student_logp=s_lp, old_logp=s_lp, teacher_logp=t_lp, mask=torch.ones(2, 3), advantages=a_seq)
    a = a_seq[:, None] + call("antisd", batch, gate=False, lam_max=0.8).token_advantage
    (a * s_lp).sum().backward()
    closed = a[..., None] * (torch.nn.functional.one_hot(tok, 5) - torch.softmax(s_logits, -1))
    assert torch.allclose(s_logits.grad, closed.detach())
    assert t_logits.grad is None


# ------------------------------------------------------------------------------ SDAR


def _tiny_logits(seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, 6, (2, 4), generator=g)
    teacher = torch.log_softmax(torch.randn(2, 4, 6, generator=g, dtype=torch.float64), -1)
    teacher = teacher.gather(-1, tok[..., None])[..., 0]
    return logits, tok, teacher


def test_sdar_gradient_is_gated_log_likelihood() -> None:
    """Property 1: with g_t and π_T detached, ∂ℓ_t/∂logits = −g_t (onehot − softmax)."""
    logits, tok, teacher = _tiny_logits()
    s_lp = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
    batch = DistillBatch(
        student_logp=s_lp, old_logp=s_lp.detach(), teacher_logp=teacher, mask=torch.ones(2, 4), agg="seq-mean-token-sum"
    )
    coef = 0.3  # λ_SDAR: the loss entry's coef, which the learner multiplies in
    (coef * call("sdar", batch).loss_sum).backward()
    gate = torch.sigmoid(5.0 * (teacher - s_lp.detach()))
    closed = -coef * gate[..., None] * (torch.nn.functional.one_hot(tok, 6) - torch.softmax(logits, -1))
    assert torch.allclose(logits.grad, closed.detach())


def test_sdar_gate_values_and_slope() -> None:
    """Property 2: Δ = 0 → 0.5; β = 5: Δ = −1 → 0.00669, Δ = +1 → 0.99331; g in (0, 1) and
    ∂g/∂Δ ≤ β/4 everywhere."""
    assert sdar_gate(torch.zeros(())).item() == 0.5
    gates = sdar_gate(torch.tensor([-1.0, 1.0], dtype=torch.float64))
    assert gates.tolist() == pytest.approx([0.00669, 0.99331], abs=1e-5)
    d = torch.linspace(-5, 5, 1001, dtype=torch.float64, requires_grad=True)
    gate = sdar_gate(d, beta=5.0)
    assert ((gate > 0) & (gate < 1)).all()
    (slope,) = torch.autograd.grad(gate.sum(), d)
    assert (slope <= 5.0 / 4 + 1e-12).all() and slope.max() == pytest.approx(1.25)


def test_sdar_zero_coefficient_is_plain_grpo() -> None:
    """Property 3: λ_SDAR = 0 reproduces the GRPO loss and its gradients exactly."""
    logits, tok, teacher = _tiny_logits()
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)

    def grads(with_sdar: bool):
        logits.grad = None
        s_lp = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0]
        mask = torch.ones(2, 4)
        out = ppo_clip(s_lp, s_lp.detach() - 0.05, adv, mask)
        total = out.loss_sum
        if with_sdar:
            batch = DistillBatch(student_logp=s_lp, old_logp=s_lp.detach(), teacher_logp=teacher, mask=mask)
            total = total + 0.0 * call("sdar", batch).loss_sum  # λ_SDAR = the entry's coef = 0
        total.backward()
        return total.detach(), logits.grad.clone()

    (l0, g0), (l1, g1) = grads(False), grads(True)
    assert torch.equal(l0, l1) and torch.equal(g0, g1)


def test_sdar_gate_is_monotone_and_stop_gradient() -> None:
    """Property 4: g_t is non-decreasing in Δ_t, and the gradient does not flow through it: the
    gradient per token is −g_t, not −(g_t + β Δ_t g_t (1 − g_t)) (λ_SDAR = 1)."""
    d = torch.linspace(-3, 3, 61, dtype=torch.float64)
    assert (sdar_gate(d)[1:] >= sdar_gate(d)[:-1]).all()
    s = torch.full((1, 61), -2.0, dtype=torch.float64, requires_grad=True)
    batch = DistillBatch(student_logp=s, old_logp=s.detach(), teacher_logp=(s.detach() + d), mask=torch.ones(1, 61))
    call("sdar", batch).loss_sum.backward()
    assert torch.allclose(s.grad[0], -sdar_gate(d))
    through = sdar_gate(d) + 5.0 * d * sdar_gate(d) * (1 - sdar_gate(d))
    assert not torch.allclose(s.grad[0], -through)


def test_sdar_entropy_gates_and_infinite_teacher() -> None:
    batch, _ = random_batch()
    h = batch.student_entropy
    for gate, expect in (("entropy", torch.sigmoid(5.0 * h)),):
        out = call("sdar", replace(batch, student_logp=batch.student_logp.detach()), gate=gate)
        assert out.metrics["sdar/gate_mean"].item() == pytest.approx(float(expect[batch.mask > 0].mean()))
    assert torch.isfinite(call("sdar", batch, gate="soft_or").loss_sum)
    with pytest.raises(ValueError, match="student_entropy"):
        call("sdar", replace(batch, student_entropy=None), gate="entropy")
    with pytest.raises(ValueError, match="unknown gate"):
        call("sdar", batch, gate="nope")
    # a teacher that gives the token probability 0: the gate's limit is 0, the token adds nothing
    s = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    inf_batch = DistillBatch(
        student_logp=s, old_logp=s.detach(), teacher_logp=torch.tensor([[-float("inf"), -2.0]]), mask=torch.ones(1, 2)
    )
    loss = call("sdar", inf_batch).loss_sum
    loss.backward()
    assert loss.item() == 0.0 and s.grad.tolist() == [[0.0, -0.5]]


# ------------------------------------------------------------------------------ TrOPD


def _trust_batch(student: list[float], teacher: list[float], step: int = 0) -> DistillBatch:
    b = token_batch(student, teacher, step=step)
    k = torch.tensor([[[-0.5, -1.5]] * len(student)], dtype=torch.float64)
    return replace(b, teacher_topk_logp=k, student_topk_logp=k - 0.3)


def test_tropd_trust_extremes() -> None:
    """Property 1: π_T ≥ π_S → P_trust = 1, always the RKL branch; π_T = 0 → P_trust = 0, always
    the FKL branch, and no infinite −log π_T is evaluated."""
    s = math.log(0.3)
    batch = _trust_batch([s, s, s], [math.log(0.3), math.log(0.9), -float("inf")])
    fkl_all = call("tropd_fkl", batch, weight="all").loss_sum
    for seed in range(50):
        out = call("tropd_trust", batch, seed=seed)
        adv = out.token_advantage[0]
        assert torch.isfinite(adv).all()
        assert adv.tolist() == pytest.approx([0.0, math.log(3.0), 0.0])
    assert call("tropd_trust", batch).metrics["tropd/trusted_frac"].item() == pytest.approx(2 / 3)
    # outlier weights 1 - P: 0, 0, 1 → the FKL loss is the third token's only
    fkl = call("tropd_fkl", batch).loss_sum
    assert fkl.item() == pytest.approx(fkl_all.item() / 3)
    p = tropd.trust_probability(batch.student_logp, batch.teacher_logp)
    assert p[0].tolist() == [1.0, 1.0, 0.0]


def test_tropd_expected_objective() -> None:
    """Property 2: over many draws the mean objective is P·(−log(π_S/π_T)) + (1 − P)·(−FKL);
    π_T = 0.1, π_S = 0.4 gives P = 0.25."""
    n_tokens = 64
    batch = _trust_batch([math.log(0.4)] * n_tokens, [math.log(0.1)] * n_tokens)
    p = tropd.trust_probability(batch.student_logp, batch.teacher_logp)
    assert torch.allclose(p, torch.full_like(p, 0.25))
    rkl = math.log(0.1 / 0.4)
    draws = torch.stack([call("tropd_trust", replace(batch, step=s), seed=7).token_advantage[0] for s in range(200)])
    trusted = (draws != 0).double()
    assert trusted.mean().item() == pytest.approx(0.25, abs=0.015)  # 12800 draws: σ ≈ 0.004
    assert torch.allclose(draws[draws != 0], torch.full_like(draws[draws != 0], rkl))
    # the FKL term carries the outlier probability 0.75 on each token
    fkl_tok = tropd.topk_forward_kl(batch.teacher_topk_logp, batch.student_topk_logp)[0, 0].item()
    fkl_loss = call("tropd_fkl", batch).loss_sum.item()
    assert fkl_loss == pytest.approx(0.75 * fkl_tok * n_tokens)
    objective = draws.mean().item() - fkl_loss / n_tokens
    assert objective == pytest.approx(0.25 * rkl - 0.75 * fkl_tok, abs=0.02)
    # seeded: the same (seed, step) draws the same mask, another step another one
    assert torch.equal(call("tropd_trust", batch, seed=7).token_advantage, draws[0][None])
    assert not torch.equal(draws[0], draws[1])


def test_tropd_topk_forward_kl() -> None:
    """Property 3: 0 when the student equals the teacher on the top-k ids, positive when it
    differs (here: by moving top-k mass elsewhere; with the tail bucket: for any difference), and
    its gradient in the student's logits is that of −Σ_{top-k} π_T log π_S."""
    g = torch.Generator().manual_seed(5)
    t_lp = torch.log_softmax(torch.randn(3, 4, 10, generator=g, dtype=torch.float64) * 2, -1)
    ids = t_lp.topk(4, -1).indices
    t_k = t_lp.gather(-1, ids)
    for tail in (False, True):
        kl = tropd.topk_forward_kl(t_k, t_k.clone(), tail)
        assert torch.allclose(kl, torch.zeros(3, 4, dtype=torch.float64), atol=1e-12)
    # less mass on every top-k id than the teacher: positive in both forms
    s_less = t_k + math.log(0.8)
    assert (tropd.topk_forward_kl(t_k, s_less) > 0).all() and (tropd.topk_forward_kl(t_k, s_less, True) > 0).all()
    # more mass on the top-k than the teacher (not a divergence without the tail bucket)
    s_more = torch.log_softmax(t_k, -1)
    assert (tropd.topk_forward_kl(t_k, s_more) < 0).all() and (tropd.topk_forward_kl(t_k, s_more, True) > 0).all()
    logits = torch.randn(3, 4, 10, generator=g, dtype=torch.float64, requires_grad=True)
    s_k = torch.log_softmax(logits, -1).gather(-1, ids)
    (g1,) = torch.autograd.grad(tropd.topk_forward_kl(t_k, s_k).sum(), logits, retain_graph=True)
    (g2,) = torch.autograd.grad(-(t_k.exp() * s_k).sum(), logits)
    assert torch.allclose(g1, g2)
    # a teacher top-k entry of probability 0 (log-prob -inf) adds nothing and no NaN
    t_inf = t_k.clone()
    t_inf[..., -1] = -float("inf")
    kl = tropd.topk_forward_kl(t_inf, s_k)
    assert torch.isfinite(kl).all()


def test_tropd_prefix_imitation_and_annealing() -> None:
    """Property 4: with prefix length 0 (no teacher tokens) the objective is T^On (the imitation
    term is 0 and the on-policy terms cover every token); on teacher tokens the imitation term's
    gradient is β ∇ log π_S (the loss's: −β) and the on-policy terms leave them out."""
    batch, _ = random_batch(pad=0)
    none = replace(batch, teacher_generated=None)
    zeros = replace(batch, teacher_generated=torch.zeros_like(batch.mask))
    assert call("tropd_imitation", none).loss_sum.item() == 0.0
    assert call("tropd_imitation", zeros).loss_sum.item() == 0.0
    assert torch.equal(call("tropd_trust", none).token_advantage, call("tropd_trust", zeros).token_advantage)
    assert torch.equal(call("tropd_fkl", none).loss_sum, call("tropd_fkl", zeros).loss_sum)

    tg = torch.zeros_like(batch.mask)
    tg[:, :3] = 1
    s = batch.student_logp.detach().clone().requires_grad_(True)
    mixed = replace(batch, student_logp=s, teacher_generated=tg)
    call("tropd_imitation", mixed, beta=0.001).loss_sum.backward()
    assert torch.allclose(s.grad, -0.001 * tg)
    assert (call("tropd_trust", mixed).token_advantage[tg > 0] == 0).all()
    assert tropd.prefix_length(0, max_length=100, anneal_steps=50) == 100
    assert tropd.prefix_length(25, max_length=100, anneal_steps=50) == 50
    assert tropd.prefix_length(50, max_length=100, anneal_steps=50) == 0
    assert tropd.prefix_length(80, max_length=100, anneal_steps=50) == 0


def test_tropd_fkl_on_teacher_tokens_is_zero() -> None:
    batch, _ = random_batch(pad=0)
    s_topk = batch.student_topk_logp.detach().clone().requires_grad_(True)
    tg = torch.zeros_like(batch.mask)
    tg[:, :3] = 1
    call("tropd_fkl", replace(batch, student_topk_logp=s_topk, teacher_generated=tg), weight="all").loss_sum.backward()
    assert (s_topk.grad[tg > 0] == 0).all() and (s_topk.grad[tg == 0].abs().sum(-1) > 0).all()
    with pytest.raises(ValueError, match="student_topk_logp"):
        call("tropd_fkl", replace(batch, student_topk_logp=None))


# ------------------------------------------------------------------------------ StepOPSD


def test_stepopsd_identity_cases() -> None:
    """Property 1: Δ = 0 or A = 0 gives w_raw = 1 and Ā = A; λ_mix = 0 gives Ā = A exactly."""
    batch, _ = random_batch(pad=0)
    same = replace(batch, teacher_logp=batch.student_logp.detach().clone())
    assert torch.equal(call("stepopsd", same).token_advantage, torch.zeros_like(batch.mask))
    zero_adv = replace(batch, advantages=torch.zeros(4, dtype=torch.float64))
    assert torch.equal(call("stepopsd", zero_adv).token_advantage, torch.zeros_like(batch.mask))
    w_raw, _ = stepopsd_weight(torch.tensor([0.0, 3.0, -float("inf")]), torch.tensor([1.0, 0.0, 0.0]))
    assert w_raw.tolist() == [1.0, 1.0, 1.0]
    assert (call("stepopsd", batch).token_advantage != 0).any()
    assert torch.equal(call("stepopsd", batch, lam_mix=0.0).token_advantage, torch.zeros_like(batch.mask))


def test_stepopsd_keeps_sign_and_bounds() -> None:
    """Property 2: sign(Ā) = sign(A) for any Δ, λ_mix ∈ [0, 1], α_clip < 1; w in [1 − α, 1 + α];
    w_raw in (0, 2)."""
    g = torch.Generator().manual_seed(6)
    gap = torch.randn(400, generator=g, dtype=torch.float64) * 8
    adv = torch.randn(400, generator=g, dtype=torch.float64)
    for lam in (0.0, 0.3, 1.0):
        for alpha in (0.05, 0.5, 0.99):
            w_raw, w = stepopsd_weight(gap, adv, alpha)
            assert ((w_raw > 0) & (w_raw < 2)).all()
            assert ((w >= 1 - alpha) & (w <= 1 + alpha)).all()
            b = token_batch([-3.0] * 400, (-3.0 + gap).tolist(), adv=0.0)
            b = replace(b, advantages=adv[None, :])
            a_bar = adv + call("stepopsd", b, lam_mix=lam, alpha_clip=alpha, decay_steps=None).token_advantage[0]
            assert torch.equal(torch.sign(a_bar), torch.sign(adv))


def test_stepopsd_worked_example() -> None:
    """Property 3: A = +1, Δ = 2, α = 0.2, λ = 0.2: w_raw ≈ 1.7616 → 1.2, Ā = 1.04; A = −1:
    w_raw ≈ 0.2384 → 0.8, Ā = −0.96."""
    w_raw, w = stepopsd_weight(
        torch.tensor([2.0, 2.0], dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    )
    assert w_raw.tolist() == pytest.approx([1.7616, 0.2384], abs=1e-4) and w.tolist() == pytest.approx([1.2, 0.8])
    for adv, expect in ((1.0, 1.04), (-1.0, -0.96)):
        b = token_batch([-2.0], [0.0], adv=adv)
        assert adv + call("stepopsd", b).token_advantage.item() == pytest.approx(expect, abs=1e-12)


def test_stepopsd_shuffled_control_has_the_methods_weights_in_another_order() -> None:
    """The control arm (`weights: shuffled`): the same multiset of weights over the shaped tokens, dealt
    to other tokens (so not the teacher's), every sign kept, the same draw for the same rollout step."""
    g = torch.Generator().manual_seed(3)
    n, t = 4, 50
    student = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    teacher = student + torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[2, 30:] = 0
    b = DistillBatch(student, student.clone(), teacher, mask, advantages=adv, step=4)
    opts = dict(lam_mix=0.5, alpha_clip=0.2, decay_steps=None, step_scale="none")
    method = call("stepopsd", b, **opts).token_advantage
    control = call("stepopsd", b, weights="shuffled", **opts).token_advantage
    ok = mask > 0
    a = adv[:, None].expand(n, t)
    w_method, w_control = (method / (0.5 * a) + 1)[ok], (control / (0.5 * a) + 1)[ok]
    torch.testing.assert_close(w_method.sort().values, w_control.sort().values)  # the same weights
    assert (w_method - w_control).abs().gt(1e-9).float().mean() > 0.5  # mostly on other tokens
    assert torch.equal(torch.sign(a + control), torch.sign(a)) and (control[~ok] == 0).all()
    assert torch.equal(control, call("stepopsd", b, weights="shuffled", **opts).token_advantage)
    other_step = call("stepopsd", replace(b, step=5), weights="shuffled", **opts).token_advantage
    assert not torch.equal(control, other_step)


def test_stepopsd_equal_step_mean_abs() -> None:
    """Per-step rescaling: every row (a step) with a modification ends with the same mean |Ā − A| over
    its tokens, the mean of the rows' unscaled ones, while no token leaves the unscaled bound
    |Ā − A| ≤ λ·α·|A| (so the sign of A is kept); `step_scale: none` is the plain formula."""
    g = torch.Generator().manual_seed(11)
    n, t = 6, 9
    student = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    gap = (
        torch.randn(n, t, generator=g, dtype=torch.float64) * torch.tensor([0.02, 0.1, 0.12, 0.15, 0.2, 0.25])[:, None]
    )
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[1, 5:] = 0
    b = DistillBatch(student, student.clone(), student + gap, mask, advantages=adv)
    opts = dict(lam_mix=0.5, alpha_clip=0.2, decay_steps=None)
    plain = call("stepopsd", b, step_scale="none", **opts).token_advantage
    scaled = call("stepopsd", b, **opts).token_advantage
    _, w = stepopsd_weight(gap, adv[:, None].expand(n, t), 0.2)
    torch.testing.assert_close(plain, torch.where(mask > 0, 0.5 * (w - 1) * adv[:, None], 0.0))
    row_mean = lambda d: (d.abs() * mask).sum(1) / mask.sum(1)
    bound = 0.5 * 0.2 * adv.abs()[:, None]
    assert (scaled.abs() <= bound + 1e-15).all() and (scaled[mask == 0] == 0).all()
    assert torch.equal(torch.sign(scaled), torch.sign(plain))
    unclamped = (row_mean(plain).mean() / row_mean(plain))[:, None] * plain
    inside = (unclamped.abs() <= bound).all(1)
    assert 3 <= inside.sum() < n  # the bound cut a row; the others all end at the same mean
    torch.testing.assert_close(row_mean(scaled)[inside], row_mean(plain).mean().expand(int(inside.sum())))
    # one row: the scale is 1 (the worked example above holds with the default)
    one = replace(
        b,
        student_logp=student[:1],
        old_logp=student[:1],
        teacher_logp=(student + gap)[:1],
        mask=mask[:1],
        advantages=adv[:1],
    )
    torch.testing.assert_close(call("stepopsd", one, **opts).token_advantage, plain[:1])
    # no modification anywhere: zeros, not NaN
    same = replace(b, teacher_logp=student.clone())
    assert torch.equal(call("stepopsd", same, **opts).token_advantage, torch.zeros_like(mask))


def test_stepopsd_mix_schedule() -> None:
    """Property 4: λ_mix is 0.2 at step 0, 0.1 at step 25, 0 from step 50 on (linear)."""
    assert [mix_schedule(s) for s in (0, 25, 50, 75)] == pytest.approx([0.2, 0.1, 0.0, 0.0])
    b = token_batch([-2.0], [0.0], adv=1.0)
    assert call("stepopsd", replace(b, step=25)).token_advantage.item() == pytest.approx(0.1 * 0.2)
    assert call("stepopsd", replace(b, step=50)).token_advantage.item() == 0.0


# ------------------------------------------------------------------------------ EffOPD


def test_effopd_trigger_steps() -> None:
    """Property 2 (schedule): extrapolation runs only at steps 1, 2, 4, 8, 16, …"""
    assert [s for s in range(0, 70) if effopd.is_extrapolation_step(s)] == [1, 2, 4, 8, 16, 32, 64]


def test_effopd_candidates() -> None:
    """Property 2: W̃_k − W = 2kΔ exactly (dyadic values make the float arithmetic exact)."""
    base = [torch.tensor([[1.0, -2.0], [0.5, 3.0]]), torch.tensor([0.25])]
    anchor = [torch.tensor([[0.75, -2.0], [0.625, 2.5]]), torch.tensor([0.5])]
    delta = effopd.displacement(base, anchor)
    assert torch.equal(delta[0], torch.tensor([[0.25, 0.0], [-0.125, 0.5]]))
    for k in range(0, 6):
        for c, b, d in zip(effopd.candidate(base, delta, k), base, delta):
            assert torch.equal(c - b, 2 * k * d)
    assert all(torch.equal(c, b) for c, b in zip(effopd.candidate(base, delta, 0), base))


def test_effopd_acceptance_rule() -> None:
    """Properties 1, 3, 4: a first drop keeps W (0 accepted); k is accepted only after 1..k−1;
    a monotone score accepts all 5 (W + 10Δ), a score peaking at k = 3 stops there (W + 6Δ);
    ties accept."""
    assert effopd.accepted_count(0.5, [0.4, 0.9, 0.9, 0.9, 0.9]) == 0
    assert effopd.accepted_count(0.5, [0.6, 0.7, 0.8, 0.9, 1.0]) == 5
    assert effopd.accepted_count(0.5, [0.6, 0.7, 0.8, 0.7, 0.9]) == 3
    assert effopd.accepted_count(0.5, [0.6, 0.5, 0.9, 1.0, 1.0]) == 1
    assert effopd.accepted_count(0.5, [0.5, 0.5, 0.5, 0.5, 0.5]) == 5
    assert effopd.accepts(0.5, 0.5) and not effopd.accepts(0.4999, 0.5)


class _Tiny(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 3).to(dtype)
        self.frozen = torch.nn.Parameter(torch.ones(2, dtype=dtype), requires_grad=False)


def _train_step(model: torch.nn.Module, scale: float = 0.01) -> None:
    """A stand-in update that moves every trainable element (by different amounts)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / p.numel() + scale)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


class _Scores:
    """A validation set whose score is a function of the extrapolation coefficient of the weights
    it sees (read off the bias); records the coefficients it was called with."""

    def __init__(self, model: torch.nn.Module, base: torch.Tensor, delta: torch.Tensor, score_of) -> None:
        self.model, self.base, self.delta, self.score_of, self.calls = model, base, delta, score_of, []

    def __call__(self) -> float:
        coef = ((self.model.fc.bias.detach() - self.base) / self.delta).mean().item()
        self.calls.append(round(coef, 3))
        return self.score_of(round(coef))


@pytest.mark.parametrize("offload", [False, True])
def test_effopd_trainer_rejection_restores_exactly(offload: bool) -> None:
    """Property 1 on a model: candidate 1 scores lower, so the weights are W_1 bit for bit."""
    from mcore_rl.recipes.effopd import WeightExtrapolator

    model = _Tiny()
    ex = WeightExtrapolator([model], offload=offload)
    w0 = _weights(model)
    _train_step(model)
    w1 = _weights(model)
    scores = _Scores(model, w1["fc.bias"], w1["fc.bias"] - w0["fc.bias"], lambda c: {0: 0.5}.get(c, 0.1))
    assert ex.due(1) and not ex.due(3)
    res = ex.run(1, scores)
    assert res.accepted == 0 and res.coefficient == 0.0 and res.engine_stale and res.scores == [0.1]
    assert scores.calls == [0.0, 2.0]
    assert _same(_weights(model), w1)
    with pytest.raises(ValueError, match="step 3"):
        ex.run(3, scores)


@pytest.mark.parametrize("peak,expect", [(None, 10.0), (6, 6.0)])
def test_effopd_trainer_accepts(peak: int | None, expect: float) -> None:
    """Property 3 on a model: a monotone score keeps W + 10Δ, one peaking at coefficient 6
    (k = 3) keeps W + 6Δ; frozen params never move. The next Δ starts at the kept weights."""
    from mcore_rl.recipes.effopd import WeightExtrapolator

    model = _Tiny()
    ex = WeightExtrapolator([model])
    w0 = _weights(model)
    _train_step(model)
    w1 = _weights(model)
    score = (lambda c: float(c)) if peak is None else (lambda c: -abs(c - peak))
    scores = _Scores(model, w1["fc.bias"], w1["fc.bias"] - w0["fc.bias"], score)
    res = ex.run(1, scores)
    assert res.coefficient == expect and res.engine_stale == (peak is not None)
    now = _weights(model)
    assert torch.equal(now["frozen"], w0["frozen"])
    for n in ("fc.weight", "fc.bias"):
        assert torch.allclose(now[n], w1[n] + expect * (w1[n] - w0[n]), atol=1e-6)
    _train_step(model, scale=0.02)
    w2 = _weights(model)
    scores2 = _Scores(model, w2["fc.bias"], w2["fc.bias"] - now["fc.bias"], lambda c: -float(c))
    assert ex.run(2, scores2).accepted == 0 and scores2.calls == [0.0, 2.0]
    assert _same(_weights(model), w2)


def test_effopd_trainer_bf16_masters_restore_exactly() -> None:
    """With the trainer's optimizer in bf16 mode the fp32 masters are the weights: candidates are
    computed there, and a rejection puts back params and masters bit for bit."""
    from mcore_rl.config.schema import OptimizerConfig
    from mcore_rl.recipes.effopd import WeightExtrapolator
    from mcore_rl.train.optimizer import build_optimizer

    model = _Tiny(torch.bfloat16)
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=0.0, lr_decay_style="constant", lr_warmup_iters=0)
    opt = build_optimizer([model], cfg, "bf16", total_iters=10)
    ex = WeightExtrapolator([model], opt)
    masters0 = [m.clone() for m in opt.main_params]
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    opt.step()
    masters1 = [m.clone() for m in opt.main_params]
    assert not all(torch.equal(a, b) for a, b in zip(masters1, masters0))
    seen = []

    def evaluate() -> float:
        seen.append([m.clone() for m in opt.main_params])
        return 1.0 if len(seen) < 3 else 0.0  # base, k = 1 accepted, k = 2 rejected

    res = ex.run(1, evaluate)
    assert res.accepted == 1 and res.engine_stale
    for m, m0, m1, s1 in zip(opt.main_params, masters0, masters1, seen[1]):
        assert torch.equal(s1, m1 + 2 * (m1 - m0)) and torch.equal(m, s1)
    for p, m in zip(opt.model_params, opt.main_params):
        assert torch.equal(p.detach(), m.to(torch.bfloat16))

    before, before_masters = _weights(model), [m.clone() for m in opt.main_params]
    assert ex.run(2, lambda: 0.0, base_score=1.0).accepted == 0
    assert _same(_weights(model), before)
    assert all(torch.equal(a, b) for a, b in zip(opt.main_params, before_masters))


def test_effopd_trainer_state_and_failures() -> None:
    """An exception from evaluate restores the kept weights; the anchor survives a
    state_dict/load_state_dict round trip into a fresh extrapolator."""
    from mcore_rl.recipes.effopd import WeightExtrapolator

    model = _Tiny()
    ex = WeightExtrapolator([model])
    state = {k: (list(v) if isinstance(v, list) else v) for k, v in ex.state_dict().items()}
    w0 = _weights(model)
    _train_step(model)
    w1 = _weights(model)
    calls = []

    def broken() -> float:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("engine died")
        return 1.0

    with pytest.raises(RuntimeError, match="engine died"):
        ex.run(1, broken)
    assert _same(_weights(model), w1)
    resumed = WeightExtrapolator([model])
    resumed.load_state_dict(state)
    assert resumed.run(1, lambda: 1.0).accepted == 5  # ties accept
    for n in ("fc.weight", "fc.bias"):
        assert torch.allclose(model.state_dict()[n], w1[n] + 10 * (w1[n] - w0[n]), atol=1e-6)
    with pytest.raises(ValueError, match="anchor"):
        resumed.load_state_dict({"anchor": state["anchor"][:1]})
