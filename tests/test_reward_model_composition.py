"""Compositions of reward-model heads: ENCORE's entropy-weighted heads of a multi-head RM, RLUF's
binary feedback RM combined with other RMs, each with its own prompt set; their options checked
before any worker starts."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.algos import registry
from mcore_rl.algos.encore import encore_weights, score_entropy
from mcore_rl.algos.rluf import two_proportion_z

EOS, PAD, VOCAB = 5, 0, 64


def _classifier(path: str, labels: int, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    config.num_labels = labels
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def rms(tmp_path_factory) -> dict[str, str]:
    """A two-head RM (helpfulness, safety) and a binary feedback RM (P[Love] as a logit)."""
    root = tmp_path_factory.mktemp("rms")
    return {"help_safe": _classifier(str(root / "hs"), 2, 0), "love": _classifier(str(root / "love"), 1, 1)}


# ---- ENCORE --------------------------------------------------------------------------------------


def test_encore_entropy_and_weights():
    # a constant head has H = 0; uniform over m values, log m; counts only (order, relabelling)
    assert score_entropy(torch.full((7,), 0.5)) == 0.0
    assert score_entropy(torch.tensor([0.0, 0.5, 1.0] * 4)) == pytest.approx(math.log(3))
    s = torch.tensor([0.0, 0.0, 1.0, 0.5, 1.0, 1.0])
    assert score_entropy(s) == pytest.approx(score_entropy(s[torch.randperm(6)]))
    assert score_entropy(s) == pytest.approx(score_entropy(torch.tensor([7.0, 7.0, -1.0, 3.0, -1.0, -1.0])))
    assert score_entropy(torch.tensor([0.101, 0.099, float("nan")]), decimals=1) == 0.0  # rounded, NaN ignored
    ent = torch.tensor([0.2, 0.9, 0.5])
    w = encore_weights(ent, 1.0)
    assert float(w.sum()) == pytest.approx(1.0) and w[0] > w[2] > w[1]  # lower entropy, strictly larger weight
    assert torch.allclose(encore_weights(ent, 1e9), torch.full((3,), 1 / 3, dtype=torch.float64))  # tau -> inf: uniform
    assert float(encore_weights(ent, 1e-3)[0]) == pytest.approx(1.0)  # tau -> 0: the lowest-entropy head
    assert torch.allclose(
        encore_weights(torch.tensor([0.3, 0.3, 0.9]), 1e-3), torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    )
    # the guard: a constant head (H = 0) would take the largest weight; excluded, it gets none
    guarded = encore_weights(torch.tensor([0.0, 0.4, 0.8]), 1.0, torch.tensor([False, True, True]))
    assert guarded[0] == 0 and float(guarded.sum()) == pytest.approx(1.0)
    assert torch.allclose(
        encore_weights(torch.zeros(2), 1.0, torch.zeros(2, dtype=torch.bool)),
        torch.full((2,), 0.5, dtype=torch.float64),
    )


def test_encore_composes_a_batchs_heads():
    encore = registry.get("reward_shaping", "encore")
    names = ["h0", "h1", "h2"]
    heads = torch.tensor(
        [[1.0, 0.3, 2.0], [0.0, 0.7, 2.0], [1.0, 0.1, 2.0], [0.0, float("nan"), 2.0]], dtype=torch.float32
    )
    rewards, gids = torch.tensor([9.0, 9.0, 9.0, 9.0]), torch.tensor([0, 0, 1, 1])
    out = encore(rewards, gids, reward_heads=heads, head_names=names, heads=["h0", "h1", "h2"], tau=0.5, decimals=1)
    h = torch.tensor([score_entropy(heads[:, k].double(), 1) for k in range(3)], dtype=torch.float64)
    w = encore_weights(h, 0.5, h > 0)  # h2 is constant: weight 0
    assert w[2] == 0
    expected = (heads[:3].double() * w).sum(1)
    assert torch.allclose(out[:3].double(), expected, atol=1e-6)
    assert out[3] == pytest.approx(0.0)  # h1 missing: h0 alone (renormalised), its value 0
    given = encore(
        rewards, gids, reward_heads=heads, head_names=names, heads=["h0", "h1"], entropies={"h0": 0.1, "h1": 2.0}
    )
    w = encore_weights(torch.tensor([0.1, 2.0]), 1.0)
    assert torch.allclose(given[:3].double(), heads[:3, :2].double() @ w.double(), atol=1e-6)


# ---- RLUF ----------------------------------------------------------------------------------------


def test_rluf_z_test_and_weights():
    assert two_proportion_z(0.011, 0.010, 10**6) == pytest.approx(6.94, abs=0.01)
    rluf = registry.get("reward_shaping", "rluf")
    names = ["helpful", "love", "safe"]
    heads = torch.tensor([[0.9, -1.0, 0.2], [0.1, 2.0, 0.8]])
    base = rluf(torch.zeros(2), torch.tensor([0, 1]), reward_heads=heads, head_names=names,
                weights={"helpful": 0.7, "safe": 0.3})  # fmt: skip
    zero = rluf(torch.zeros(2), torch.tensor([0, 1]), reward_heads=heads, head_names=names,
                weights={"helpful": 0.7, "safe": 0.3, "love": 0.0}, probability_heads=["love"])  # fmt: skip
    assert torch.equal(base, zero)  # w_love = 0: the baseline reward exactly
    assert torch.allclose(base, 0.7 * heads[:, 0] + 0.3 * heads[:, 2])
    love = rluf(torch.zeros(2), torch.tensor([0, 1]), reward_heads=heads, head_names=names,
                weights={"helpful": 0.7, "safe": 0.3, "love": 0.3}, probability_heads=["love"])  # fmt: skip
    assert torch.allclose(love - base, 0.3 * torch.sigmoid(heads[:, 1]))


def test_rluf_each_rm_scores_its_own_prompt_set(rms):
    """Three prompt sets (domains) in one batch, each scored by its own RM only (two heads of one
    two-head RM and a binary feedback RM, named by `key`); the combination then weighs them."""
    from mcore_rl.data.domains import DomainSpec, RewardHead
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.runtime.rollout_manager import DomainRewards
    from mcore_rl.train.packing import domains_and_heads

    def rm(key: str, model_dir: str, head: int = 0) -> RewardHead:
        return RewardHead("reward_model", 1.0, {"model_dir": model_dir, "head": head, "eos_token_id": EOS}, key=key)

    def spec(name: str, head: RewardHead) -> DomainSpec:
        return DomainSpec(name, [head], group_size=2, top_p=1.0, top_k=-1, max_new_tokens=4)

    specs = {
        "chat": spec("chat", rm("helpful", rms["help_safe"], 0)),
        "risky": spec("risky", rm("safe", rms["help_safe"], 1)),
        "social": spec("social", rm("love", rms["love"])),
    }
    rewards = DomainRewards(specs, timeout_s=60, error_reward=0.0, max_concurrency=3)
    samples = []
    for g, domain in enumerate(specs):
        prompt = Prompt(g, "p", [1, 7 + g], domain=domain)
        samples += [Sample(prompt, g, [9 + g, EOS], [0.0, 0.0], 0, "stop"), Sample(prompt, g, [11], [0.0], 0, "length")]
    try:
        rewards.score_sync(samples)
    finally:
        rewards.close()
    assert all(s.reward_error is None for s in samples), [s.reward_error for s in samples]
    assert [set(s.reward_heads) for s in samples] == [{"helpful"}] * 2 + [{"safe"}] * 2 + [{"love"}] * 2
    batch = domains_and_heads(samples)
    weights = {"helpful": 0.7, "safe": 0.3, "love": 0.1}
    out = registry.get("reward_shaping", "rluf")(
        torch.tensor([s.reward for s in samples]),
        torch.tensor([s.group for s in samples]),
        reward_heads=batch["reward_heads"],
        head_names=batch["head_names"],
        weights=weights,
        probability_heads=["love"],
    )
    for s, r in zip(samples, out.tolist()):
        ((key, value),) = s.reward_heads.items()
        want = weights[key] * (1 / (1 + math.exp(-value)) if key == "love" else value)
        assert r == pytest.approx(want, abs=1e-6)


def test_composition_options_are_checked_before_workers_start():
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_schema import DomainConfig, RewardHeadConfig, RewardShapingConfig
    from mcore_rl.config.rl_validate import validate_rl_config

    def errors(shaping: RewardShapingConfig, heads: list[RewardHeadConfig] | None = None) -> str:
        cfg = load_config(RLConfig, None, [])
        cfg.algorithm.reward_shaping = [shaping]
        if heads is not None:
            cfg.data.domains = [DomainConfig(name="chat", task="addition", rewards=heads)]
        try:
            validate_rl_config(cfg, 1)
        except ConfigError as err:
            return str(err)
        return ""

    assert errors(RewardShapingConfig("encore", {"heads": ["a", "b"], "tau": 0.5})) == ""
    assert "algorithm.reward_shaping[0].options.tau: must be > 0" in errors(
        RewardShapingConfig("encore", {"heads": ["a", "b"], "tau": 0.0})
    )
    assert "options.heads: must list at least two reward heads" in errors(
        RewardShapingConfig("encore", {"heads": ["a"]})
    )
    assert "options.entropies: has no entropy for head(s) ['b']" in errors(
        RewardShapingConfig("encore", {"heads": ["a", "b"], "entropies": {"a": 0.3}})
    )
    assert errors(RewardShapingConfig("rluf", {"weights": {"helpful": 0.7, "love": 0.1}})) == ""
    assert "options.weights: must map reward heads" in errors(RewardShapingConfig("rluf", {}))
    assert "options.probability_heads: must list heads of `weights`" in errors(
        RewardShapingConfig("rluf", {"weights": {"helpful": 1.0}, "probability_heads": ["love"]})
    )
    twice = [RewardHeadConfig(name="math"), RewardHeadConfig(name="math", weight=0.0)]
    assert "rewards[1].name: domain 'chat': reward head 'math' is listed twice" in errors(
        RewardShapingConfig("rluf", {"weights": {"math": 1.0}}), twice
    )
    keyed = [RewardHeadConfig(name="math"), RewardHeadConfig(name="math", weight=0.0, key="math_again")]
    assert "listed twice" not in errors(RewardShapingConfig("rluf", {"weights": {"math": 1.0}}), keyed)
