"""Filters, judges and rubrics: PROF-GRPO, ExpRL-Process's segment advantages, RLCER's rubric
rewards and GRAPE's candidate selection (docs/papers.md) — each testable property of their
papers, their config keys and the errors of bad option values. Pure: no megatron."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.multi_reward import option_problems
from mcore_rl.algos.prof_grpo import balanced_counts, consistency, prof_grpo
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config

TINY = [
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.max_position_embeddings=64",
    "train.seq_length=32",
    "data.synthetic_max_digits=1",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=4",
    "rollout.context_length=64",
]


def _literal(text: str) -> str:
    return re.escape(text)


# ============================================================================ PROF-GRPO

HEADS = ("prm", "prm_steps")


def _prof_batch(correct: list[int], prm: list[float], steps: list[float] | None = None, groups: int = 1):
    """One or more groups of 0/1 outcomes with mean PRM scores (heads "prm", "prm_steps")."""
    n = len(correct)
    rewards = torch.tensor(correct, dtype=torch.float32).repeat(groups)
    gids = torch.arange(groups).repeat_interleave(n)
    st = steps if steps is not None else [5.0] * n
    heads = torch.tensor([prm, st], dtype=torch.float32).T.repeat(groups, 1)
    return rewards, gids, heads


def _call(rewards, gids, heads, **options) -> torch.Tensor:
    return prof_grpo(
        rewards,
        gids,
        valid=torch.ones(len(rewards), dtype=torch.bool),
        reward_heads=heads,
        head_names=HEADS,
        **{"steps_head": "prm_steps", **options},
    )


def test_prof_balanced_counts() -> None:
    assert balanced_counts(8, 8, 8) == (4, 4)
    assert balanced_counts(2, 14, 8) == (2, 6)  # too few correct: all of them, the rest wrong
    assert balanced_counts(14, 2, 8) == (6, 2)
    assert balanced_counts(16, 0, 8) == (8, 0)
    assert balanced_counts(3, 4, 8) == (3, 4)  # n <= m: everything
    assert balanced_counts(5, 5, 7) == (3, 4)  # odd m: |k+ - k-| <= 1
    for n_pos in range(0, 17):  # k+ + k- = m, k+·k- maximal among the feasible splits
        n_neg = 16 - n_pos
        for m in range(1, 16):
            kp, kn = balanced_counts(n_pos, n_neg, m)
            assert kp + kn == m and kp <= n_pos and kn <= n_neg
            best = max(a * (m - a) for a in range(0, m + 1) if a <= n_pos and m - a <= n_neg)
            assert kp * kn == best


def test_prof_keeps_exactly_m_balanced_and_all_correct_when_few() -> None:
    """Property 1: exactly m kept when n >= m, |k+ - k-| <= 1 when both sides are large enough; with
    fewer than floor(m/2) correct, all correct are kept and the rest filled with wrong ones."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        n, m = 16, int(torch.randint(2, 12, (1,), generator=gen))
        correct = (torch.rand(n, generator=gen) < torch.rand(1, generator=gen)).long().tolist()
        prm = torch.rand(n, generator=gen).tolist()
        for variant in ("pos", "both"):
            keep = _call(*_prof_batch(correct, prm), keep=m, variant=variant, seed=trial)
            c = torch.tensor(correct, dtype=torch.bool)
            kp, kn = int((keep & c).sum()), int((keep & ~c).sum())
            assert kp + kn == m
            n_pos, n_neg = int(c.sum()), int((~c).sum())
            if n_pos >= m // 2 + 1 and n_neg >= m // 2 + 1:
                assert abs(kp - kn) <= 1
            if n_pos < m // 2:
                assert kp == n_pos and kn == m - n_pos
    # n < m: nothing to filter
    keep = _call(*_prof_batch([1, 0, 1], [0.1, 0.2, 0.3]), keep=8)
    assert keep.all()
    # several groups: m per group
    keep = _call(*_prof_batch([1, 1, 1, 0, 0, 0, 1, 0], [0.9, 0.1, 0.5, 0.3, 0.2, 0.8, 0.4, 0.6], groups=3), keep=4)
    assert keep.view(3, 8).sum(1).tolist() == [4, 4, 4]


def test_prof_correct_side_is_the_top_by_consistency_and_order_free() -> None:
    """Property 2: in G+ the kept set is the top-k+ by r^pro, whatever the input order."""
    correct = [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    prm = [0.9, 0.2, 0.7, 0.4, 0.95, 0.1, 0.3, 0.8, 0.6, 0.5, 0.05, 0.45]
    r, g, h = _prof_batch(correct, prm)
    for variant in ("pos", "both"):
        keep = _call(r, g, h, keep=6, variant=variant)
        assert set(torch.nonzero(keep[:6]).flatten().tolist()) == {0, 2, 4}  # prm 0.9, 0.7, 0.95
        for seed in range(10):
            perm = torch.randperm(12, generator=torch.Generator().manual_seed(seed))
            kp = _call(r[perm], g, h[perm], keep=6, variant=variant)
            kept_correct = {int(perm[i]) for i in torch.nonzero(kp).flatten().tolist() if correct[int(perm[i])]}
            assert kept_correct == {0, 2, 4}
    # PROF-BOTH: G- keeps its highest r^pro, i.e. the wrong answers with the *lowest* PRM score
    keep = _call(r, g, h, keep=6, variant="both")
    assert set(torch.nonzero(keep[6:]).flatten().add(6).tolist()) == {10, 6, 11}  # prm 0.05, 0.3, 0.45
    # negative control: the summary's literal "lowest r^pro" would have kept 0.8, 0.6, 0.5 instead
    assert not keep[7] and not keep[8] and not keep[9]


def test_prof_pos_wrong_side_ignores_the_prm() -> None:
    """Property 3: PROF-POS's kept wrong set does not depend on the wrong samples' PRM scores (here:
    exactly, for a fixed seed and group); different seeds do draw different sets."""
    correct = [1] * 4 + [0] * 12
    gen = torch.Generator().manual_seed(1)
    prm = torch.rand(16, generator=gen).tolist()
    base = _call(*_prof_batch(correct, prm), keep=8, variant="pos", seed=3)
    for s in range(20):
        wrong = torch.tensor(prm[4:])[torch.randperm(12, generator=torch.Generator().manual_seed(s))]
        shuffled = prm[:4] + wrong.tolist()
        assert torch.equal(_call(*_prof_batch(correct, shuffled), keep=8, variant="pos", seed=3), base)
    draws = {tuple(_call(*_prof_batch(correct, prm), keep=8, variant="pos", seed=s)[4:].tolist()) for s in range(20)}
    assert len(draws) > 5  # really random over seeds
    # negative control: PROF-BOTH does follow the PRM on the wrong side
    both = [
        _call(*_prof_batch(correct, prm[:4] + list(reversed(prm[4:]))), keep=8, variant="both"),
        _call(*_prof_batch(correct, prm), keep=8, variant="both"),
    ]
    assert not torch.equal(both[0][4:], both[1][4:])


def test_prof_step_penalty_before_the_outcome_sign() -> None:
    """Property 4: a 1-step or >= H_λ-step response has λ subtracted before · r^o: a correct one's
    r^pro falls by λ, a wrong one's rises by λ."""
    prm, lam = torch.tensor([0.6, 0.6, 0.6, 0.6]), 0.25
    steps = torch.tensor([1.0, 5.0, 30.0, 29.0])
    plus = consistency(prm, steps, torch.ones(4), lam, 30)
    minus = consistency(prm, steps, -torch.ones(4), lam, 30)
    torch.testing.assert_close(plus, torch.tensor([0.35, 0.6, 0.35, 0.6], dtype=torch.float64))
    torch.testing.assert_close(minus, torch.tensor([-0.35, -0.6, -0.35, -0.6], dtype=torch.float64))
    # through the filter: a correct 1-step answer loses its place to a slightly worse multi-step one
    keep = _call(
        *_prof_batch([1, 1, 0, 0, 0], [0.9, 0.8, 0.1, 0.2, 0.3], steps=[1, 5, 5, 5, 5]),
        keep=2,
        variant="both",
        step_penalty=0.5,
    )
    assert keep.tolist() == [False, True, True, False, False]
    keep = _call(
        *_prof_batch([1, 1, 0, 0, 0], [0.9, 0.8, 0.1, 0.2, 0.3], steps=[1, 5, 5, 5, 5]),
        keep=2,
        variant="both",
        step_penalty=0.0,
    )
    assert keep.tolist() == [True, False, True, False, False]
    # a wrong 40-step answer's r^pro rises by λ: it becomes the clearer negative over a lower-PRM one
    batch = _prof_batch([1, 0, 0], [0.9, 0.2, 0.1], steps=[5, 40, 5])
    assert _call(*batch, keep=2, variant="both", step_penalty=0.5).tolist() == [True, True, False]
    assert _call(*batch, keep=2, variant="both", step_penalty=0.0).tolist() == [True, False, True]


def test_prof_never_touches_rewards_and_respects_valid() -> None:
    r, g, h = _prof_batch([1, 1, 1, 1, 0, 0, 0, 0], [0.9, 0.8, 0.7, 0.6, 0.1, 0.2, 0.3, 0.4])
    before = (r.clone(), h.clone())
    valid = torch.tensor([False, True, True, True, True, True, True, True])
    keep = prof_grpo(r, g, valid=valid, reward_heads=h, head_names=HEADS, keep=4, variant="both")
    assert keep.dtype == torch.bool and not keep[0]  # an invalid sample is never kept
    assert int(keep.sum()) == 4 and keep[1] and keep[2]
    assert torch.equal(r, before[0]) and torch.equal(h, before[1])
    # GRPO on the kept samples only: the PRM changes which samples train, never their reward
    adv = grpo(r, g, normalize_std=True, valid=keep)
    assert torch.equal(adv[~keep], torch.zeros(int((~keep).sum())))
    assert set(adv[keep].sign().tolist()) == {1.0, -1.0}
    # no PRM head in the batch: balanced seeded random sub-sampling, still m per group
    keep = prof_grpo(r, g, valid=torch.ones(8, dtype=torch.bool), reward_heads=torch.zeros(8, 0), head_names=(), keep=4)
    assert int(keep.sum()) == 4 and int(keep[:4].sum()) == 2


def test_prof_options_and_config_keys() -> None:
    assert "prof_grpo" in algos.names("sample_filter")
    assert (
        option_problems(
            "sample_filter", "prof_grpo", {"keep": 4, "variant": "both", "step_penalty": 0.1, "steps_head": "prm_steps"}
        )
        == []
    )
    assert option_problems("sample_filter", "prof_grpo", {"variant": "neg"})[0][0] == "variant"
    assert option_problems("sample_filter", "prof_grpo", {"keep": 0})[0][0] == "keep"
    cfg = load_config(
        RLConfig,
        None,
        TINY
        + ["rollout.group_size=8", "algorithm.sample_filters=[{name: prof_grpo, options: {keep: 4, variant: both}}]"],
    )
    validate_rl_config(cfg, 1)
    assert cfg.algorithm.sample_filters[0].options == {"keep": 4, "variant": "both"}
    for override, message in [
        (
            "algorithm.sample_filters=[{name: prof_grpo, options: {variant: neg}}]",
            "algorithm.sample_filters[0].options.variant: must be one of pos, both",
        ),
        (
            "algorithm.sample_filters=[{name: prof_grpo, options: {step_penalty: -1.0}}]",
            "algorithm.sample_filters[0].options.step_penalty: must be >= 0",
        ),
        (
            "algorithm.sample_filters=[{name: prof_grpo, options: {step_penalty: 0.5}}]",
            "algorithm.sample_filters[0].options.step_penalty: needs steps_head",
        ),
        (
            "algorithm.sample_filters=[{name: prof_grpo, options: {m: 4}}]",
            "algorithm.sample_filters[0].options.m: is not an option",
        ),
    ]:
        with pytest.raises(ConfigError, match=_literal(message)):
            validate_rl_config(load_config(RLConfig, None, TINY + [override]), 1)


# ============================================================================ ExpRL-Process

from mcore_rl.algos.exprl import exprl_segments, segment_deltas, segment_heads, spread_segments  # noqa: E402  (imported by the section that tests it)

NAN = float("nan")


def _segments(scores: list[list[float]], ends: list[list[int]], t: int, lengths: list[int]):
    """A batch whose samples carry segment heads (exprl_s<k>, exprl_e<k>; NaN past a sample's last)."""
    k = max(len(s) for s in scores)
    names = sorted([f"exprl_s{i}" for i in range(k)] + [f"exprl_e{i}" for i in range(k)])
    heads = torch.full((len(scores), len(names)), NAN)
    for row, (sc, en) in enumerate(zip(scores, ends)):
        for name, value in segment_heads(sc, en).items():
            heads[row, names.index(name)] = value
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    return heads, tuple(names), mask


def _shape(adv_seq: torch.Tensor, heads, names, mask, valid=None, **options) -> torch.Tensor:
    n = mask.shape[0]
    return exprl_segments(
        adv_seq[:, None] * mask,
        mask,
        rewards=torch.zeros(n),
        group_ids=torch.zeros(n, dtype=torch.long),
        valid=valid if valid is not None else torch.ones(n, dtype=torch.bool),
        domain_ids=torch.zeros(n, dtype=torch.long),
        reward_heads=heads,
        head_names=names,
        entropy=torch.zeros_like(mask),
        old_logp=torch.zeros_like(mask),
        rollout_logp=torch.zeros_like(mask),
        ref_logp=None,
        **options,
    )


def test_exprl_delta_advantages_sum_to_zero_and_one_segment_gets_zero() -> None:
    """Property 2: with DeltaNorm a trajectory's segment advantages sum to 0; T = 1 gives A_1 = 0."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, k = 6, int(torch.randint(1, 7, (1,), generator=gen))
        s = torch.randint(0, 5, (n, k), generator=gen).double() / 4  # judge scores are quarters
        counts = torch.randint(1, k + 1, (n,), generator=gen)
        s[torch.arange(k)[None, :] >= counts[:, None]] = NAN
        a = segment_deltas(s)
        assert torch.allclose(torch.nan_to_num(a).sum(1), torch.zeros(n, dtype=torch.float64), atol=1e-12)
        assert torch.equal(a.isnan(), s.isnan())
    a = segment_deltas(torch.tensor([[0.75, NAN, NAN]]))
    assert a[0, 0] == 0
    # the formula, written out: A_1 = s_1 - s_T, A_t = s_t - s_{t-1}; EndNorm A_t = s_t - s_T
    s = torch.tensor([[0.25, 0.75, 0.5]])
    assert segment_deltas(s).tolist() == [[-0.25, 0.5, -0.25]]
    assert segment_deltas(s, "end").tolist() == [[-0.25, 0.25, 0.0]]


def test_exprl_every_token_of_a_segment_gets_the_raw_delta_without_group_normalisation() -> None:
    """Property 3: every token in segment t receives A_t and nothing is group-normalised: the
    advantages equal the raw deltas, and another sample of the group changes nothing."""
    heads, names, mask = _segments([[0.25, 0.75, 0.5], [0.0, 1.0]], [[3, 5, 8], [2, 4]], t=8, lengths=[8, 6])
    out = _shape(torch.tensor([9.0, 9.0]), heads, names, mask)
    assert out[0].tolist() == [-0.25] * 3 + [0.5] * 2 + [-0.25] * 3
    assert out[1].tolist() == [-1.0] * 2 + [1.0] * 4 + [0.0] * 2  # tokens past the last end: last segment; pad 0
    other = heads.clone()
    other[1] = torch.where(other[1].isnan(), other[1], other[1] * 0 + 0.5)  # sample 1 changes entirely
    torch.testing.assert_close(_shape(torch.tensor([9.0, 9.0]), other, names, mask)[0], out[0])
    # negative control: a group z-score of the same deltas is not what the learner gets
    flat = out[mask.bool()]
    assert not torch.allclose((flat - flat.mean()) / flat.std(), flat)
    # spread_segments itself: the segment a token lands in is e_{k-1} <= j < e_k
    v = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    assert spread_segments(v, torch.tensor([[1.0, 2.0, 4.0]]), torch.ones(1, 5)).tolist() == [[1, 2, 3, 3, 3]]


def test_exprl_segments_keeps_other_samples_and_zeroes_invalid_ones() -> None:
    heads, names, mask = _segments([[0.5, 1.0], [NAN]], [[2, 4], [NAN]], t=4, lengths=[4, 3])
    heads = heads.clone()
    incoming = torch.tensor([0.3, -0.7])
    out = _shape(incoming, heads, names, mask)
    assert out[0].tolist() == [-0.5, -0.5, 0.5, 0.5]
    torch.testing.assert_close(out[1], torch.tensor([-0.7, -0.7, -0.7, 0.0]))  # no segments: the advantage it had
    out = _shape(incoming, heads, names, mask, valid=torch.tensor([False, True]))
    assert out[0].tolist() == [0.0] * 4
    # no segment heads in the batch at all: the identity
    torch.testing.assert_close(_shape(incoming, torch.zeros(2, 0), (), mask), incoming[:, None] * mask)
    assert option_problems("advantage_shaping", "exprl_segments", {"norm": "end"}) == []
    assert option_problems("advantage_shaping", "exprl_segments", {"norm": "group"})[0][0] == "norm"


def test_exprl_process_end_to_end_from_a_judge_server_to_token_advantages(tmp_path) -> None:
    """The scripted /generate judge scores every prefix; the segment ends (characters, with a
    two-byte character in the text) become token heads with the byte tokenizer; the learner's
    sequence view and exprl_segments give every token its segment's raw delta."""
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rewards import RewardInput, RewardRunner
    from mcore_rl.rewards.judge import judge_reward_fn
    from mcore_rl.recipes.judge_heads import add_segment_heads
    from mcore_rl.train.packing import sequence_view
    from tests.helpers import ScriptedJudge

    one, two = "étape un ###", "étape un ### step two ###"
    text = two + " answer 8"
    rules = [
        [f"[Attempt]\n{one}\n", "Score: 2"],
        [f"[Attempt]\n{two}\n", "Score: 4"],
        [f"[Attempt]\n{text}\n", "Score: 3"],
    ]
    judge = ScriptedJudge(tmp_path, rules)
    try:
        with RewardRunner(judge_reward_fn("exprl_process", url=judge.url, reference="ref"), max_concurrency=2) as r:
            (res,) = r.score_sync([RewardInput("p", text)])
    finally:
        judge.close()
    assert res.error is None and res.info["segment_scores"] == [0.25, 0.75, 0.5]
    tok = load_tokenizer()
    ids = tok.encode(text) + [tok.eos_id]
    prompt = Prompt(index=0, text="p", ids=[tok.bos_id] + tok.encode("p"))
    s = Sample(
        prompt,
        0,
        ids,
        [-1.0] * len(ids),
        policy_version=0,
        finish_reason="stop",
        text=text,
        reward=res.reward,
        reward_heads={"exprl_process": res.reward},
        info=dict(res.info),
    )
    plain = Sample(
        prompt,
        0,
        ids[:4],
        [-1.0] * 4,
        policy_version=0,
        finish_reason="stop",
        reward=0.0,
        reward_heads={"exprl_process": 0.0},
    )
    assert add_segment_heads([s, plain], tok) == 1
    e0, e1 = len(one.encode()), len(two.encode())  # token (byte) ends, not character ends
    assert (s.reward_heads["exprl_e0"], s.reward_heads["exprl_e1"], s.reward_heads["exprl_e2"]) == (e0, e1, len(ids))
    assert s.reward == 0.5  # the heads came after the sum: the reward is still s_T
    view = sequence_view([s, plain])
    mask = view.mask
    out = exprl_segments(
        torch.ones(2, mask.shape[1]) * mask,
        mask,
        valid=view.ok.bool(),
        reward_heads=view.reward_heads,
        head_names=view.head_names,
    )
    assert out[0, : len(ids)].tolist() == [-0.25] * e0 + [0.5] * (e1 - e0) + [-0.25] * (len(ids) - e1)
    assert out[1, :4].tolist() == [1.0] * 4  # no segments: the incoming advantage


def test_exprl_config_keys() -> None:
    cfg = load_config(
        RLConfig, None, TINY + ["algorithm.advantage_shaping=[{name: exprl_segments, options: {norm: end}}]"]
    )
    validate_rl_config(cfg, 1)
    with pytest.raises(ConfigError, match=_literal("algorithm.advantage_shaping[0].options.norm: must be one of")):
        validate_rl_config(
            load_config(
                RLConfig, None, TINY + ["algorithm.advantage_shaping=[{name: exprl_segments, options: {norm: group}}]"]
            ),
            1,
        )


# ============================================================================ RLCER

from mcore_rl.algos.rlcer import (  # noqa: E402  (imported by the section that tests it)
    cot_rewards,
    parse_rubrics,
    pearson,
    reasoner_rewards,
    rlcer,
    rubric_validity,
    rubricator_reward,
)


def test_rlcer_constant_and_threshold_rubrics_are_invalid() -> None:
    """Property 1: a constant v_k is invalid; corr exactly α is invalid (strict >)."""
    z = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    assert not rubric_validity(torch.ones(1, 6), z).any() and not rubric_validity(torch.zeros(1, 6), z).any()
    # corr exactly 0.2 (in float64 too): invalid at the default α, valid just below it
    z2, v2 = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    assert float(pearson(v2, z2)) == 0.2
    assert not rubric_validity(v2, z2).any() and rubric_validity(v2, z2, alpha=0.2 - 1e-9).all()
    v = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    c = float(pearson(v, z))
    assert 0 < c < 1
    assert not rubric_validity(v, z, alpha=c).any()  # exactly the threshold: invalid
    assert rubric_validity(v, z, alpha=c - 1e-9).all()
    # Pearson, written out
    zc, vc = z.double() - z.double().mean(), v[0].double() - v[0].double().mean()
    assert abs(c - float((zc * vc).sum() / (zc.norm() * vc.norm()))) < 1e-12
    # a constant z (all right): corr undefined, no rubric valid
    assert not rubric_validity(torch.tensor([[1.0, 0.0, 1.0]]), torch.ones(3)).any()


def test_rlcer_four_rollout_toy() -> None:
    """Property 4: z = [1,1,0,0]; v = [1,1,0,0] valid (corr 1), [0,0,1,1] invalid (-1), [1,0,1,0] invalid (0)."""
    z = torch.tensor([1.0, 1.0, 0.0, 0.0])
    v = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(pearson(v, z), torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64))
    assert rubric_validity(v, z).tolist() == [True, False, False]


def test_rlcer_reasoner_reward_range_and_signed_rubrics() -> None:
    """Property 2: r_cot in [0, 1] so r^Rea in [-1, 2]; a satisfied negative-score valid rubric lowers the sum."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        n, k = 8, 5
        z = (torch.rand(n, generator=gen) < 0.5).double()
        v = (torch.rand(k, n, generator=gen) < 0.5).double()
        s = torch.randn(k, generator=gen) * 3
        r, valid = reasoner_rewards(z, v, s)
        cot = r - torch.where(z.bool(), 1.0, -1.0).double()
        assert cot.min() >= 0 and cot.max() <= 1 and r.min() >= -1 and r.max() <= 2
    # a valid rubric with a negative score: satisfying it lowers the pre-normalisation sum
    z = torch.tensor([1.0, 1.0, 0.0, 0.0])
    good = torch.tensor([1.0, 1.0, 0.0, 0.0])  # corr 1 with z
    v = torch.stack([good, good])
    raw = lambda scores: (v * scores[:, None]).sum(0)
    assert raw(torch.tensor([2.0, -1.0]))[0] < raw(torch.tensor([2.0, 0.0]))[0]
    r_pos, _ = reasoner_rewards(z, good[None], torch.tensor([2.0]))
    r_neg, _ = reasoner_rewards(z, good[None], torch.tensor([-2.0]))
    assert r_pos.tolist() == [2.0, 2.0, -1.0, -1.0] and r_neg.tolist() == [1.0, 1.0, 0.0, 0.0]
    # only valid rubrics count: an invalid one with a huge score changes nothing
    bad = torch.tensor([1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(
        cot_rewards(torch.stack([good, bad]), torch.tensor([1.0, 100.0]), torch.tensor([True, False])), good.double()
    )
    # RQ1's rubric-only variant: r^Rea = r_cot
    r, _ = reasoner_rewards(z, good[None], torch.tensor([2.0]), cot_only=True)
    assert r.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_rlcer_rubricator_reward_and_format() -> None:
    """Property 3: r^Rub in [0, 2]; zero valid rubrics with a correct format gives 1."""
    assert rubricator_reward([False, False, False], True) == 1.0
    assert rubricator_reward([True, False, True, True], True) == 1.75
    assert rubricator_reward([True, True], False) == 1.0 and rubricator_reward([], False) == 0.0
    for k in range(0, 6):
        for n_valid in range(0, k + 1):
            for fmt in (True, False):
                assert 0.0 <= rubricator_reward([True] * n_valid + [False] * (k - n_valid), fmt) <= 2.0
    rubrics, ok = parse_rubrics("1. (+2) Checks the answer by substitution\n\n2. (-1.5) Guesses without work\n")
    assert ok and rubrics == [("Checks the answer by substitution", 2.0), ("Guesses without work", -1.5)]
    assert not parse_rubrics("1. (+2) Checks it\nSome chatter")[1]
    assert not parse_rubrics("1. (+2) Checks it\n2. (1) checks it")[1]  # a duplicate rubric
    assert not parse_rubrics("")[1] and not parse_rubrics("1. Checks it (no score)")[1]


def _rlcer_heads(verdicts: list[list[float]], scores: list[float]):
    k = len(scores)
    names = tuple(sorted([f"rlcer_v{i}" for i in range(k)] + [f"rlcer_w{i}" for i in range(k)]))
    heads = torch.full((len(verdicts), len(names)), NAN)
    for row, vs in enumerate(verdicts):
        for i, (v, w) in enumerate(zip(vs, scores)):
            heads[row, names.index(f"rlcer_v{i}")] = v
            heads[row, names.index(f"rlcer_w{i}")] = w
    return heads, names


def test_rlcer_reward_shaping_per_group() -> None:
    # group 0: rubric 0 valid (tracks correctness), rubric 1 invalid; group 1: no rubric heads
    verdicts = [[1, 1], [1, 0], [0, 1], [0, 0]] + [[NAN, NAN]] * 4
    heads, names = _rlcer_heads(verdicts, [3.0, 5.0])
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    out = rlcer(rewards, gids, valid=torch.ones(8, dtype=torch.bool), reward_heads=heads, head_names=names)
    assert out[:4].tolist() == [2.0, 2.0, -1.0, -1.0]  # ±1 + minmax(3·v_0) — rubric 1 (corr 0) does not count
    assert out[4:].tolist() == [1.0, -1.0, -1.0, 1.0]  # no rubrics: the ±1 outcome
    # validity is per group: the same verdicts in a group where they do not track correctness
    out = rlcer(
        torch.tensor([0.0, 0.0, 1.0, 1.0]),
        torch.zeros(4, dtype=torch.long),
        valid=torch.ones(4, dtype=torch.bool),
        reward_heads=heads[:4],
        head_names=names,
    )
    assert out.tolist() == [-1.0, -1.0, 1.0, 1.0]
    # an invalid sample keeps its reward and is not in the group's statistics
    valid = torch.tensor([True, True, True, False] + [True] * 4)
    out = rlcer(rewards, gids, valid=valid, reward_heads=heads, head_names=names)
    assert out[3] == 0.0 and out[:3].tolist() == [2.0, 2.0, -1.0]
    assert option_problems("reward_shaping", "rlcer", {"alpha": 0.3, "cot_only": True}) == []
    assert option_problems("reward_shaping", "rlcer", {"alpha": 1.5})[0][0] == "alpha"


def test_rlcer_from_a_rubric_judge_to_the_reasoner_reward(tmp_path) -> None:
    """The scripted verifier judge gives per-rubric verdicts; add_rubric_heads turns them (and the
    label's signed scores) into heads; the sequence view and reward shaping 'rlcer' give r^Rea."""
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.rewards import RewardInput, RewardRunner
    from mcore_rl.rewards.judge import judge_reward_fn
    from mcore_rl.recipes.judge_heads import add_rubric_heads
    from mcore_rl.train.packing import sequence_view
    from tests.helpers import ScriptedJudge

    rubric = ["verifies the sum", "guesses"]
    label = {"answer": "4", "rubric": rubric, "rubric_scores": [2.0, -1.0]}
    texts = ["cot-A", "cot-B", "cot-C", "cot-D"]
    correct = [1.0, 1.0, 0.0, 0.0]
    rules = [
        [["verifies the sum", "cot-A"], "Verdict: yes"],
        [["verifies the sum", "cot-B"], "Verdict: yes"],
        [["verifies the sum"], "Verdict: no"],
        [["guesses", "cot-D"], "Verdict: yes"],
        [["guesses"], "Verdict: no"],
    ]
    judge = ScriptedJudge(tmp_path, rules)
    try:
        with RewardRunner(judge_reward_fn("rubric", url=judge.url), max_concurrency=4) as runner:
            results = runner.score_sync([RewardInput("2+2=", t, label) for t in texts])
    finally:
        judge.close()
    assert [r.info["verdicts"] for r in results] == [[1, 0], [1, 0], [0, 0], [0, 1]]
    prompt = Prompt(index=0, text="2+2=", ids=[1, 2], label=label)
    samples = [
        Sample(
            prompt,
            0,
            [5, 6],
            [-1.0, -1.0],
            policy_version=0,
            finish_reason="stop",
            text=t,
            reward=c,
            reward_heads={"correct": c, "rubric": r.reward},
            info=dict(r.info),
        )
        for t, c, r in zip(texts, correct, results)
    ]
    assert add_rubric_heads(samples) == 4 and [s.reward for s in samples] == correct
    view = sequence_view(samples)
    out = rlcer(
        view.rewards, view.group_ids, valid=view.ok.bool(), reward_heads=view.reward_heads, head_names=view.head_names
    )
    # rubric 0 tracks correctness (valid, +2), rubric 1 (only cot-D, wrong) has corr -0.58: invalid
    assert out.tolist() == [2.0, 2.0, -1.0, -1.0]


def test_rlcer_config_keys() -> None:
    validate_rl_config(
        load_config(
            RLConfig, None, TINY + ["algorithm.reward_shaping=[{name: rlcer, options: {alpha: 0.2, cot_only: false}}]"]
        ),
        1,
    )
    with pytest.raises(ConfigError, match=_literal("algorithm.reward_shaping[0].options.alpha: must be in [-1, 1)")):
        validate_rl_config(
            load_config(RLConfig, None, TINY + ["algorithm.reward_shaping=[{name: rlcer, options: {alpha: 2.0}}]"]), 1
        )


# ============================================================================ GRAPE

from mcore_rl.algos.grape import grape_scores, perplexity, select  # noqa: E402  (imported by the section that tests it)


def _grape_tool():
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "tools" / "grape_select.py"
    if "grape_select" not in sys.modules:
        spec = importlib.util.spec_from_file_location("grape_select", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["grape_select"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["grape_select"]


def test_grape_score_is_the_mean_log_prob_and_argmax_is_argmin_perplexity() -> None:
    """Property 1: Score = mean per-token log-prob; argmax Score = argmin perplexity."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        c, t = 6, 9
        lp = -torch.rand(c, t, generator=gen, dtype=torch.float64) * 4
        lengths = torch.randint(1, t + 1, (c,), generator=gen)
        mask = (torch.arange(t)[None] < lengths[:, None]).float()
        s = grape_scores(lp, mask)
        for i in range(c):
            assert abs(float(s[i]) - float(lp[i, : lengths[i]].mean())) < 1e-12
        ppl = torch.exp(-torch.stack([lp[i, : lengths[i]].mean() for i in range(c)]))
        torch.testing.assert_close(perplexity(s), ppl)
        assert int(select(s, torch.zeros(c, dtype=torch.long))[0]) == int(ppl.argmin())


def test_grape_length_normalisation() -> None:
    """Property 2: all tokens at -1 score -1 at any length; a long fluent response beats a short unlikely one."""
    for n in (1, 3, 50):
        assert float(grape_scores(torch.full((1, n), -1.0), torch.ones(1, n))[0]) == -1.0
    lp = torch.zeros(2, 40)
    lp[0] = -0.5  # long, fluent: sum -20
    lp[1, :2] = -3.0  # short, unlikely: sum -6
    mask = torch.zeros(2, 40)
    mask[0], mask[1, :2] = 1, 1
    s = grape_scores(lp, mask)
    assert int(select(s, torch.zeros(2, dtype=torch.long))[0]) == 0
    # negative control: the unnormalised sum would have kept the short one
    assert int((lp * mask).sum(1).argmax()) == 1


def test_grape_ties_reverse_and_groups() -> None:
    """Properties 3 (ties broken deterministically: the first) and 4 (Reverse-GRAPE keeps the argmin)."""
    s = torch.tensor([-1.0, -0.5, -0.5, -2.0, -0.3, float("nan"), -0.9, -0.9], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    assert select(s, g).tolist() == [1, 4, 6]
    assert select(s, g, reverse=True).tolist() == [3, 4, 6]
    assert select(torch.tensor([float("nan")] * 2), torch.zeros(2, dtype=torch.long)).tolist() == [-1]
    # reversed input: still the first of each tie in the order given (positions 5 of 5/6, 0 of 0/1)
    assert select(s.flip(0), g.flip(0)).tolist() == [5, 3, 0]
    assert all(select(s, g).tolist() == [1, 4, 6] for _ in range(3))  # the same every call


def test_grape_tool_scores_with_the_engine_and_the_reference_model_and_leaves_them_unchanged(tmp_path) -> None:
    """The tool on the demo model: the engine's prompt scoring and the reference model's forward
    agree, the kept row is the argmax of the mean log-prob, and no weight changes or gets a
    gradient (property 3)."""
    tool = _grape_tool()
    from mcore_rl.rollout.engine.core import EngineCore

    engine = EngineCore.from_model_path(None, context_length=256)
    tok = engine.tokenizer
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    rows = [
        {"prompt": "12+34=", "id": "a", "candidates": ["64", "46", {"response": "4600000", "source": "big"}]},
        {"prompt": "5+5=", "candidates": ["01", ""]},
    ]
    by_engine, _ = tool.grape_select(rows, tool.EngineScorer(engine), tok)
    ref = tool.ReferenceScorer(engine.model, 256)
    by_ref, empty = tool.grape_select(rows, ref, tok)
    assert empty == [] and [r["grape_index"] for r in by_engine] == [r["grape_index"] for r in by_ref]
    for a, b in zip(by_engine, by_ref):
        assert abs(a["grape_score"] - b["grape_score"]) < 1e-4
    # written out: the mean log-prob of each candidate under the model, the argmax kept
    for row, kept in zip(rows, by_ref):
        means = []
        for c in row["candidates"]:
            text = c if isinstance(c, str) else c["response"]
            p, r = tool.tokenize_pair(tok, row["prompt"], text)
            if not r:
                means.append(float("-inf"))
                continue
            with torch.no_grad():
                logits = engine.model(torch.tensor([p + r])).logits[0].double()
            lp = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(1, torch.tensor(r)[:, None])
            means.append(float(lp.mean()))
        assert kept["grape_index"] == max(range(len(means)), key=lambda j: (means[j], -j))
        assert abs(kept["grape_score"] - max(means)) < 1e-9
    assert by_ref[0]["id"] == "a" and by_ref[0]["prompt"] == "12+34=" and "candidates" not in by_ref[0]
    rev, _ = tool.grape_select(rows, ref, tok, reverse=True)
    assert rev[0]["grape_score"] <= by_ref[0]["grape_score"]
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in engine.model.parameters())
    # the command: a jsonl in, the kept SFT rows out
    src, dst = tmp_path / "cands.jsonl", tmp_path / "kept.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert tool.main([str(src), str(dst), "--scorer", "reference", "--context-length", "256"]) == 0
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [(o["prompt"], o["response"]) for o in out] == [(r["prompt"], r["response"]) for r in by_ref]


# ============================================================================ the learner (one spawned world)

LEARNER_OPTIONS = [
    "algorithm.sample_filters=[{name: prof_grpo, options: {keep: 4, variant: both, step_penalty: 0.1,"
    " steps_head: prm_steps}}]",
    "algorithm.reward_shaping=[{name: rlcer}]",
    "algorithm.advantage_shaping=[{name: exprl_segments}]",
    "algorithm.num_minibatches=1",
    "train.micro_batch_size=2",
    "init.sft_steps=0",
    "rollout.group_size=6",
]


def _learner_samples(tokenizer) -> list:
    """Two prompts, six samples each: 0/1 outcome, PRM heads (weight-0 style: not in the reward),
    one RLCER rubric per group, ExpRL segment heads on some samples."""
    import random

    from mcore_rl.data.samples import Prompt, Sample

    rng = random.Random(3)
    out = []
    for g in range(2):
        prompt = Prompt(index=g, text=f"{g}+1=", ids=[tokenizer.bos_id] + tokenizer.encode(f"{g}+1="))
        for i in range(6):
            correct = float(i % 2 == 0)
            heads = {
                "correct": correct,
                "prm": round(rng.random(), 3),
                "prm_steps": float(rng.choice([1, 4, 7])),
                "rlcer_v0": float(correct if i < 4 else 1 - correct),
                "rlcer_w0": 2.0,
            }
            if i in (1, 2, 4):
                s = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]) for _ in range(2)]
                heads.update(segment_heads(s, [2, 6]))
            rsp = [rng.randrange(3, 60) for _ in range(6)]
            out.append(
                Sample(
                    prompt,
                    g,
                    rsp,
                    [-1.0] * 6,
                    policy_version=0,
                    finish_reason="stop",
                    reward=correct,
                    reward_heads=heads,
                )
            )
    return out


def _learner_world(rank: int, world_size: int) -> None:
    from mcore_rl.config import validate_rl_config
    from mcore_rl.train.packing import sequence_view
    from mcore_rl.train.policy import build_policy
    from mcore_rl.train.rl_step import Learner
    from tests.helpers import tiny

    cfg = tiny(*LEARNER_OPTIONS)
    policy = build_policy(cfg, validate_rl_config, total_iters=2)
    learner = Learner(cfg, policy.chunks, policy.optimizer, None, policy.tokenizer.pad_id)
    samples = _learner_samples(policy.tokenizer)
    per_seq, metrics = learner.prepare(samples)

    v = sequence_view(samples)
    common = dict(domain_ids=v.domain_ids, reward_heads=v.reward_heads, head_names=v.head_names)
    lengths = v.mask.sum(1).long()
    keep = prof_grpo(
        v.rewards,
        v.group_ids,
        valid=v.ok.bool(),
        lengths=lengths,
        keep=4,
        variant="both",
        step_penalty=0.1,
        steps_head="prm_steps",
        **common,
    )
    assert int(keep.sum()) == 8 and metrics["filter/prof_grpo/dropped_frac"] == 4 / 12
    r = rlcer(v.rewards, v.group_ids, valid=keep, lengths=lengths, **common)
    adv = grpo(r, v.group_ids, normalize_std=True, valid=keep, **common)
    mask = v.mask * keep[:, None]
    want = exprl_segments(adv[:, None].float() * mask, mask, valid=keep, **common) * mask
    got = per_seq["advantages"]
    torch.testing.assert_close(got, want.float())
    assert bool((got[~keep] == 0).all())
    seg = [i for i in range(12) if "exprl_s0" in samples[i].reward_heads and keep[i]]
    assert seg, "no segmented sample survived the filter"
    for i in seg:  # the raw deltas, not the GRPO advantage
        s0, s1 = samples[i].reward_heads["exprl_s0"], samples[i].reward_heads["exprl_s1"]
        assert got[i, :2].tolist() == [s0 - s1] * 2 and got[i, 2:6].tolist() == [s1 - s0] * 4
    records, _ = learner.train(samples, 0)
    assert len(records) == 1 and torch.isfinite(torch.tensor(records[0]["train/loss"]))


@pytest.mark.slow
def test_learner_with_prof_filter_rlcer_reward_and_exprl_segments() -> None:
    from tests.world import run_world

    run_world(1, _learner_world)


def test_grape_tool_over_a_real_mcore_rl_serve(tmp_path) -> None:
    """The url scorer: SGLang's prompt-scoring request to a real `mcore-rl serve` of the demo model
    (dummy weights, the same seed as the in-process engine) gives the in-process engine's scores."""
    tool = _grape_tool()
    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.engine_processes import EngineProcesses

    rows = [{"prompt": "12+34=", "candidates": ["64", "46", "4600000"]}, {"prompt": "5+5=", "candidates": ["01", "1"]}]
    local = EngineCore.from_model_path(None, context_length=256)
    want, _ = tool.grape_select(rows, tool.EngineScorer(local), local.tokenizer)
    engines = EngineProcesses.start(
        ModelConfig(),
        num=1,
        workdir=str(tmp_path),
        seed=0,
        context_length=256,
        max_running_requests=4,
        threads=1,
        api_key="k",
        startup_timeout_s=120,
    )
    try:
        scorer, tok = tool.build_scorer("url", None, None, engines.urls[0], 256, api_key="k")
        got, empty = tool.grape_select(rows, scorer, tok)
    finally:
        engines.close()
    assert empty == [] and [g["grape_index"] for g in got] == [w["grape_index"] for w in want]
    for g, w in zip(got, want):
        assert abs(g["grape_score"] - w["grape_score"]) < 1e-4
