"""DSpark's confidence-scheduled verification (`rollout/engine/spec_schedule.py`, `EngineCore._schedule`).

The greedy alone: DSpark's testable properties (prefix-closed admissions; constant SPS admits every
draft, SPS = C/B with every a < 1 admits none), more confident requests get longer drafts and larger
batches shorter ones, and under a linear cost the greedy's throughput equals an exhaustive search's.
Then the engine: with a constant SPS the schedule verifies what the fixed k does (the same seeded
tokens); with a cost that cuts drafts, greedy decoding stays plain decoding token for token and the
sampled joint stays plain sampling's exact one — while a cut that reads the drafted token's own
probability (what the confidence must not do) is caught by the same test.
"""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

from mcore_rl.rollout.engine.core import EngineCore, Request
from mcore_rl.rollout.engine.drafts import Draft
from mcore_rl.rollout.engine.sampling import SamplingParams
from mcore_rl.rollout.engine.spec_schedule import StepCost, prefix_survival, schedule_lengths
from mcore_rl.rollout.engine.speculative import SpeculativeSettings
from mcore_rl.rollout.launch_flags import LaunchFlagError, parse_server_args
from tests.helpers import make_engine, rl, rl_errors, run, tiny_model
from tests.test_speculative import (
    JOINT_PROMPT,
    JOINT_SP,
    JOINT_TOKENS,
    JOINT_VOCAB,
    _greedy_requests,
    chi_square_pvalue,
    exact_joint,
    near_draft,
    plain_greedy,
)


def linear(t0: float, t1: float):
    return lambda b: 1.0 / (t0 + t1 * b)


def throughput(survival: list[list[float]], lengths: list[int], sps) -> float:
    tau = sum(1 + sum(row[:n]) for row, n in zip(survival, lengths))
    return tau * sps(sum(1 + n for n in lengths))


def test_prefix_survival_is_the_running_product() -> None:
    assert prefix_survival([0.5, 0.5, 2.0, -1.0]) == [0.5, 0.25, 0.25, 0.0]


def test_boundary_cases() -> None:
    """Constant SPS: every draft with a > 0 is admitted (the fixed k); SPS = C/B and every a < 1: none."""
    survival = [prefix_survival([0.9, 0.5, 0.2]), prefix_survival([0.1] * 4), []]
    assert schedule_lengths(survival, lambda b: 3.0) == [3, 4, 0]
    assert schedule_lengths(survival, lambda b: 7.0 / b) == [0, 0, 0]


def test_more_confident_requests_get_longer_drafts() -> None:
    sps = linear(1.0, 0.2)
    lengths = [schedule_lengths([prefix_survival([c] * 6)], sps)[0] for c in (0.2, 0.5, 0.7, 0.9, 0.99)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    # within one batch: the confident request verifies more than the doubtful one
    mixed = schedule_lengths([prefix_survival([0.95] * 6), prefix_survival([0.4] * 6)], sps)
    assert mixed[0] > mixed[1]


def test_larger_batches_get_shorter_drafts() -> None:
    """A pass costs t0 + t1 B: at batch 1 the fixed cost dominates and drafts are nearly free, at
    batch 64 another position costs about what another token is worth."""
    sps = linear(1.0, 0.02)
    per_request = []
    for batch in (1, 4, 16, 64):
        lengths = schedule_lengths([prefix_survival([0.8] * 8)] * batch, sps)
        per_request.append(sum(lengths) / batch)
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] == 8 and per_request[-1] <= 1


def test_admissions_are_prefix_closed_and_optimal_under_a_linear_cost() -> None:
    """Random confidences (with ties: c = 1) and batches of 1-3: the admitted set is a prefix of
    each request's drafts, and its throughput is the best of every combination of prefixes."""
    rng = random.Random(0)
    for _ in range(300):
        batch = rng.randint(1, 3)
        survival = [
            prefix_survival([rng.choice([1.0, rng.random()]) for _ in range(rng.randint(0, 4))]) for _ in range(batch)
        ]
        sps = linear(rng.uniform(0.1, 2.0), rng.uniform(0.0, 1.0))
        lengths = schedule_lengths(survival, sps)
        assert all(0 <= n <= len(row) for n, row in zip(lengths, survival))
        best = max(
            throughput(survival, list(choice), sps)
            for choice in itertools.product(*[range(len(row) + 1) for row in survival])
        )
        assert throughput(survival, lengths, sps) == pytest.approx(best, rel=1e-12)


def test_step_cost_fits_the_measured_line() -> None:
    cost = StepCost()
    cost.observe(4, 0.5)
    assert cost.sps() is None  # one batch size: no slope yet
    cost.observe(4, 0.5)
    assert cost.sps() is None
    for b in (1, 8, 16, 32, 64):
        cost.observe(b, 0.3 + 0.05 * b)
    assert cost.line() == pytest.approx((0.3, 0.05))
    sps = cost.sps()
    assert sps is not None and sps(10) == pytest.approx(1 / 0.8)
    flat = StepCost()
    for b, t in [(1, 0.5), (64, 0.4)]:  # noise that falls with B: extra positions look free
        flat.observe(b, t)
    assert flat.line() == pytest.approx((0.45, 0.0))


DSPARK = SpeculativeSettings("STANDALONE", num_steps=3, schedule="dspark")
FIXED = SpeculativeSettings("STANDALONE", num_steps=3)


def _sampled_requests() -> list[Request]:
    prompts = [[5, 6, 7, 8, 5, 6, 7], [1, 2, 3], [9, 9, 9, 9], [100, 7, 100, 7]]
    return [
        Request(f"s{i}", p, SamplingParams(temperature=1.0, top_k=20, max_new_tokens=20, ignore_eos=True, seed=i))
        for i, p in enumerate(prompts)
    ]


def test_constant_cost_verifies_what_the_fixed_k_does() -> None:
    """Constant SPS admits every draft: the same seeded tokens and counters as the fixed schedule."""
    fixed = make_engine(tiny_model(), speculative=FIXED, draft_model=near_draft(0.2))
    scheduled = make_engine(tiny_model(), speculative=copy.copy(DSPARK), draft_model=near_draft(0.2))
    scheduled.schedule_sps = lambda b: 1.0
    want, got = run(fixed, _sampled_requests()), run(scheduled, _sampled_requests())
    assert {r: o.output_ids for r, o in got.items()} == {r: o.output_ids for r, o in want.items()}
    assert scheduled.spec_stats["cut"] == 0
    assert {k: v for k, v in scheduled.spec_stats.items() if k != "cut"} == {
        k: v for k, v in fixed.spec_stats.items() if k != "cut"
    }
    assert 0 < fixed.spec_stats["accepted"] < fixed.spec_stats["drafted"]


@pytest.mark.parametrize("stagger", [0, 2])
def test_cut_drafts_keep_greedy_plain(stagger: int) -> None:
    """A cost under which extra positions are dear: drafts are cut, tokens and log-probs stay plain."""
    engine = make_engine(tiny_model(), speculative=copy.copy(DSPARK), draft_model=near_draft())
    engine.schedule_sps = linear(1.0, 0.1)
    outs = run(engine, _greedy_requests(), stagger=stagger)
    assert engine.spec_stats["cut"] > 0 and engine.spec_stats["accepted"] > 0
    for rid, want in plain_greedy().items():
        assert outs[rid].output_ids == want.output_ids and outs[rid].finish_reason == want.finish_reason
        for (a, _), (b, _) in zip(outs[rid].output_token_logprobs, want.output_token_logprobs):
            assert a == pytest.approx(b, abs=1e-5)


def _joint_pvalue(engine: EngineCore, n: int = 2000) -> float:
    model = tiny_model(vocab_size=JOINT_VOCAB)
    joint = exact_joint(model, JOINT_PROMPT, SamplingParams(**JOINT_SP), JOINT_TOKENS)
    outs = run(engine, [Request(f"r{i}", JOINT_PROMPT, SamplingParams(**JOINT_SP, seed=i)) for i in range(n)])
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1)
    for o in outs.values():
        counts[index.get(tuple(o.output_ids), len(cells))] += 1
    return chi_square_pvalue(counts, torch.tensor([joint[c] for c in cells] + [0.0]))


def _noisy(model, noise: float):
    """The target's weights plus noise: a draft accepted often, not always."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return model


def _joint_engine() -> EngineCore:
    engine = make_engine(
        tiny_model(vocab_size=JOINT_VOCAB),
        max_running_requests=64,
        speculative=copy.copy(DSPARK),
        draft_model=_noisy(tiny_model(vocab_size=JOINT_VOCAB), 0.02),
    )
    # one pass's cost grows with its positions: confident requests verify more than doubtful ones
    engine.schedule_sps = linear(1.0, 0.01)
    return engine


def test_scheduled_sampling_is_exact() -> None:
    """2,000 seeded requests of four tokens: with drafts cut by confidence, the joint is plain sampling's."""
    engine = _joint_engine()
    assert _joint_pvalue(engine) > 1e-3
    stats = engine.spec_stats
    assert stats["cut"] > 500 and stats["drafted"] > 500 and 0 < stats["accepted"] < stats["drafted"]


def test_a_cut_that_reads_the_drafted_token_is_caught() -> None:
    """The control: verify a draft only while the draft model gave its own token probability > 0.5 —
    the choice then depends on the token it keeps, and the joint test fails."""
    engine = _joint_engine()

    def biased(batch, drafts, feats=None):
        cut = []
        for d in drafts:
            n = 0
            while n < len(d.tokens) and d.probs is not None and float(d.probs[n, d.tokens[n]] / d.probs[n].sum()) > 0.5:
                n += 1
            cut.append(Draft(d.tokens[:n], d.probs[:n] if d.probs is not None and n else None))
        return cut

    engine._schedule = biased  # type: ignore[method-assign]
    assert _joint_pvalue(engine) < 1e-6


def test_keys_and_flags() -> None:
    cfg = rl("rollout.speculative_algorithm=ngram", "rollout.speculative_schedule=dspark")
    from mcore_rl.rollout.pool import speculative_flags, speculative_settings

    assert speculative_flags(cfg.rollout)[-2:] == ["--speculative-schedule", "dspark"]
    settings = speculative_settings(cfg.rollout)
    assert settings is not None and settings.schedule == "dspark"
    assert any(
        e.startswith("rollout.speculative_schedule: is dspark but rollout.speculative_algorithm is none")
        for e in rl_errors(rl("rollout.speculative_schedule=dspark"))
    )
    with pytest.raises(Exception, match="speculative_schedule"):
        rl("rollout.speculative_algorithm=ngram", "rollout.speculative_schedule=adaptive")
    args = parse_server_args(["--speculative-algorithm", "NGRAM", "--speculative-schedule", "dspark"])
    assert args.engine_kwargs()["speculative"].schedule == "dspark"
    with pytest.raises(LaunchFlagError, match="^--speculative-schedule often: choose fixed or dspark"):
        parse_server_args(["--speculative-algorithm", "NGRAM", "--speculative-schedule", "often"])
    with pytest.raises(ValueError, match="^speculative_schedule: 'x' is not one of"):
        SpeculativeSettings("NGRAM", schedule="x").check()
