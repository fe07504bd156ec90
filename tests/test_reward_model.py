"""Reward models on megatron-core: the value head in parallel layouts against a pure-torch reference,
training, held-out accuracy, checkpoints and resume; the losses; the data's bad lines; the command.

One spawned 2-rank gloo world runs every multi-rank check (`_world`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from mcore_rl.algos.beta_prm import beta_prm_loss
from mcore_rl.algos.z_reward import (
    expected_score,
    pairwise_loss,
    pairwise_reward,
    pointwise_ce,
    pointwise_reward,
    risd_loss,
    score_bins,
    score_distribution,
)
from mcore_rl.algos.reward_model import binary_correct, bradley_terry_loss, pair_correct, pointwise_binary_loss
from mcore_rl.config import load_config
from mcore_rl.config.errors import ConfigError
from mcore_rl.config.rm_schema import RMConfig
from mcore_rl.config.rm_validate import validate_rm_config
from mcore_rl.config.schema import ModelConfig
from mcore_rl.data.files import DataError
from mcore_rl.data.preferences import read_preference_file, task_pairs
from mcore_rl.data.tasks import get_task
from tests.helpers import ROOT, P, _assert_same_checkpoint, _randomize
from tests.world import run_world

MC = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, vocab_size=128)
HEADS, SEQ, PAIRS, MICROBATCHES = 2, 12, 2, 4


# ---- the losses ---------------------------------------------------------------------------------


def test_bradley_terry_margin_and_ties():
    chosen = torch.tensor([2.0, 0.5, 1.0, -1.0])
    rejected = torch.tensor([0.0, 0.5, 3.0, -1.0])
    plain = bradley_terry_loss(chosen, rejected)
    torch.testing.assert_close(plain, -torch.nn.functional.logsigmoid(chosen - rejected))
    margin = torch.tensor([1.0, 0.0, 0.0, 2.0])
    with_margin = bradley_terry_loss(chosen, rejected, margin)
    assert with_margin[0] > plain[0] and with_margin[3] > plain[3]  # a margin asks for a larger gap
    tie = torch.tensor([False, True, True, True])
    tied = bradley_terry_loss(chosen, rejected, margin, tie)
    assert tied[0] == with_margin[0]
    assert math.isclose(float(tied[1]), math.log(2), rel_tol=1e-6)  # equal scores: the tie's minimum
    assert math.isclose(float(tied[3]), math.log(2), rel_tol=1e-6)  # a tie ignores its margin
    assert tied[2] > math.log(2)
    # the tie's gradient pulls the scores together, from either side
    c = torch.tensor([3.0, -3.0], requires_grad=True)
    bradley_terry_loss(c, torch.zeros(2), tie=torch.tensor([True, True])).sum().backward()
    assert c.grad[0] > 0 and c.grad[1] < 0
    assert pair_correct(chosen, rejected, tie).tolist()[0] == 1.0
    assert math.isnan(pair_correct(chosen, rejected, tie).tolist()[1])
    assert pair_correct(chosen, rejected).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_pointwise_binary():
    score = torch.tensor([2.0, -1.0, 0.0])
    label = torch.tensor([1.0, 1.0, 0.5])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(score, label, reduction="none")
    torch.testing.assert_close(pointwise_binary_loss(score, label), expected)
    right = binary_correct(score, label).tolist()
    assert right[:2] == [1.0, 0.0] and math.isnan(right[2])


def test_beta_prm_properties():
    from mcore_rl.algos.beta_prm import (
        adaptive_stop,
        beta_binomial_log_pmf,
        beta_head,
        beta_prm_loss,
        reliability_regularizer,
    )

    n = torch.tensor(8.0)
    for mu, kappa in ((0.3, 0.5), (0.9, 20.0), (0.5, 1e3)):  # the pmf sums to 1 over K = 0..N
        k = torch.arange(9.0)
        pmf = beta_binomial_log_pmf(k, n.expand(9), torch.tensor(mu).expand(9), torch.tensor(kappa).expand(9)).exp()
        assert abs(float(pmf.sum()) - 1.0) < 1e-4, (mu, kappa, float(pmf.sum()))
    # kappa -> infinity: the Binomial NLL with p = mu
    k, mu = torch.tensor(3.0), torch.tensor(0.3)
    binomial = torch.distributions.Binomial(8, probs=mu).log_prob(k)
    assert abs(float(beta_binomial_log_pmf(k, n, mu, torch.tensor(1e7)) - binomial)) < 1e-3
    # the regulariser: zero where mu = K/N, growing with kappa elsewhere
    assert float(reliability_regularizer(torch.tensor(2.0), n, torch.tensor(0.25), torch.tensor(50.0))) == 0.0
    wrong = [float(reliability_regularizer(k, n, torch.tensor(0.9), torch.tensor(c))) for c in (1.0, 10.0, 100.0)]
    assert 0 < wrong[0] < wrong[1] < wrong[2]
    # the head and the loss train: gradient steps move mu toward K/N
    raw = torch.zeros(4, 2, requires_grad=True)
    counts = torch.tensor([0.0, 2.0, 6.0, 8.0])
    opt = torch.optim.Adam([raw], lr=0.1)
    for _ in range(300):
        opt.zero_grad()
        beta_prm_loss(raw, counts, n.expand(4)).sum().backward()
        opt.step()
    mu_fit, _ = beta_head(raw.detach())
    assert torch.allclose(mu_fit, counts / 8, atol=0.08), mu_fit
    # adaptive compute: stop exactly when LCB(best) > max UCB of the others
    assert adaptive_stop(torch.tensor([0.9, 0.5]), torch.tensor([0.1, 0.1]))
    assert not adaptive_stop(torch.tensor([0.9, 0.75]), torch.tensor([0.1, 0.1]))
    assert not adaptive_stop(torch.tensor([0.9, 0.7]), torch.tensor([0.1, 0.1]))  # equal bounds: go on
    assert adaptive_stop(torch.tensor([0.9, 0.7]), torch.tensor([0.1, 0.1]), z=0.9)


# ---- data ---------------------------------------------------------------------------------------


def _rm_cfg(*overrides: str) -> RMConfig:
    return load_config(RMConfig, None, list(overrides))


def test_bad_pairs_are_named_by_line(tmp_path):
    good = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    lines = [
        good,
        {"prompt": "1+1=", "chosen": "2", "rejected": "2"},  # 2: identical
        {"prompt": "1+1=", "chosen": " ", "rejected": "3"},  # 3: empty
        {"prompt": "1+1=", "chosen": "2"},  # 4: missing field
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": -1},  # 5: margin out of range
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "head": 2},  # 6: no such head
        {"prompt": "1+1=", "chosen": "2", "rejected": "3", "tie": "yes"},  # 7: tie not a bool
        {"prompt": "1+1=", "chosen": 2, "rejected": "3"},  # 8: not a string
        dict(good, margin=0.5, tie=False, head=1),
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    problems = {
        2: "are the same response",
        3: "empty response",
        4: "missing key(s) ['rejected']",
        5: "'margin' must be a number >= 0",
        6: "'head' must be an integer in [0, 2)",
        7: "'tie' must be true or false",
        8: "expected strings: 'chosen' is int",
    }
    cfg = _rm_cfg(f"data.path={path}", "reward_model.num_heads=2")
    with pytest.raises(DataError, match=f"{path}:2: 'chosen' and 'rejected' are the same response"):
        read_preference_file(cfg.data, "bradley_terry", 2)
    skip = _rm_cfg(f"data.path={path}", "data.on_bad_line=skip").data
    for lineno, problem in problems.items():  # each one alone fails naming its line
        one = tmp_path / f"one_{lineno}.jsonl"
        one.write_text(json.dumps(good) + "\n" + json.dumps(lines[lineno - 1]) + "\n")
        with pytest.raises(DataError) as err:
            read_preference_file(_rm_cfg(f"data.path={one}").data, "bradley_terry", 2)
        assert str(err.value).startswith(f"{one}:2: ") and problem in str(err.value), str(err.value)
    pairs = read_preference_file(skip, "bradley_terry", 2)
    assert [p.source for p in pairs] == [f"{path}:1", f"{path}:9"]
    assert (pairs[1].margin, pairs[1].tie, pairs[1].head) == (0.5, False, 1)


def test_bad_labels_are_named_by_line(tmp_path):
    path = tmp_path / "labels.jsonl"
    rows = [{"prompt": "q", "response": "a", "label": 1}, {"prompt": "q", "response": "b", "label": 1.5}]
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: 'label' must be a number in \\[0, 1\\], got 1.5"):
        read_preference_file(_rm_cfg(f"data.path={path}").data, "binary", 1)
    # every other bad labelled response, each alone named by its line; `skip` keeps the good ones
    good = {"prompt": "q", "response": "a", "label": 0.25}
    bad = {
        2: ({"prompt": "q", "response": "a", "label": -0.1}, "'label' must be a number in [0, 1], got -0.1"),
        3: ({"prompt": "q", "response": "a", "label": "yes"}, "'label' must be a number in [0, 1], got 'yes'"),
        4: ({"prompt": "q", "response": "a"}, "'label' must be a number in [0, 1], got None"),
        5: ({"prompt": "q", "response": "  ", "label": 1}, "empty response 'response'"),
        6: ({"prompt": "q", "label": 1}, "missing key(s) ['response']"),
        7: ({"prompt": "q", "response": "a", "label": 1, "head": 1}, "'head' must be an integer in [0, 1)"),
        8: ({"prompt": "q", "response": "a", "label": float("nan")}, "'label' must be a number in [0, 1]"),
    }
    for lineno, (obj, problem) in bad.items():
        one = tmp_path / f"label_{lineno}.jsonl"
        one.write_text(json.dumps(good) + "\n" + json.dumps(obj) + "\n")
        with pytest.raises(DataError) as err:
            read_preference_file(_rm_cfg(f"data.path={one}").data, "binary", 1)
        assert str(err.value).startswith(f"{one}:2: ") and problem in str(err.value), str(err.value)
    every = tmp_path / "every.jsonl"
    lines = [good] + [obj for obj, _ in bad.values()] + [dict(good, label=True)]
    every.write_text("".join(json.dumps(x) + "\n" for x in lines))
    kept = read_preference_file(_rm_cfg(f"data.path={every}", "data.on_bad_line=skip").data, "binary", 1)
    assert [(r.source, r.label) for r in kept] == [(f"{every}:1", 0.25), (f"{every}:9", 1.0)]
    # a score distribution that does not sum to 1 is a bad line too
    dist = tmp_path / "dist.jsonl"
    dist.write_text(json.dumps({"prompt": "q", "response": "a", "label": [0.5, 0.6]}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{dist}:1: 'label' must be a list of 2 probabilities")):
        read_preference_file(_rm_cfg(f"data.path={dist}").data, "score_distribution", 2)


def _prm_lines() -> list[dict]:
    return [
        {"prompt": "1+2+3=", "steps": ["1+2=3", "3+3=6"], "successes": [7, 8], "rollouts": 8},
        {"prompt": "4+4+1=", "steps": ["4+4=9", "9+1=10"], "successes": [0, 0], "rollouts": [8, 4]},
        {"prompt": "2+2+2=", "steps": ["2+2=4", "4+2=6", "6=6"], "successes": [5, 6, 6], "rollouts": 6},
    ]


def test_process_reward_data_are_read_at_each_steps_delimiter(tmp_path):
    from mcore_rl.data.process_rewards import process_rows, read_process_file
    from mcore_rl.data.tokenizer import load_tokenizer

    good = tmp_path / "prm.jsonl"
    good.write_text("".join(json.dumps(o) + "\n" for o in _prm_lines()))
    cfg = _rm_cfg(f"data.path={good}", "reward_model.objective=beta_prm", "reward_model.num_heads=2")
    examples = read_process_file(cfg.data)
    assert [e.rollouts for e in examples] == [[8, 8], [8, 4], [6, 6, 6]] and examples[1].source == f"{good}:2"
    tok = load_tokenizer(None)
    rows = process_rows(examples, 64, "\n", tok)
    newline = tok.encode("\n")[-1]
    for r, e in enumerate(examples):
        at = rows["step_index"][r][: len(e.steps)]
        assert all(int(rows["tokens"][r, i]) == newline for i in at)  # each step read at its delimiter
        assert rows["successes"][r][: len(e.steps)].tolist() == e.successes
    assert rows["step_index"][0, 2] == -1  # two steps: the third column is padding
    cut = process_rows(examples[2:], 14, "\n", tok)  # the later steps of a cut solution are dropped
    assert (cut["step_index"][0] >= 0).tolist() == [True, False, False]
    bad_lines = [
        ({"prompt": "a", "steps": [], "successes": [], "rollouts": 1}, "must be a non-empty list of strings"),
        ({"prompt": "a", "steps": ["x", " "], "successes": [1, 1], "rollouts": 2}, "step 1 is empty"),
        ({"prompt": "a", "steps": ["x\ny"], "successes": [1], "rollouts": 2}, "contains the step delimiter"),
        ({"prompt": "a", "steps": ["x"], "successes": [3], "rollouts": 2}, "step 0: need integers 0 <= successes"),
        ({"prompt": "a", "steps": ["x", "y"], "successes": [1], "rollouts": 2}, "2 steps but 1 'successes'"),
        ({"prompt": "a", "steps": ["x"], "rollouts": 2}, "missing key(s) ['successes']"),
    ]
    for obj, message in bad_lines:
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps(_prm_lines()[0]) + "\n" + json.dumps(obj) + "\n")
        cfg = _rm_cfg(f"data.path={path}", "reward_model.objective=beta_prm", "reward_model.num_heads=2")
        with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
            read_process_file(cfg.data)
    with pytest.raises(ConfigError, match=r"reward_model.num_heads: must be 2 for beta_prm"):
        validate_rm_config(_rm_cfg(f"data.path={good}", "reward_model.objective=beta_prm"), 1)


def test_z_reward_properties(tmp_path):
    bins = score_bins()
    assert bins.tolist() == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0]
    one_hot = torch.eye(9, dtype=torch.float64)
    assert torch.equal(expected_score(one_hot, bins), bins)  # one-hot at s: μ = s
    assert float(expected_score(torch.full((9,), 1 / 9), bins)) == pytest.approx(3.0)  # uniform: 3.0
    logits = torch.randn(4, 9)
    q = score_distribution(logits)
    assert torch.allclose(q.sum(-1), torch.ones(4, dtype=torch.float64))
    mu = expected_score(q, bins)
    assert float(pointwise_reward(torch.tensor(3.5), torch.tensor(3.5), 1.0, 5.0)) == 1.0
    r = pointwise_reward(mu, torch.full((4,), 2.0), 1.0, 5.0)
    assert bool(((r >= 0) & (r <= 1) & (r < 1)).all())
    mw, ml = torch.tensor([4.0, 4.5]), torch.tensor([2.0, 2.5])
    assert float(pairwise_loss(mw, ml, 2.0, 1.0, 5.0)) > 0 and bool((pairwise_reward(mw, ml, 2.0, 1.0, 5.0) < 1).all())
    assert float(pairwise_loss(torch.tensor([4.0, 4.0]), torch.tensor([2.0, 2.0]), 2.0, 1.0, 5.0)) == 0.0
    assert torch.equal(
        pairwise_reward(torch.tensor([4.0, 4.0]), torch.tensor([2.0, 2.0]), 2.0, 1.0, 5.0),
        torch.ones(2, dtype=torch.float64),
    )
    assert bool((pairwise_reward(torch.tensor([5.0]), torch.tensor([1.0]), -4.0, 1.0, 5.0) >= -1).all())
    true = torch.tensor([0, 3, 8, 4])
    assert float(pointwise_ce(q, true)) == pytest.approx(float(-q[torch.arange(4), true].log().mean()))
    assert torch.allclose(risd_loss(torch.softmax(logits, -1), logits), torch.zeros(4), atol=1e-6)  # q_φ = q_T
    assert bool((risd_loss(torch.softmax(logits, -1), logits.flip(-1)) > 0).all())
    # the student's data: a teacher distribution per response, checked by line
    path = tmp_path / "dist.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "response": "b", "label": [0.2, 0.8]}) + "\n"
        + json.dumps({"prompt": "a", "response": "c", "label": [0.5, 0.6]}) + "\n"
    )  # fmt: skip
    cfg = _rm_cfg(f"data.path={path}", "reward_model.objective=score_distribution", "reward_model.num_heads=2")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: 'label' must be a list of 2 probabilities")):
        read_preference_file(cfg.data, "score_distribution", 2)
    with pytest.raises(ConfigError, match="reward_model.num_heads: must be >= 2 for score_distribution"):
        validate_rm_config(_rm_cfg(f"data.path={path}", "reward_model.objective=score_distribution"), 1)


def test_task_pairs_are_verified_and_carry_the_artifact():
    task = get_task("addition", max_digits=2)
    pairs = task_pairs("addition", 20, 0, 2, artifact="length")
    held = task_pairs("addition", 20, 1, 2, artifact="length", reverse_artifact=True)
    for p in pairs:
        assert task.score(p.prompt, p.chosen.split(" ")[0]) == 1.0 and task.score(p.prompt, p.rejected) == 0.0
        assert len(p.chosen) > len(p.rejected)
    for p in held:
        assert task.score(p.prompt, p.chosen) == 1.0 and len(p.rejected) > len(p.chosen)
    assert task_pairs("addition", 20, 0, 2) == task_pairs("addition", 20, 0, 2)  # deterministic


def test_rrm_augmentation_and_filter():
    from mcore_rl.algos.reward_model import rrm_keep
    from mcore_rl.data.preferences import rrm_augment

    pairs = task_pairs("addition", 30, 0, 2, artifact="length")
    out = rrm_augment(pairs, seed=0)
    assert out[: len(pairs)] == pairs and out == rrm_augment(pairs, seed=0)
    new = out[len(pairs) :]
    own = {p.prompt: (p.chosen, p.rejected) for p in pairs}
    others = {r for p in pairs for r in (p.chosen, p.rejected)}
    ties = [p for p in new if p.tie]
    wins = [p for p in new if not p.tie]
    assert len(wins) > 0 and len(ties) > 0
    for p in wins:  # the prompt's own response wins over another prompt's, correct or not
        assert p.chosen in own[p.prompt] and p.rejected not in own[p.prompt] and p.rejected in others
    for p in ties:  # two other prompts' responses: a tie
        assert p.chosen not in own[p.prompt] and p.rejected not in own[p.prompt]
    # the artefact no longer predicts the label: some winners lack it while their loser has it
    assert any(not p.chosen.endswith("twice.") and p.rejected.endswith("twice.") for p in wins)
    # the filter keeps what the base model gets wrong by >= 0.2
    first, second = torch.tensor([2.0, 0.0, 0.0, 0.1]), torch.tensor([0.0, 0.0, 2.0, 0.0])
    target = torch.tensor([1.0, 0.5, 0.5, 1.0])
    assert rrm_keep(first, second, target).tolist() == [False, False, True, True]


def _base_classifier(path: str, vocab: int = 384) -> str:
    """A tiny stock HF reward model on the bundled byte tokenizer's ids (random weights)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=256,
    )
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    return path


def test_rrm_filter_keeps_the_augmented_pairs_the_base_model_gets_wrong(tmp_path):
    """`data.rrm_base_model`: the base model scores each augmented pair's two sequences as training
    reads them; a pair is kept iff |σ(r_c − r_r) − target| >= `data.rrm_threshold` (each sequence
    scored alone here, batched and padded there)."""
    from transformers import AutoModelForSequenceClassification

    from mcore_rl.algos.reward_model import rrm_keep
    from mcore_rl.data.preferences import rrm_augment, sequence_ids
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.train.reward_model import build_rows, rrm_filter

    base = _base_classifier(str(tmp_path / "base"))
    tok = load_tokenizer(None)
    pairs = task_pairs("addition", 24, 0, 2, artifact="length")
    new = rrm_augment(pairs, seed=0)[len(pairs) :]
    model = AutoModelForSequenceClassification.from_pretrained(base).eval()
    with torch.no_grad():
        first, second = (
            torch.stack([model(torch.tensor([sequence_ids(p.prompt, r, tok)])).logits[0, 0] for p, r in zip(new, side)])
            for side in ([p.chosen for p in new], [p.rejected for p in new])
        )
    target = torch.tensor([0.5 if p.tie else 1.0 for p in new])
    for threshold in (0.2, 0.45):
        want = [p for p, k in zip(new, rrm_keep(first, second, target, threshold).tolist()) if k]
        got = rrm_filter(new, base, threshold, 64, tok)
        assert got == want and 0 < len(got) < len(new), (threshold, len(got), len(new))
    # in `rm-train`: the training rows are the pairs and the kept augmented pairs
    overrides = ["data.rrm=true", f"data.rrm_base_model={base}", "data.synthetic_num_examples=24", "train.seed=0"]
    overrides += ["train.eval_interval=0", "data.synthetic_max_digits=2", "data.artifact=length", "train.seq_length=64"]
    rows, held = build_rows(_rm_cfg(*overrides), tok, 1)
    assert held is None and len(rows["tie"]) == len(pairs) + len(rrm_filter(new, base, 0.2, 64, tok))


def test_config_rules():
    with pytest.raises(ConfigError) as err:
        validate_rm_config(
            _rm_cfg("reward_model.num_heads=0", "model.tie_word_embeddings=true", "data.pack_sequences=true"), 1
        )
    for key in ("reward_model.num_heads", "model.tie_word_embeddings", "data.pack_sequences"):
        assert key in str(err.value)
    with pytest.raises(ConfigError, match="reward_model.objective"):
        validate_rm_config(_rm_cfg("reward_model.objective=binary"), 1)
    with pytest.raises(ConfigError, match="data.rrm"):
        validate_rm_config(_rm_cfg("reward_model.objective=binary", "data.rrm=true", "data.path=x.jsonl"), 1)
    with pytest.raises(ConfigError) as err:
        validate_rm_config(_rm_cfg("data.rrm_base_model=/nowhere", "data.rrm_threshold=1.5"), 1)
    assert "data.rrm_threshold: must be in (0, 1), got 1.5" in str(err.value)
    assert "data.rrm_base_model: filters RRM's augmented pairs; set data.rrm=true" in str(err.value)
    assert "data.rrm_base_model: /nowhere/config.json cannot be read" in str(err.value)


# ---- parity, training and resume in one 2-rank world ---------------------------------------------


def _pair_batches() -> list[dict[str, torch.Tensor]]:
    """Micro-batches of PAIRS pairs: different lengths, margins, a tie, both heads."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(MICROBATCHES):
        mb = {}
        for side in ("chosen", "rejected"):
            mb[f"{side}_tokens"] = torch.randint(0, MC.vocab_size, (PAIRS, SEQ), generator=g)
            mb[f"{side}_index"] = torch.randint(SEQ // 2, SEQ, (PAIRS,), generator=g)
        mb["margin"] = torch.rand(PAIRS, generator=g)
        mb["tie"] = torch.tensor([False, True])
        mb["head"] = torch.randint(0, HEADS, (PAIRS,), generator=g)
        out.append(mb)
    return out


def _label_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(6)
    return [
        {
            "tokens": torch.randint(0, MC.vocab_size, (PAIRS, SEQ), generator=g),
            "index": torch.randint(SEQ // 2, SEQ, (PAIRS,), generator=g),
            "label": torch.tensor([1.0, 0.0]),
            "head": torch.randint(0, HEADS, (PAIRS,), generator=g),
        }
        for _ in range(MICROBATCHES)
    ]


def _prm_batches() -> list[dict[str, torch.Tensor]]:
    """Micro-batches of step-labelled rows: up to 3 steps, one row with fewer, K of N counts."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(MICROBATCHES):
        index = torch.stack([torch.randperm(SEQ, generator=g)[:3].sort().values for _ in range(PAIRS)])
        index[1, 2] = -1
        n = torch.randint(1, 9, (PAIRS, 3), generator=g)
        k = (torch.rand(PAIRS, 3, generator=g) * (n + 1)).long().clamp(max=n)
        tokens = torch.randint(0, MC.vocab_size, (PAIRS, SEQ), generator=g)
        out.append({"tokens": tokens, "step_index": index, "successes": k, "rollouts": n})
    return out


def _distribution_batches() -> list[dict[str, torch.Tensor]]:
    """Z-Reward's student: each response's teacher distribution over HEADS score bins."""
    g = torch.Generator().manual_seed(8)
    return [
        {
            "tokens": torch.randint(0, MC.vocab_size, (PAIRS, SEQ), generator=g),
            "index": torch.randint(SEQ // 2, SEQ, (PAIRS,), generator=g),
            "head": torch.zeros(PAIRS, dtype=torch.long),
            "target": torch.softmax(torch.randn(PAIRS, HEADS, generator=g), -1),
        }
        for _ in range(MICROBATCHES)
    ]


def _count(batch: dict[str, torch.Tensor]) -> int:
    """What the loss is a mean over: pairs, responses or steps."""
    return int((batch["step_index"] >= 0).sum()) if "step_index" in batch else batch["head"].numel()


def _reference(batches):
    """The objective in plain torch: the reference decoder's final hidden state at each row's last
    token, a bias-free linear head, the same losses; mean over all pairs (responses)."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config
    from mcore_rl.train.reward_model import model_batch

    torch.manual_seed(1234)
    lm = McoreRLForCausalLM(hf_config_from_model_config(MC)).float()
    with torch.no_grad():
        for p in lm.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    head = torch.nn.Linear(MC.hidden_size, HEADS, bias=False)
    torch.nn.init.normal_(head.weight, 0.0, 0.5)
    total = sum(_count(b) for b in batches)
    objective = 0.0
    for raw in batches:
        b = model_batch(raw)
        hidden = lm.model(b["tokens"], position_ids=b["position_ids"]).last_hidden_state
        values = head(hidden)
        if "target" in b:
            loss = risd_loss(b["target"], values[torch.arange(len(b["head"])), b["index"]])
        elif "step_index" in b:
            valid = b["step_index"] >= 0
            rows = torch.arange(b["tokens"].shape[0]).unsqueeze(1).expand_as(b["step_index"])
            raw = values[rows[valid], b["step_index"][valid]]
            loss = beta_prm_loss(raw, b["successes"][valid], b["rollouts"][valid], 0.5)
        elif "margin" in b:
            heads = torch.cat([b["head"], b["head"]])
            s = values[torch.arange(len(heads)), b["index"], heads]
            p = b["margin"].shape[0]
            loss = bradley_terry_loss(s[:p], s[p:], b["margin"], b["tie"])
        else:
            s = values[torch.arange(len(b["head"])), b["index"], b["head"]]
            loss = pointwise_binary_loss(s, b["label"])
        objective = objective + loss.sum() / total
    objective.backward()
    state = {k: v.detach().clone() for k, v in lm.model.state_dict().items()}
    state = {f"model.{k}": v for k, v in state.items()}
    grads = {f"model.{n}": p.grad.detach().clone() for n, p in lm.model.named_parameters()}
    grads["score.weight"] = head.weight.grad.detach().clone()
    state["score.weight"] = head.weight.detach().clone()
    return float(objective.detach()), state, grads


def _to_megatron(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import dataclasses

    from mcore_rl.hf.weight_map import hf_to_megatron
    from mcore_rl.models.value_head import HEAD_PARAM, HF_HEAD_PARAM

    out = hf_to_megatron(hf, dataclasses.replace(MC, tie_word_embeddings=True))  # the backbone: no lm_head
    out[HEAD_PARAM] = hf[HF_HEAD_PARAM]
    return out


def _check_parity(pc, batches, ref) -> None:
    from megatron.core import parallel_state as ps

    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.shards import gather_full_state_dict, load_full_state_dict
    from mcore_rl.models.value_head import install_value_head
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.forward_backward import prepare_config, wrap_ddp
    from mcore_rl.train.reward_model import rm_forward_backward

    ref_loss, ref_state, ref_grads = ref
    layout = init_model_parallel(pc)
    set_seed(1)
    config = transformer_config(MC, pc)
    chunks = build_model(MC, pc, config=config)
    for chunk in chunks:
        install_value_head(chunk, HEADS, seed=0)
    load_full_state_dict(chunks, _to_megatron(ref_state))
    chunks = wrap_ddp(chunks, config)
    prepare_config(config, chunks)
    per_rank = len(batches) // layout.dp
    rank = ps.get_data_parallel_rank()
    result = rm_forward_backward(chunks, batches[rank * per_rank : (rank + 1) * per_rank], regularizer_weight=0.5)
    first = batches[0]
    kind = (
        "steps"
        if "step_index" in first
        else "pairs"
        if "margin" in first
        else "dist"
        if "target" in first
        else "labels"
    )
    name = f"{kind} {pc}"
    assert abs(result["loss"] - ref_loss) <= 1e-5 * abs(ref_loss), f"{name}: loss {result['loss']} vs {ref_loss}"
    assert result["count"] == sum(_count(b) for b in batches)
    grads = gather_full_state_dict(chunks, grads=True)
    expected = _to_megatron(ref_grads)
    assert set(grads) == set(expected), f"{name}: {sorted(set(grads) ^ set(expected))}"
    for key, want in expected.items():
        scale = float(want.abs().max()) or 1.0
        torch.testing.assert_close(grads[key], want, rtol=1e-4, atol=2e-6 * scale, msg=lambda m: f"{name} {key}: {m}")
    ps.destroy_model_parallel()


def _rm_run_cfg(run_dir: str, iters: int, *extra: str, **checkpoint) -> RMConfig:
    overrides = [
        f"run_dir={run_dir}",
        f"train.train_iters={iters}",
        "train.log_interval=100",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.seq_length=16",
        "train.eval_interval=2",
        "train.eval_iters=2",
        "data.synthetic_max_digits=2",
        "data.synthetic_num_examples=64",
        "model.num_layers=2",
        "model.hidden_size=32",
        "model.ffn_hidden_size=64",
        "reward_model.num_heads=2",
        "optimizer.lr=3e-3",
        "optimizer.lr_decay_style=constant",  # the same schedule for a 2-step and a 4-step run
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
    ]
    overrides += [f"checkpoint.{k}={v}" for k, v in checkpoint.items()]
    return load_config(RMConfig, None, overrides + list(extra))


def _world(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist

    from mcore_rl.train import reward_model

    pairs, labels, steps = _pair_batches(), _label_batches(), _prm_batches()
    ref_pairs, ref_labels, ref_steps = _reference(pairs), _reference(labels), _reference(steps)
    start = time.perf_counter()
    for pc in (P(tp=2, sp=True), P(tp=2), P(pp=2), P()):
        _check_parity(pc, pairs, ref_pairs)
    _check_parity(P(tp=2, sp=True), labels, ref_labels)
    _check_parity(P(tp=2, sp=True), steps, ref_steps)  # a PRM: BetaPRM's head read at each step
    dists = _distribution_batches()
    _check_parity(P(tp=2, sp=True), dists, _reference(dists))  # Z-Reward's student: KL to the teacher's bins
    print(f"parity {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()

    # Training, held-out accuracy in the records, checkpoint and bit-identical resume (TP=2, SP).
    full = reward_model.run_rm(_rm_run_cfg(f"{tmp}/a", 4))
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all(0.0 <= full[i]["eval_accuracy"] <= 1.0 for i in (1, 3)) and "eval_accuracy" not in full[0]
    reward_model.run_rm(_rm_run_cfg(f"{tmp}/b", 2, save_dir=f"{tmp}/ckpt"))
    resumed = reward_model.run_rm(_rm_run_cfg(f"{tmp}/c", 4, load_dir=f"{tmp}/ckpt"))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert resumed[-1]["eval_accuracy"] == full[-1]["eval_accuracy"]
    # a causal LM's checkpoint, or one with other heads, is refused naming it
    from mcore_rl.convert import hf_to_mcore
    from tests.helpers import save_tiny_hf_model

    if rank == 0:
        save_tiny_hf_model(f"{tmp}/lm_hf", 64)
    dist.barrier()
    hf_to_mcore(f"{tmp}/lm_hf", f"{tmp}/lm_mcore", P(tp=2))
    for cfg, message in (
        (_rm_run_cfg(f"{tmp}/f", 4, load_dir=f"{tmp}/lm_mcore"), "is a language model's checkpoint"),
        (_rm_run_cfg(f"{tmp}/f", 4, "reward_model.num_heads=1", load_dir=f"{tmp}/ckpt"), "has 2 value head(s)"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            reward_model.build_trainer(cfg)
    _check_init(rank, tmp)
    # a process reward model from a file of step-labelled solutions: trains, logs held-out step accuracy
    if rank == 0:
        with open(f"{tmp}/prm.jsonl", "w") as f:
            f.write("".join(json.dumps(o) + "\n" for o in _prm_lines() * 4))
    dist.barrier()
    prm_cfg = _rm_run_cfg(
        f"{tmp}/prm", 2, f"data.path={tmp}/prm.jsonl", "reward_model.objective=beta_prm", "train.seq_length=24"
    )
    prm = reward_model.run_rm(prm_cfg)
    assert all(math.isfinite(r["loss"]) for r in prm) and 0.0 <= prm[-1]["eval_accuracy"] <= 1.0
    print(f"train {time.perf_counter() - start:.1f} s", flush=True)
    start = time.perf_counter()
    _check_conversion(rank, tmp)
    print(f"convert {time.perf_counter() - start:.1f} s", flush=True)


def _policy_weights(path: str, mc: ModelConfig) -> dict[str, torch.Tensor]:
    """The full weights of the causal LM checkpoint at `path`, loaded at TP=1."""
    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.checkpoint import latest_checkpoint, load_checkpoint

    init_model_parallel(P())
    set_seed(1)
    (chunk,) = build_model(mc, P(), config=transformer_config(mc, P()))
    found = latest_checkpoint(path)
    assert found is not None
    load_checkpoint(found, [chunk], None)
    out = gather_full_state_dict([chunk])
    _destroy()
    return out


def _check_init(rank: int, tmp: str) -> None:
    """`init.checkpoint`: an RM at TP=2 with SP starts from a policy that `mcore-rl sft` saved at TP=1 (with
    its optimizer state): its decoder is the policy's bit for bit, as at TP=1, its value head a fresh one's,
    its optimizer empty (the first AdamW step moves each weight by lr); a tied policy's embeddings are read;
    a resumable `checkpoint.load_dir`
    wins; the refusals; a converted policy's HF provenance reaches the RM's export."""
    import torch.distributed as dist

    from mcore_rl.config import SFTConfig
    from mcore_rl.convert.reward_model import mcore_reward_model_to_hf
    from mcore_rl.models.shards import gather_full_state_dict
    from mcore_rl.train import reward_model, sft

    start = time.perf_counter()
    base = _rm_run_cfg(f"{tmp}/unused", 1)
    sft_cfg = load_config(
        SFTConfig,
        None,
        [
            f"run_dir={tmp}/policy_run",
            "train.train_iters=1",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.seq_length=16",
            "data.synthetic_num_examples=64",
            "optimizer.lr=3e-2",
            f"checkpoint.save_dir={tmp}/policy",
        ]
        + [f"model.{k}={v}" for k, v in (("num_layers", 2), ("hidden_size", 32), ("ffn_hidden_size", 64))],
    )
    sft.run_sft(sft_cfg)  # TP=1, DP=2
    policy = _policy_weights(f"{tmp}/policy", base.model)
    # a policy with tied embeddings has no output layer: the RM reads its embeddings like the rest
    tied = dataclasses.replace(sft_cfg, run_dir=f"{tmp}/tied_run")
    tied.model = tied.model.replace(tie_word_embeddings=True)
    tied.checkpoint = dataclasses.replace(tied.checkpoint, save_dir=f"{tmp}/tied")
    sft.run_sft(tied)
    tied_policy = _policy_weights(f"{tmp}/tied", tied.model)
    tied_rm = reward_model.build_trainer(_rm_run_cfg(f"{tmp}/it", 2, f"init.checkpoint={tmp}/tied"))
    from_tied = gather_full_state_dict(tied_rm.chunks)
    assert set(from_tied) == set(tied_policy) | {"output_layer.weight"}
    assert all(torch.equal(tied_policy[k], from_tied[k]) for k in tied_policy)
    init = f"init.checkpoint={tmp}/policy"
    tp1 = ("parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false")
    fresh = gather_full_state_dict(reward_model.build_trainer(_rm_run_cfg(f"{tmp}/i0", 2)).chunks)
    one = gather_full_state_dict(reward_model.build_trainer(_rm_run_cfg(f"{tmp}/i1", 2, init, *tp1)).chunks)
    # a load_dir that holds no checkpoint yet (a launcher's save dir on the first start): init.checkpoint
    trainer = reward_model.build_trainer(_rm_run_cfg(f"{tmp}/i2", 2, init, load_dir=f"{tmp}/not_yet"))
    assert trainer.iteration == 0
    two = gather_full_state_dict(trainer.chunks)
    head = "output_layer.weight"
    assert set(two) == set(one) == set(fresh) and head in two and policy[head].shape[0] == 384
    for key, value in two.items():
        assert torch.equal(value, one[key]), f"TP=2 vs TP=1: {key}"
        if key == head:
            assert torch.equal(value, fresh[key]), "the value head is not a fresh one"
        else:
            assert torch.equal(value, policy[key]), f"{key} is not the policy's"
            assert not torch.equal(value, fresh[key]), f"{key}: the policy did not move from the seeded init"
    step = reward_model.train_step(trainer)  # a fresh AdamW: each weight with a gradient moves by lr
    after = gather_full_state_dict(trainer.chunks)
    moved = torch.cat([(after[k] - two[k]).abs().flatten() for k in two])
    moved = moved[moved > 0]
    assert moved.numel() > 0.3 * sum(v.numel() for v in two.values())  # not the unused tokens' embeddings
    assert float(((moved - step["lr"]).abs() < 0.02 * step["lr"]).float().mean()) > 0.95, step["lr"]
    assert float(moved.max()) < 1.01 * step["lr"]
    # bf16: the loaded weights reach the optimizer's fp32 masters (its step would otherwise undo the init)
    half = reward_model.build_trainer(_rm_run_cfg(f"{tmp}/ib", 2, init, "train.precision=bf16"))
    opt = half.optimizer
    masters = [(p, m) for p, m, has in zip(opt.model_params, opt.main_params, opt._has_master) if has]
    assert masters and all(torch.equal(m, p.detach().float()) for p, m in masters)
    for key, value in gather_full_state_dict(half.chunks).items():
        if key != head:
            assert torch.equal(value, policy[key].to(value.dtype)), f"bf16: {key} is not the policy's"
    # checkpoint.load_dir that holds a checkpoint is resumed; init.checkpoint is not read
    assert reward_model.build_trainer(_rm_run_cfg(f"{tmp}/i3", 4, init, load_dir=f"{tmp}/ckpt")).iteration == 2
    # refusals, naming the key, before any model is built
    os.makedirs(f"{tmp}/empty", exist_ok=True)
    for extra, message in (
        ((f"init.checkpoint={tmp}/empty",), f"init.checkpoint: '{tmp}/empty' holds no checkpoint"),
        ((f"init.checkpoint={tmp}/nowhere",), f"init.checkpoint: '{tmp}/nowhere' does not exist"),
        ((f"init.checkpoint={tmp}/ckpt",), "is a reward model's checkpoint, not a policy's"),
        ((init, "model.hidden_size=64", "model.ffn_hidden_size=64", "model.num_layers=3", "model.vocab_size=512"), "2"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)) as err:
            validate_rm_config(_rm_cfg(*extra), 2)
    assert "holds a model with vocab_size 384, hidden_size 32, num_layers 2" in str(err.value)
    assert "model.* here has vocab_size 512, hidden_size 64, num_layers 3" in str(err.value)
    # a policy converted from HF (`{tmp}/lm_mcore`, TP=2): the RM's checkpoint carries its provenance and
    # exports as the policy's family's sequence classifier
    reward_model.run_rm(_rm_run_cfg(f"{tmp}/prov", 1, f"init.checkpoint={tmp}/lm_mcore", save_dir=f"{tmp}/rm_lm"))
    mcore_reward_model_to_hf(f"{tmp}/rm_lm", f"{tmp}/rm_lm_hf")
    _destroy()
    if rank == 0:
        from megatron.core import dist_checkpointing

        from mcore_rl.train.checkpoint import latest_checkpoint

        saved = latest_checkpoint(f"{tmp}/rm_lm")
        assert saved is not None
        common = dist_checkpointing.load_common_state_dict(saved)["common"]
        assert common["hf_source"] == os.path.abspath(f"{tmp}/lm_hf") and "hf_config" in common
        from transformers import AutoConfig

        exported = AutoConfig.from_pretrained(f"{tmp}/rm_lm_hf")
        assert exported.architectures[0].endswith("ForSequenceClassification") and exported.num_labels == 2
    dist.barrier()
    print(f"init {time.perf_counter() - start:.1f} s", flush=True)


def _save_llama_classifier(path: str) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    config.num_labels = HEADS
    model = LlamaForSequenceClassification(config).float()
    _randomize(model)
    model.save_pretrained(path, safe_serialization=True)


def _scored_tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows (pad id 0) of different lengths, and each row's last real position."""
    tokens = torch.randint(1, vocab, (3, SEQ), generator=torch.Generator().manual_seed(9))
    last = torch.tensor([SEQ - 1, 5, 8])
    for row, end in enumerate(last.tolist()):
        tokens[row, end + 1 :] = 0
    return tokens, last


@torch.no_grad()
def _megatron_scores(ckpt: str, mc: ModelConfig, heads: int, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[rows, heads] from a reward-model checkpoint in TP=2 (no SP: every rank gets the values)."""
    from megatron.core import parallel_state as ps

    from mcore_rl.models.builder import build_model, transformer_config
    from mcore_rl.models.value_head import install_value_head
    from mcore_rl.parallel.setup import init_model_parallel, set_seed
    from mcore_rl.train.checkpoint import latest_checkpoint, load_checkpoint

    pc = P(tp=2)
    init_model_parallel(pc)
    set_seed(1)
    (chunk,) = build_model(mc, pc, config=transformer_config(mc, pc))
    install_value_head(chunk, heads, seed=3)
    path = latest_checkpoint(ckpt)
    assert path is not None
    load_checkpoint(path, [chunk], None)
    chunk.eval()
    positions = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
    values = chunk(tokens, positions, None)
    scores = values[torch.arange(tokens.shape[0]), last]
    # score_rows (RRM's filter reads a base model with it): the same scores, 3 rows in micro-batches of 2
    from mcore_rl.train.reward_model import score_rows

    for head in range(heads):
        rows = {"tokens": tokens, "index": last, "head": torch.full_like(last, head)}
        torch.testing.assert_close(score_rows([chunk], rows, 2), scores[:, head], atol=1e-6, rtol=0)
    ps.destroy_model_parallel()
    return scores


def _hf_scores(path: str, tokens: torch.Tensor) -> tuple[str, torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(tokens, attention_mask=(tokens != model.config.pad_token_id).long()).logits


def _check_conversion(rank: int, tmp: str) -> None:
    """A stock Llama sequence classifier -> megatron (TP=2) -> HF, bit for bit; megatron's scores
    equal HF's; the reward model trained above exports as a stock Qwen3 sequence classifier."""
    import pathlib

    import torch.distributed as dist

    from mcore_rl.convert.reward_model import hf_reward_model_to_mcore, mcore_reward_model_to_hf
    from mcore_rl.convert import model_config_from_hf, read_hf_config

    src, mcore, export = f"{tmp}/hf_rm", f"{tmp}/mcore_rm", f"{tmp}/export_rm"
    if rank == 0:
        _save_llama_classifier(src)
    dist.barrier()
    hf_reward_model_to_mcore(src, mcore, P(tp=2))
    _destroy()
    mcore_reward_model_to_hf(mcore, export)
    _destroy()
    mc = dataclasses.replace(model_config_from_hf(read_hf_config(src)), tie_word_embeddings=False)
    tokens, last = _scored_tokens(mc.vocab_size)
    megatron = _megatron_scores(mcore, mc, HEADS, tokens, last)
    if rank == 0:
        _assert_same_checkpoint(pathlib.Path(src), pathlib.Path(export))
        name, hf = _hf_scores(export, tokens)
        assert name == "LlamaForSequenceClassification"
        torch.testing.assert_close(megatron, hf, atol=1e-5, rtol=0)
    trained = _rm_run_cfg(f"{tmp}/unused", 1)
    mcore_reward_model_to_hf(f"{tmp}/ckpt", f"{tmp}/trained_hf")
    _destroy()
    tokens, last = _scored_tokens(256)  # bytes
    tokens[tokens == 0] = 256  # the byte tokenizer's <pad>
    megatron = _megatron_scores(f"{tmp}/ckpt", trained.model, 2, tokens, last)
    if rank == 0:
        name, hf = _hf_scores(f"{tmp}/trained_hf", tokens)
        assert name == "Qwen3ForSequenceClassification"
        torch.testing.assert_close(megatron, hf, atol=1e-5, rtol=0)
    dist.barrier()


def _destroy() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def test_parity_training_and_resume_in_a_two_rank_world(tmp_path):
    run_world(2, _world, str(tmp_path))


# ---- the command --------------------------------------------------------------------------------


def test_command_refuses_an_init_checkpoint_before_any_worker_starts(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "rm-train", f"run_dir={tmp_path}/run", f"init.checkpoint={tmp_path}"]
        + ["--nproc-per-node", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"init.checkpoint: '{tmp_path}' holds no checkpoint" in run.stderr
    assert "torch.distributed" not in run.stderr and "Traceback" not in run.stderr


def test_command_checks_the_data_before_any_worker_starts(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + '{"prompt": "a"}\n')
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = subprocess.run(
        [sys.executable, "-m", "mcore_rl.cli", "rm-train", f"run_dir={tmp_path}/run", f"data.path={data}"]
        + ["--nproc-per-node", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1].startswith(f"mcore-rl rm-train: {data}:2: missing key(s)")
    assert "torch.distributed" not in run.stderr and "Traceback" not in run.stderr
