"""Filters, judges and rubrics: PROF-GRPO (seed_C), ExpRL-Process's segment advantages (seed_B), RLCER's
rubric rewards (seed_C) and GRAPE's candidate selection (seed_A) — each testable property of their
specs, their config keys and the errors of bad option values. Pure: no megatron."""

from __future__ import annotations

import re

import pytest
import torch

from mcore_rl import algos
from mcore_rl.algos.advantages import grpo
from mcore_rl.algos.multi_reward import option_problems
from mcore_rl.algos.prof_grpo import balanced_counts, consistency, prof_grpo
from mcore_rl.config import ConfigError, RLConfig, load_config, validate_rl_config

TINY = ["model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_layers=2", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.max_position_embeddings=64", "train.seq_length=32",
        "data.synthetic_max_digits=1", "rollout.group_size=4", "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=4", "rollout.context_length=64"]


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
    return prof_grpo(rewards, gids, valid=torch.ones(len(rewards), dtype=torch.bool), reward_heads=heads,
                     head_names=HEADS, **options)


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
    # negative control: the notes' literal "lowest r^pro" would have kept 0.8, 0.6, 0.5 instead
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
    both = [_call(*_prof_batch(correct, prm[:4] + list(reversed(prm[4:]))), keep=8, variant="both"),
            _call(*_prof_batch(correct, prm), keep=8, variant="both")]
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
    keep = _call(*_prof_batch([1, 1, 0, 0, 0], [0.9, 0.8, 0.1, 0.2, 0.3], steps=[1, 5, 5, 5, 5]),
                 keep=2, variant="both", step_penalty=0.5)
    assert keep.tolist() == [False, True, True, False, False]
    keep = _call(*_prof_batch([1, 1, 0, 0, 0], [0.9, 0.8, 0.1, 0.2, 0.3], steps=[1, 5, 5, 5, 5]),
                 keep=2, variant="both", step_penalty=0.0)
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
    keep = prof_grpo(r, g, valid=torch.ones(8, dtype=torch.bool), reward_heads=torch.zeros(8, 0), head_names=(),
                     keep=4)
    assert int(keep.sum()) == 4 and int(keep[:4].sum()) == 2


def test_prof_options_and_config_keys() -> None:
    assert "prof_grpo" in algos.names("sample_filter")
    assert option_problems("sample_filter", "prof_grpo", {"keep": 4, "variant": "both", "step_penalty": 0.1}) == []
    assert option_problems("sample_filter", "prof_grpo", {"variant": "neg"})[0][0] == "variant"
    assert option_problems("sample_filter", "prof_grpo", {"keep": 0})[0][0] == "keep"
    cfg = load_config(RLConfig, None, TINY + [
        "rollout.group_size=8", "algorithm.sample_filters=[{name: prof_grpo, options: {keep: 4, variant: both}}]"])
    validate_rl_config(cfg, 1)
    assert cfg.algorithm.sample_filters[0].options == {"keep": 4, "variant": "both"}
    for override, message in [
        ("algorithm.sample_filters=[{name: prof_grpo, options: {variant: neg}}]",
         "algorithm.sample_filters[0].options.variant: must be one of pos, both"),
        ("algorithm.sample_filters=[{name: prof_grpo, options: {step_penalty: -1.0}}]",
         "algorithm.sample_filters[0].options.step_penalty: must be >= 0"),
        ("algorithm.sample_filters=[{name: prof_grpo, options: {m: 4}}]",
         "algorithm.sample_filters[0].options.m: is not an option"),
    ]:
        with pytest.raises(ConfigError, match=_literal(message)):
            validate_rl_config(load_config(RLConfig, None, TINY + [override]), 1)


# ============================================================================ ExpRL-Process

from mcore_rl.algos.exprl import exprl_segments, segment_deltas, segment_heads, spread_segments  # noqa: E402

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
    return exprl_segments(adv_seq[:, None] * mask, mask, rewards=torch.zeros(n),
                          group_ids=torch.zeros(n, dtype=torch.long),
                          valid=valid if valid is not None else torch.ones(n, dtype=torch.bool),
                          domain_ids=torch.zeros(n, dtype=torch.long), reward_heads=heads, head_names=names,
                          entropy=torch.zeros_like(mask), old_logp=torch.zeros_like(mask),
                          rollout_logp=torch.zeros_like(mask), ref_logp=None, **options)


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
    from mcore_rl.runtime.segment_heads import add_segment_heads
    from mcore_rl.train.packing import sequence_view
    from tests.test_judges import ScriptedJudge

    one, two = "étape un ###", "étape un ### step two ###"
    text = two + " answer 8"
    rules = [[f"[Attempt]\n{one}\n", "Score: 2"], [f"[Attempt]\n{two}\n", "Score: 4"],
             [f"[Attempt]\n{text}\n", "Score: 3"]]
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
    s = Sample(prompt, 0, ids, [-1.0] * len(ids), policy_version=0, finish_reason="stop", text=text,
               reward=res.reward, reward_heads={"exprl_process": res.reward}, info=dict(res.info))
    plain = Sample(prompt, 0, ids[:4], [-1.0] * 4, policy_version=0, finish_reason="stop", reward=0.0,
                   reward_heads={"exprl_process": 0.0})
    assert add_segment_heads([s, plain], tok) == 1
    e0, e1 = len(one.encode()), len(two.encode())  # token (byte) ends, not character ends
    assert (s.reward_heads["exprl_e0"], s.reward_heads["exprl_e1"], s.reward_heads["exprl_e2"]) == (e0, e1, len(ids))
    assert s.reward == 0.5  # the heads came after the sum: the reward is still s_T
    view = sequence_view([s, plain])
    mask = view.mask
    out = exprl_segments(torch.ones(2, mask.shape[1]) * mask, mask, valid=view.ok.bool(),
                         reward_heads=view.reward_heads, head_names=view.head_names)
    assert out[0, :len(ids)].tolist() == [-0.25] * e0 + [0.5] * (e1 - e0) + [-0.25] * (len(ids) - e1)
    assert out[1, :4].tolist() == [1.0] * 4  # no segments: the incoming advantage


def test_exprl_config_keys() -> None:
    cfg = load_config(RLConfig, None, TINY + [
        "algorithm.advantage_shaping=[{name: exprl_segments, options: {norm: end}}]"])
    validate_rl_config(cfg, 1)
    with pytest.raises(ConfigError, match=_literal("algorithm.advantage_shaping[0].options.norm: must be one of")):
        validate_rl_config(load_config(RLConfig, None, TINY + [
            "algorithm.advantage_shaping=[{name: exprl_segments, options: {norm: group}}]"]), 1)
