"""Token-level advantages: Entropy Adv. (`entropy_adv`), EDGE-GRPO's EDA (`edge_eda`) and VIMPO
(`vimpo` advantage shaping + `vimpo_value` aux loss) — the testable properties of their specs, their
config keys and validation, and one learner step in a spawned DP=2 gloo world.

The pure tests do not import megatron; the learner test (marked slow) does, in its spawned ranks.
"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
import torch.distributed as dist

from mcore_rl.algos import registry
from mcore_rl.algos.advantages import dr_grpo
from mcore_rl.algos.edge_grpo import edge_eda, response_entropy, scaled_entropy
from mcore_rl.algos.entropy_adv import entropy_adv
from mcore_rl.algos.kl import k3
from mcore_rl.algos.multi_reward import OptionError
from mcore_rl.algos.vimpo import gae, standardize, td_advantage, value_loss_per_sequence, vimpo, vimpo_value
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.yaml")


def _token_stats(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of `tokens` [N, T], full-vocabulary entropy [N, T]) of `logits` [N, T, V], with grad."""
    logq = torch.log_softmax(logits, -1)
    return logq.gather(-1, tokens[..., None])[..., 0], -(logq.exp() * logq).sum(-1)


# ------------------------------------------------------------------------------------ Entropy Adv.


def _adv_batch(seed: int = 0, n: int = 6, t: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, generator=g)
    adv[1] = 0.0  # a zero-advantage response
    mask = torch.ones(n, t)
    mask[2, 4:] = 0
    mask[4, 2:] = 0
    entropy = torch.rand(n, t, generator=g) * 4  # up to 4 nats: α·H often exceeds |A|/κ
    entropy[0, :3] = 0.0
    return adv[:, None] * mask, mask, entropy


def test_entropy_adv_bounds_and_sign() -> None:
    adv, mask, entropy = _adv_batch()
    for alpha, kappa in ((0.4, 2.0), (0.1, 1.5), (5.0, 3.0)):
        shaped = entropy_adv(adv, mask, entropy=entropy, alpha=alpha, kappa=kappa)
        psi = (shaped - adv)[mask > 0]
        a = adv[mask > 0]
        assert bool((psi >= 0).all()) and bool((psi <= a.abs() / kappa + 1e-7).all())
        nz = a != 0
        assert torch.equal(torch.sign(shaped[mask > 0][nz]), torch.sign(a[nz]))
        assert bool((shaped[mask > 0][~nz] == 0).all()) and bool((shaped[mask == 0] == 0).all())
        # 2. a negative advantage stays below A(1 − 1/κ) < 0
        neg = a < 0
        assert bool(neg.any())
        assert bool((shaped[mask > 0][neg] <= a[neg] * (1 - 1 / kappa) + 1e-7).all())
        assert bool((shaped[mask > 0][neg] < 0).all())
    # the clip binds on some tokens and not on others at the paper's α (both branches are exercised)
    psi = entropy_adv(adv, mask, entropy=entropy) - adv
    clipped = (psi - adv.abs() / 2).abs() < 1e-7
    assert bool(clipped[adv != 0].any()) and bool((~clipped[adv != 0]).any())


def test_entropy_adv_negative_advantage_bound_is_tight_at_the_clip() -> None:
    adv = torch.tensor([[-1.0, -1.0, 2.0]])
    shaped = entropy_adv(adv, torch.ones(1, 3), entropy=torch.tensor([[100.0, 0.5, 100.0]]), alpha=0.4, kappa=2.0)
    torch.testing.assert_close(shaped, torch.tensor([[-0.5, -0.8, 3.0]]))


def test_entropy_adv_gradient_is_the_pg_gradient_with_the_constant_shaped_advantage() -> None:
    """3. The autograd check: H computed from the same logits that carry the gradient."""
    g = torch.Generator().manual_seed(3)
    n, t, v = 4, 5, 11
    logits0 = torch.randn(n, t, v, generator=g)
    tokens = torch.randint(0, v, (n, t), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])[:, None].expand(n, t).clone()
    mask = torch.ones(n, t)
    mask[1, 3:] = 0
    alpha, kappa = 0.05, 2.0  # small α: the entropy branch of the min is the one taken on most tokens

    def grad_of(shaped_fn) -> torch.Tensor:
        logits = logits0.clone().requires_grad_()
        logp, entropy = _token_stats(logits, tokens)
        loss = -(shaped_fn(entropy) * logp * mask).sum()
        (grad,) = torch.autograd.grad(loss, logits)
        return grad

    got = grad_of(lambda h: entropy_adv(adv, mask, entropy=h, alpha=alpha, kappa=kappa))
    const = entropy_adv(adv, mask, entropy=_token_stats(logits0, tokens)[1], alpha=alpha, kappa=kappa).detach()
    want = grad_of(lambda h: const)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # negative control: the same formula without the detach gives another gradient, so a missing
    # `.detach()` inside entropy_adv would fail the check above
    undetached = grad_of(lambda h: (adv + torch.minimum(alpha * h, adv.abs() / kappa)) * mask)
    assert (undetached - want).abs().max() > 1e-3


def test_entropy_adv_one_hot_distribution_gets_no_shaping() -> None:
    """4. A one-hot π (zero entropy) leaves A as it is; a spread one changes it (control)."""
    probs = torch.zeros(2, 3, 5)
    probs[0, :, 2] = 1.0  # one-hot at every position
    probs[1] = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)), -1)
    entropy = torch.special.entr(probs).sum(-1)
    assert bool((entropy[0] == 0).all()) and bool((entropy[1] > 0).all())
    adv = torch.tensor([[1.5] * 3, [1.5] * 3])
    shaped = entropy_adv(adv, torch.ones(2, 3), entropy=entropy)
    assert torch.equal(shaped[0], adv[0]) and bool((shaped[1] > adv[1]).all())


def test_entropy_adv_options_are_checked() -> None:
    adv, mask, entropy = _adv_batch()
    with pytest.raises(OptionError, match="kappa"):
        entropy_adv(adv, mask, entropy=entropy, kappa=1.0)
    with pytest.raises(OptionError, match="alpha"):
        entropy_adv(adv, mask, entropy=entropy, alpha=-0.1)
    with pytest.raises(ValueError, match="entropy"):
        entropy_adv(adv, mask, entropy=None)


# ------------------------------------------------------------------------------------ EDGE-GRPO EDA


def _eda_batch() -> dict:
    """Two groups of four; group 1 has a wrong-shaped mask and one invalid sample."""
    g = torch.Generator().manual_seed(1)
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    valid = torch.tensor([True] * 7 + [False])
    mask = torch.ones(8, 6)
    mask[1, 3:] = 0
    mask[6, 1:] = 0
    entropy = torch.rand(8, 6, generator=g) * 2 + 0.05
    seq = dr_grpo(rewards, gids, valid=valid)
    return dict(adv=seq[:, None] * mask, mask=mask, entropy=entropy, gids=gids, valid=valid, rewards=rewards)


def test_edge_eda_sign_identity_and_unit_group_mean() -> None:
    b = _eda_batch()
    out = edge_eda(b["adv"], b["mask"], group_ids=b["gids"], valid=b["valid"], entropy=b["entropy"])
    assert torch.equal(torch.sign(out), torch.sign(b["adv"]))
    assert bool((b["adv"] != 0).sum() > 20)
    # the group mean of P̂ over the group's valid samples is 1
    p = response_entropy(b["entropy"], b["mask"])
    phat = scaled_entropy(p, b["gids"], b["valid"])
    for gid in (0, 1):
        sel = (b["gids"] == gid) & b["valid"]
        torch.testing.assert_close(phat[sel].mean(), torch.tensor(1.0, dtype=torch.float64))
    # Â = A / P̂ token by token
    torch.testing.assert_close(out, (b["adv"].double() / phat[:, None]).float() * b["mask"])
    # equal P_i (each response's tokens have one constant entropy) -> Â = A
    flat = torch.full_like(b["entropy"], 0.7)
    same = edge_eda(b["adv"], b["mask"], group_ids=b["gids"], valid=b["valid"], entropy=flat)
    torch.testing.assert_close(same, b["adv"], rtol=0, atol=0)


def test_edge_eda_scale_invariance_and_zero_advantages() -> None:
    b = _eda_batch()
    kw = dict(group_ids=b["gids"], valid=b["valid"])
    out = edge_eda(b["adv"], b["mask"], entropy=b["entropy"], **kw)
    for c in (0.01, 3.0, 250.0):
        torch.testing.assert_close(edge_eda(b["adv"], b["mask"], entropy=c * b["entropy"], **kw), out)
    zero = edge_eda(torch.zeros_like(b["adv"]), b["mask"], entropy=b["entropy"], **kw)
    assert bool((zero == 0).all())


def test_edge_eda_low_entropy_responses_get_larger_magnitudes() -> None:
    b = _eda_batch()
    out = edge_eda(b["adv"], b["mask"], group_ids=b["gids"], valid=b["valid"], entropy=b["entropy"])
    phat = scaled_entropy(response_entropy(b["entropy"], b["mask"]), b["gids"], b["valid"])
    rows = b["valid"] & (b["adv"].abs().sum(1) > 0)
    low, high = rows & (phat < 1), rows & (phat > 1)
    assert bool(low.any()) and bool(high.any())
    m = b["mask"] > 0
    assert bool((out.abs()[low][m[low]] > b["adv"].abs()[low][m[low]]).all())
    assert bool((out.abs()[high][m[high]] < b["adv"].abs()[high][m[high]]).all())


def test_edge_eda_degenerate_entropies() -> None:
    """P̂ = 0 is floored at 1/max_scale; a group without entropy and an invalid sample keep A."""
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    mask, gids = torch.ones(4, 2), torch.tensor([0, 0, 1, 1])
    entropy = torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    out = edge_eda(adv, mask, group_ids=gids, entropy=entropy, max_scale=10.0)
    torch.testing.assert_close(out[0], adv[0] * 10)  # P̂ = 0 -> the floor 1/10
    torch.testing.assert_close(out[1], adv[1] / 2)  # P̂ = 1 / 0.5
    torch.testing.assert_close(out[2:], adv[2:], rtol=0, atol=0)  # all-zero-entropy group: A
    # an invalid sample is not in its group's mean (and its advantage is left alone)
    entropy2 = torch.tensor([[1.0, 1.0], [3.0, 3.0], [1.0, 1.0], [1.0, 1.0]])
    valid = torch.tensor([True, True, True, False])
    both = edge_eda(adv, mask, group_ids=gids, entropy=entropy2)
    torch.testing.assert_close(both[0], adv[0] * 2)  # mean 2 -> P̂ = 0.5
    one = edge_eda(adv, mask, group_ids=gids, valid=valid, entropy=entropy2)
    torch.testing.assert_close(one[2], adv[2], rtol=0, atol=0)  # alone in its group: P̂ = 1
    with pytest.raises(OptionError, match="max_scale"):
        edge_eda(adv, mask, group_ids=gids, entropy=entropy, max_scale=0.5)


# ------------------------------------------------------------------------------------ VIMPO


def _vimpo_logits(seed: int = 2, n: int = 4, t: int = 6, v: int = 9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, t, v, generator=g, dtype=torch.float64)
    ref_logits = logits + 0.5 * torch.randn(n, t, v, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, v, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return logits, ref_logits, tokens, mask


def test_vimpo_at_the_reference_policy_everything_vanishes() -> None:
    """1. π_θ = π_ref: ρ = κ = 0, Â^TD = 0 (and its GAE), L_V = ½(R − R̄)²."""
    logits, _, tokens, mask = _vimpo_logits()
    logp, _ = _token_stats(logits, tokens)
    assert bool((td_advantage(logp, logp, 0.1) == 0).all())
    adv = vimpo(torch.ones_like(logp), mask, old_logp=logp, ref_logp=logp.clone())
    assert bool((adv == 0).all())
    rewards, gids = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1])
    centred = dr_grpo(rewards, gids)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    out = vimpo_value(
        logp.clone().requires_grad_(),
        ref_logp=logp,
        mask=mask,
        seq_advantages=centred,
        agg="seq-mean-token-mean",
        rewards=rewards,
        group_ids=gids,
    )
    torch.testing.assert_close(out.loss, (0.5 * centred.square()).mean().double())
    per_seq = 0.5 * centred.square().double()
    torch.testing.assert_close(value_loss_per_sequence(logp, logp, k3(logp, logp), centred, mask, 0.1), per_seq)
    # the other modes share the policy loss's count: token-mean weighs each response by its length
    lengths = mask.sum(-1)
    tok = vimpo_value(logp, ref_logp=logp, mask=mask, seq_advantages=centred, agg="token-mean")
    torch.testing.assert_close((tok.loss_sum, tok.count), ((per_seq * lengths).sum(), lengths.sum()))


def test_vimpo_td_advantage_has_zero_mean_under_the_policy() -> None:
    """2. Enumerating a 7-token vocabulary: E_π[β log π/π_ref] − β KL(π‖π_ref) = 0 exactly, and so is
    E_π of the TD advantage as built (its KL is the k3 estimate at the token, E_π[k3] = KL)."""
    g = torch.Generator().manual_seed(4)
    beta = 0.3
    for _ in range(5):
        logq = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
        logr = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, -1)
        q = logq.exp()
        kl = (q * (logq - logr)).sum()
        assert float(kl) > 0.05
        assert abs(float((q * beta * (logq - logr)).sum() - beta * kl)) < 1e-12
        assert abs(float((q * k3(logq, logr)).sum() - kl)) < 1e-12
        assert abs(float((q * td_advantage(logq, logr, beta)).sum())) < 1e-12
        # zero in expectation, not per token: the per-token advantage carries credit
        assert float(td_advantage(logq, logr, beta).abs().max()) > 1e-3


def test_vimpo_value_loss_has_no_gradient_through_the_kl() -> None:
    """3. ∂L_V/∂θ with sg[KL] = the gradient with KL a constant tensor; the undetached KL differs."""
    logits0, ref_logits, tokens, mask = _vimpo_logits()
    ref_logp, _ = _token_stats(ref_logits, tokens)
    target = torch.tensor([0.5, -0.5, 0.25, -0.25], dtype=torch.float64)
    beta = 0.2

    def grad_of(loss_fn) -> torch.Tensor:
        logits = logits0.clone().requires_grad_()
        logp, _ = _token_stats(logits, tokens)
        (grad,) = torch.autograd.grad(loss_fn(logp), logits)
        return grad

    got = grad_of(
        lambda lp: (
            vimpo_value(
                lp, ref_logp=ref_logp, mask=mask, seq_advantages=target, beta=beta, agg="seq-mean-token-mean"
            ).loss_sum
        )
    )
    kl_const = k3(_token_stats(logits0, tokens)[0], ref_logp).detach().clone()

    def summed(lp, kl):  # the seq-mean-token-mean sum: Σ_i L_V,i
        return value_loss_per_sequence(lp, ref_logp, kl, target, mask, beta).sum()

    torch.testing.assert_close(got, grad_of(lambda lp: summed(lp, kl_const)), rtol=1e-12, atol=1e-12)
    undetached = grad_of(lambda lp: summed(lp, k3(lp, ref_logp)))
    assert (undetached - got).abs().max() > 1e-4


def test_vimpo_gae_limits_and_standardisation() -> None:
    """4. λ = 0: Â = Â^TD; λ = γ = 1: the suffix sum of Â^TD over the response; normalised: mean 0, std 1."""
    logits, ref_logits, tokens, mask = _vimpo_logits()
    old, _ = _token_stats(logits, tokens)
    ref, _ = _token_stats(ref_logits, tokens)
    td = td_advantage(old, ref, 0.1) * mask
    torch.testing.assert_close(gae(td, mask, 1.0, 0.0), td, rtol=0, atol=0)
    suffix = td.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(gae(td, mask, 1.0, 1.0), suffix)
    # γλ = 0.5 on a hand-checkable row
    row = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    torch.testing.assert_close(
        gae(row, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 1.0, 0.5), torch.tensor([[3.0, 4.0, 4.0, 0.0]])
    )
    zeros = torch.zeros_like(old)
    kw = dict(old_logp=old, ref_logp=ref, beta=0.1)
    torch.testing.assert_close(vimpo(zeros, mask, lam=0.0, normalize=False, **kw), td.to(zeros.dtype))
    torch.testing.assert_close(vimpo(zeros, mask, lam=1.0, gamma=1.0, normalize=False, **kw), suffix)
    out = vimpo(zeros, mask, lam=0.95, **kw)
    sel = out[mask > 0]
    assert abs(float(sel.mean())) < 1e-9 and abs(float(sel.std(unbiased=False)) - 1) < 1e-5
    assert bool((out[mask == 0] == 0).all())
    torch.testing.assert_close(out, standardize(gae(td, mask, 1.0, 0.95), mask, 1e-6))


def test_vimpo_needs_the_reference_and_checks_options() -> None:
    logits, _, tokens, mask = _vimpo_logits()
    old, _ = _token_stats(logits, tokens)
    with pytest.raises(ValueError, match="reference_model"):
        vimpo(torch.zeros_like(old), mask, old_logp=old, ref_logp=None)
    with pytest.raises(ValueError, match="reference_model"):
        vimpo_value(old, ref_logp=None, mask=mask, seq_advantages=torch.zeros(4))
    for option, value in (("beta", 0.0), ("lam", 1.5), ("gamma", -0.1)):
        with pytest.raises(OptionError, match=option):
            vimpo(torch.zeros_like(old), mask, old_logp=old, ref_logp=old, **{option: value})
    assert registry.get("advantage_shaping", "vimpo").needs_reference
    assert registry.get("aux_loss", "vimpo_value").needs_reference
    assert not getattr(registry.get("advantage_shaping", "entropy_adv"), "needs_reference", False)


# ------------------------------------------------------------------------------------ config

ALL_FOUR = [
    "algorithm.advantage=dr_grpo",
    "algorithm.advantage_shaping=[{name: vimpo, options: {beta: 0.1, lam: 0.95}},"
    " {name: entropy_adv, options: {alpha: 0.4, kappa: 2.0}}, {name: edge_eda}]",
    "algorithm.aux_losses=[{name: vimpo_value, coef: 200.0, options: {beta: 0.1}}]",
]

YAML = """
algorithm:
  advantage: dr_grpo
  reference_model: true
  advantage_shaping:
    - {name: vimpo, options: {beta: 0.05, lam: 0.9}}
    - {name: entropy_adv, options: {alpha: 0.4, kappa: 3.0}}
    - {name: edge_eda, options: {max_scale: 5.0}}
  aux_losses:
    - {name: vimpo_value, coef: 200.0, options: {beta: 0.05}}
"""


def test_config_keys_load_from_yaml_and_validation_names_the_key(tmp_path) -> None:
    path = tmp_path / "token.yaml"
    path.write_text(YAML)
    cfg = load_config(RLConfig, str(path))
    validate_rl_config(cfg, 1)
    a = cfg.algorithm
    assert [s.name for s in a.advantage_shaping] == ["vimpo", "entropy_adv", "edge_eda"]
    assert a.advantage_shaping[1].options == {"alpha": 0.4, "kappa": 3.0} and a.aux_losses[0].coef == 200.0
    assert a.uses_reference() and a.kl_coef == 0
    # the demo overrides of the rows file pass validation
    validate_rl_config(load_config(RLConfig, DEMO, ALL_FOUR + ["algorithm.reference_model=true"]), 1)
    for name in ("entropy_adv", "edge_eda"):  # no π_ref needed
        validate_rl_config(load_config(RLConfig, DEMO, [f"algorithm.advantage_shaping=[{{name: {name}}}]"]), 1)
    bad = [
        (
            ["algorithm.advantage_shaping=[{name: entropy_adv, options: {kappa: 1.0}}]"],
            "algorithm.advantage_shaping[0].options.kappa: must be > 1",
        ),
        (
            ["algorithm.advantage_shaping=[{name: entropy_adv, options: {tau: 1.0}}]"],
            "algorithm.advantage_shaping[0].options.tau: is not an option",
        ),
        (
            ["algorithm.advantage_shaping=[{name: entropy_adv}, {name: edge_eda, options: {max_scale: 0.5}}]"],
            "algorithm.advantage_shaping[1].options.max_scale: must be >= 1",
        ),
        (
            ["algorithm.reference_model=true", "algorithm.advantage_shaping=[{name: vimpo, options: {lam: 2}}]"],
            "algorithm.advantage_shaping[0].options.lam: must be in [0, 1]",
        ),
        (
            ["algorithm.reference_model=true", "algorithm.aux_losses=[{name: vimpo_value, options: {beta: -1}}]"],
            "algorithm.aux_losses[0].options.beta: must be > 0",
        ),
        (ALL_FOUR, "algorithm.reference_model: algorithm.advantage_shaping[0] 'vimpo' reads π_ref's log-probs"),
        (ALL_FOUR, "algorithm.reference_model: algorithm.aux_losses[0] 'vimpo_value' reads π_ref's log-probs"),
        (
            ALL_FOUR + ["algorithm.reference_model=false", "algorithm.kl_coef=0.1"],
            "algorithm.reference_model: algorithm.advantage_shaping[0] 'vimpo'",
        ),
    ]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate_rl_config(load_config(RLConfig, DEMO, overrides), 1)
    validate_rl_config(load_config(RLConfig, DEMO, ALL_FOUR + ["algorithm.kl_coef=0.01"]), 1)  # π_ref via the KL


# ------------------------------------------------------------------------------------ the learner

LEARNER_OPTIONS = ALL_FOUR + [
    "algorithm.reference_model=true",
    "algorithm.num_minibatches=2",
    "train.micro_batch_size=2",
    "init.sft_steps=0",
    "algorithm.mismatch.name=tis",
]


def _samples(tokenizer) -> list:
    """Four prompts, four samples each, 0/1 rewards, responses of 1 to 4 tokens; one unusable."""
    from mcore_rl.data.samples import Prompt, Sample

    rng = random.Random(11)
    out = []
    for g in range(4):
        text = f"{g}+{g}="
        prompt = Prompt(index=g, text=text, ids=[tokenizer.bos_id] + tokenizer.encode(text))
        for _ in range(4):
            n = rng.randint(1, 4)
            rsp = [rng.randrange(3, 60) for _ in range(n)]
            out.append(
                Sample(
                    prompt,
                    g,
                    rsp,
                    [-1.0 - 0.1 * i for i in range(n)],
                    policy_version=0,
                    finish_reason="stop",
                    reward=float(rng.random() < 0.5),
                )
            )
    out[6].reward_error = "timeout after 2s"  # left out of the statistics
    return out


def _whole_batch_advantages(samples, old, ref, entropy) -> torch.Tensor:
    """What one process holding the whole batch gets, written out with the pure functions."""
    from mcore_rl.train.packing import sequence_view

    v = sequence_view(samples)
    valid = v.ok.bool()
    mask = v.mask * valid[:, None]
    seq = dr_grpo(v.rewards, v.group_ids, valid=valid)
    tokens = seq[:, None].float() * mask
    kw = dict(group_ids=v.group_ids, valid=valid, entropy=entropy, old_logp=old, ref_logp=ref)
    tokens = vimpo(tokens, mask, beta=0.1, lam=0.95, **kw).float() * mask
    tokens = entropy_adv(tokens, mask, alpha=0.4, kappa=2.0, **kw).float() * mask
    return edge_eda(tokens, mask, **kw).float() * mask


def _world(rank: int, world_size: int) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.train.packing import build_microbatches, split_minibatches
    from mcore_rl.train.policy import build_policy, build_reference_model, copy_weights
    from mcore_rl.train.rl_step import Learner
    from tests.helpers import tiny

    cfg = tiny(*LEARNER_OPTIONS)
    policy = build_policy(cfg, validate_rl_config, total_iters=4)
    assert ps.get_data_parallel_world_size() == 2
    ref_chunks = build_reference_model(cfg)
    copy_weights(ref_chunks, policy.chunks)
    gen = torch.Generator().manual_seed(7)  # the same perturbation on both ranks: π_ref ≠ π_old
    with torch.no_grad():
        for c in ref_chunks:
            for p in c.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    learner = Learner(cfg, policy.chunks, policy.optimizer, ref_chunks, policy.tokenizer.pad_id)
    box = [_samples(policy.tokenizer) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    samples = box[0]
    n = len(samples)

    per_seq, metrics = learner.prepare(samples)
    t = per_seq["old_logp"].shape[1]
    _, entropy = learner.token_logprobs(samples, t, with_entropy=True)  # π_old's, as prepare saw it
    want = _whole_batch_advantages(samples, per_seq["old_logp"], per_seq["ref_logp"], entropy)
    got = per_seq["advantages"]
    assert got.shape == (n, t)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # VIMPO's part is there: π_ref differs from π_old
    assert float(per_seq["ref_logp"].sub(per_seq["old_logp"]).abs().max()) > 1e-3
    assert bool((got[6] == 0).all()) and int((got != 0).sum()) > n  # the unusable sample trains on nothing
    assert metrics["advantage/shaped_abs_mean"] > 0 and metrics["kl/ref"] > 0
    both = [None, None]
    dist.all_gather_object(both, per_seq["advantages"])
    assert torch.equal(both[0], both[1])

    # the micro-batches each rank trains on carry the whole batch's per-token advantages
    tc = cfg.train
    controls = 0
    for part in split_minibatches(n, cfg.algorithm.num_minibatches, tc.seed, 0, 0):
        mbs = build_microbatches(
            samples, part, tc.seq_length, tc.micro_batch_size, rank, world_size, policy.tokenizer.pad_id, t, per_seq
        )
        mine = [(int(i), a.tolist()) for mb in mbs for i, a in zip(mb["seq_index"], mb["advantages"])]
        gathered = [None, None]
        dist.all_gather_object(gathered, mine)
        assert sorted(i for share in gathered for i, _ in share) == sorted(part)
        for share in gathered:
            for i, a in share:
                assert torch.equal(torch.tensor(a), got[i]), i
        # negative control: this rank's share alone (its own standardisation and group means) differs
        own = sorted(i for i, _ in gathered[rank])
        if own:  # (a rank may get no sample of a mini-batch)
            sub = [samples[i] for i in own]
            cut = max(len(x.response_ids) for x in sub)
            local = _whole_batch_advantages(
                sub, *(x[own][:, :cut] for x in (per_seq["old_logp"], per_seq["ref_logp"], entropy))
            )
            assert not torch.allclose(local, want[own][:, :cut]), "a rank's share alone gave the batch's advantages"
            controls += 1
    counts = [None, None]
    dist.all_gather_object(counts, controls)
    assert sum(counts) >= 2, counts

    # the first optimizer step's value loss is taken at θ = π_old: what the pure function gives on its mini-batch
    first = list(split_minibatches(n, cfg.algorithm.num_minibatches, tc.seed, 0, 0))[0]
    part = torch.tensor(sorted(first))
    value = vimpo_value(
        per_seq["old_logp"][part],
        ref_logp=per_seq["ref_logp"][part],
        mask=per_seq["keep"][part],
        seq_advantages=per_seq["aux_seq_advantages"][part],
        agg=cfg.algorithm.loss_agg,
        beta=0.1,
    )
    torch.testing.assert_close(
        per_seq["aux_seq_advantages"],
        dr_grpo(per_seq["aux_rewards"], per_seq["aux_group_ids"], valid=per_seq["keep"].sum(1) > 0),
    )
    records, batch_metrics = learner.train(samples, 0)
    assert len(records) == 2
    got_value = torch.tensor(records[0]["aux/vimpo_value/loss"], dtype=torch.float64)
    torch.testing.assert_close(got_value, value.loss.double(), rtol=1e-4, atol=1e-6)
    for r in records:
        assert torch.isfinite(torch.tensor(r["train/loss"])) and "aux/vimpo_value/loss" in r
        assert r["aux/vimpo_value/loss"] > 0
    losses = [None, None]
    dist.all_gather_object(losses, [(r["train/loss"], r["aux/vimpo_value/loss"]) for r in records])
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_dp2_learner_trains_with_the_whole_batch_token_advantages() -> None:
    from tests.world import run_world

    run_world(2, _world)
