"""DSpark's trained confidence head (`rollout/engine/spec_confidence.py`) and the schedule reading it.

The fit recovers a known logistic model from soft labels and STS a known temperature; the
calibration measure tells a calibrated predictor from a miscalibrated one; the engine's logged soft
labels (sum min(p, q)) are the acceptance probabilities (their mean matches the observed rate, and
greedy rows' equal the outcome); a head drives the schedule (confident: nothing cut; doubtful:
everything cut but exploration; falling with the position: at most one draft per request); with a
head that reads q and the position, 2,000 seeded requests still give plain sampling's exact joint.
Then the key and the flag.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from mcore_rl.rollout.engine.core import Request
from mcore_rl.rollout.engine.sampling import SamplingParams
from mcore_rl.rollout.engine.spec_confidence import (
    FEATURES,
    ConfidenceHead,
    calibration,
    draft_features,
    fit,
    fit_temperatures,
    stack_log,
)
from mcore_rl.rollout.engine.speculative import SpeculativeSettings
from mcore_rl.rollout.launch_flags import LaunchFlagError, parse_server_args
from tests.helpers import make_engine, rl, rl_errors, run, tiny_model
from tests.test_spec_schedule import DSPARK, FIXED, _joint_engine, _joint_pvalue, _sampled_requests, linear
from tests.test_speculative import near_draft


def _synthetic(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, len(FEATURES))
    x[:, 0] = 1.0
    x[:, 1] = torch.log(torch.randint(1, 5, (n,), generator=g).float())
    x[:, 2] = torch.randn(n, generator=g)
    x[:, 3] = torch.rand(n, generator=g)
    x[:, 4] = torch.rand(n, generator=g)
    x[:, 5] = torch.randint(0, 4, (n,), generator=g).float()
    return x, torch.tensor([0.5, -1.0, 0.8, 2.0, -1.5, 0.3])


def test_features_read_q_and_the_past_only() -> None:
    q = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), -1)
    f = draft_features(q, 3, 0.75, 0)
    assert f.shape == (3, len(FEATURES))
    assert f[:, 1].exp().round().tolist() == [1.0, 2.0, 3.0]
    assert f[0, 2].item() == pytest.approx(math.log(3.0))
    assert f[:, 3].tolist() == pytest.approx(q.max(-1).values.tolist())
    assert 0 < f[0, 4].item() < 1
    point = draft_features(None, 2, 0.5, 3)
    assert point[:, 3:5].abs().sum() == 0 and point[:, 5].tolist() == [3.0, 3.0]
    assert draft_features(None, 0, 0.5, 0).shape == (0, len(FEATURES))


def test_fit_recovers_a_known_logistic_model_and_sts_a_known_temperature() -> None:
    x, w = _synthetic(4000)
    soft = torch.sigmoid(x.double() @ w.double())
    head = fit(x, soft, l2=0.0)
    assert head.weights == pytest.approx(w.tolist(), abs=2e-2)
    flat = ConfidenceHead([v / 2 for v in w.tolist()])  # logits halved: STS must find T = 1/2
    sts = fit_temperatures(flat, x, soft, positions=4)
    assert sts.temperatures == pytest.approx([0.5] * 4, rel=0.06)
    assert sts.predict_rows(x).tolist() == pytest.approx(soft.tolist(), abs=0.02)


def test_calibration_tells_calibrated_from_miscalibrated() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.rand(20000, generator=g, dtype=torch.float64)
    y = (torch.rand(20000, generator=g, dtype=torch.float64) < p).double()
    good = calibration(p, y, p)
    bad = calibration(torch.full_like(p, 0.9), y, p)
    assert good.ece < 0.02 and bad.ece > 0.35
    assert good.brier < bad.brier and good.log_loss < bad.log_loss
    assert sum(k for *_, k in good.bins) == 20000


def test_logged_soft_labels_are_the_acceptance_probabilities() -> None:
    engine = make_engine(tiny_model(), speculative=copy.copy(FIXED), draft_model=near_draft(0.2))
    engine.spec_log = []
    reqs = [
        Request(f"s{i}", [5, 6, 7, 8, 5, 6, 7][: 3 + i % 5], SamplingParams(temperature=1.0, max_new_tokens=24, seed=i))
        for i in range(24)
    ]
    run(engine, reqs)
    x, y, soft = stack_log(engine.spec_log)
    assert len(y) == engine.spec_acceptance.reached and len(y) > 300  # every reached draft, once
    assert 0 < float(y.mean()) < 1 and bool(((soft >= 0) & (soft <= 1)).all())
    se = math.sqrt(float(soft.mean()) * (1 - float(soft.mean())) / len(y))
    assert abs(float(y.mean()) - float(soft.mean())) < 4 * se
    assert bool((x[:, 3] > 0).all())  # a model draft: q's largest probability is a feature
    greedy = make_engine(tiny_model(), speculative=copy.copy(FIXED), draft_model=near_draft())
    greedy.spec_log = []
    run(
        greedy,
        [Request(f"g{i}", [5, 6, 7, 8][: 1 + i], SamplingParams(temperature=0.0, max_new_tokens=16)) for i in range(4)],
    )
    _, gy, gsoft = stack_log(greedy.spec_log)
    assert gy.tolist() == gsoft.tolist() and 0 < float(gy.mean()) < 1


def _scheduled(head: ConfidenceHead):
    engine = make_engine(tiny_model(), speculative=copy.copy(DSPARK), draft_model=near_draft(0.2))
    engine.confidence_head = head
    engine.schedule_sps = linear(1.0, 0.1)  # a position costs a tenth of a pass
    run(engine, _sampled_requests())
    return engine.spec_stats


def _bias(b: float, position: float = 0.0) -> ConfidenceHead:
    return ConfidenceHead([b, position, 0.0, 0.0, 0.0, 0.0])


def test_the_head_drives_the_schedule() -> None:
    confident, doubtful, falling = _scheduled(_bias(6.0)), _scheduled(_bias(-6.0)), _scheduled(_bias(5.0, -10.0))
    assert confident["cut"] == 0 and confident["drafted"] > 20
    assert doubtful["cut"] > 5 * doubtful["drafted"] > 0  # only the exploration's single drafts
    assert falling["drafted"] <= falling["rows_verified"] and falling["cut"] > 0 and falling["drafted"] > 10


def test_scheduled_sampling_with_a_head_is_exact() -> None:
    """2,000 seeded requests of four tokens: drafts cut by a head that reads q's shape and the position
    (never the drafted token) keep plain sampling's joint. (The control — a cut reading q(x) of the
    drafted token — is tests/test_spec_schedule.py's.)"""
    engine = _joint_engine()
    engine.confidence_head = ConfidenceHead([-2.0, -1.0, 0.0, 4.0, -2.0, 0.0])
    assert _joint_pvalue(engine) > 1e-3
    stats = engine.spec_stats
    assert stats["cut"] > 500 and stats["drafted"] > 500 and 0 < stats["accepted"] < stats["drafted"]


def test_load_save_key_and_flag(tmp_path) -> None:
    path = str(tmp_path / "head.json")
    ConfidenceHead([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [1.0, 2.0]).save(path)
    loaded = ConfidenceHead.load(path)
    assert loaded.weights == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6] and loaded.temperatures == [1.0, 2.0]
    bad = str(tmp_path / "bad.json")
    with open(bad, "w") as f:
        json.dump({"features": ["bias"], "weights": [1.0]}, f)
    with pytest.raises(ValueError, match="^speculative_confidence_head: .* was trained on features"):
        ConfidenceHead.load(bad)

    cfg = rl(
        "rollout.speculative_algorithm=ngram",
        "rollout.speculative_schedule=dspark",
        f"rollout.speculative_confidence_head={path}",
    )
    from mcore_rl.rollout.pool import speculative_flags, speculative_settings

    assert speculative_flags(cfg.rollout)[-2:] == ["--speculative-confidence-head", path]
    settings = speculative_settings(cfg.rollout)
    assert settings is not None and settings.confidence_head == path
    engine = make_engine(tiny_model(), speculative=settings)
    assert engine.confidence_head is not None and engine.confidence_head.temperatures == [1.0, 2.0]
    errors = rl_errors(rl("rollout.speculative_algorithm=ngram", f"rollout.speculative_confidence_head={path}"))
    assert (
        "rollout.speculative_confidence_head: is set but rollout.speculative_schedule is fixed (only dspark reads it)"
        in errors
    )
    errors = rl_errors(
        rl(
            "rollout.speculative_algorithm=ngram",
            "rollout.speculative_schedule=dspark",
            f"rollout.speculative_confidence_head={bad}",
        )
    )
    assert any(e.startswith("rollout.speculative_confidence_head: cannot be loaded: ") for e in errors)
    assert any(
        e.startswith("rollout.speculative_confidence_head: is set but rollout.speculative_algorithm is none")
        for e in rl_errors(rl(f"rollout.speculative_confidence_head={path}"))
    )
    args = parse_server_args(
        ["--speculative-algorithm", "NGRAM", "--speculative-schedule", "dspark", "--speculative-confidence-head", path]
    )
    assert args.engine_kwargs()["speculative"].confidence_head == path
    with pytest.raises(LaunchFlagError, match="^--speculative-confidence-head: needs --speculative-schedule dspark"):
        parse_server_args(["--speculative-algorithm", "NGRAM", "--speculative-confidence-head", path])
    with pytest.raises(ValueError, match="^speculative_confidence_head: is set but speculative_schedule is 'fixed'"):
        SpeculativeSettings("NGRAM", confidence_head=path).check()
