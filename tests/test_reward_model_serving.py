"""A trained reward model as a reward head: batched on the runner's event loop, one sample's failure
costs that sample, refused when its tokenizer is not the policy's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mcore_rl.rewards.base import RewardFunction, RewardInput, RewardRunner
from mcore_rl.rewards.registry import get_reward_fn
from mcore_rl.rewards.reward_model import load_batcher, reward_model_score

EOS, PAD, VOCAB = 5, 0, 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
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
    config.num_labels = 2
    path = str(tmp_path_factory.mktemp("rm") / "hf")
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    return path


def _sample(prompt: list[int], response: list[int]) -> RewardInput:
    return RewardInput("p", "c", metadata={"prompt_ids": prompt, "response_ids": response})


def _alone(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = load_batcher(model_dir).model
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_a_group_is_one_batch_and_scores_as_alone(model_dir):
    assert get_reward_fn("reward_model") is reward_model_score
    group = [_sample([1, 7, 8], [9, 10, EOS]), _sample([1, 7], [11, EOS]), _sample([1, 7, 8, 12], [13])]
    runner = RewardRunner(RewardFunction(reward_model_score, options={"model_dir": model_dir, "head": 1}))
    assert runner.isolation == "async"
    batcher = load_batcher(model_dir)
    before = batcher.batches
    results = runner.score_sync(group, [0, 0, 0])
    assert batcher.batches == before + 1  # the group's three calls: one padded forward
    assert all(r.error is None for r in results), [r.error for r in results]
    # each as scored alone; the length-cut response (no eos) is scored with its eos appended
    expected = [_alone(model_dir, ids)[1] for ids in ([1, 7, 8, 9, 10, EOS], [1, 7, 11, EOS], [1, 7, 8, 12, 13, EOS])]
    for r, want in zip(results, expected):
        assert abs(r.reward - float(want)) < 1e-5


def test_a_bad_sample_costs_only_itself(model_dir):
    group = [
        _sample([1, 7], [8, EOS]),
        _sample([1, 7], [VOCAB + 3, EOS]),  # another tokenizer's id
        RewardInput("p", "c"),  # no token ids
        _sample([1, 9], [8, EOS]),
    ]
    runner = RewardRunner(RewardFunction(reward_model_score, options={"model_dir": model_dir}))
    results = runner.score_sync(group, [0, 0, 0, 0])
    assert results[0].error is None and results[3].error is None
    assert f"outside the reward model's vocabulary of {VOCAB}" in results[1].error
    assert "carries no token ids" in results[2].error


def test_another_tokenizer_is_refused(model_dir):
    with pytest.raises(ValueError, match=f"ends sequences with token {EOS}, the policy with 2"):
        asyncio.run(reward_model_score(_sample([1], [2]), model_dir=model_dir, eos_token_id=2))
    with pytest.raises(ValueError, match="head 2 is not one of the model's 2 scores"):
        asyncio.run(reward_model_score(_sample([1], [2]), model_dir=model_dir, head=2))


def test_a_domain_head_scores_the_policy_tokens(model_dir):
    """The rollout's reward path hands the policy's token ids to the head, with the domain's other heads."""
    from mcore_rl.data.domains import DomainSpec, RewardHead
    from mcore_rl.data.samples import Prompt, Sample
    from mcore_rl.runtime.rollout_manager import DomainRewards

    head = RewardHead("reward_model", 2.0, {"model_dir": model_dir, "eos_token_id": EOS})
    specs = {"sums": DomainSpec("sums", [head], group_size=2, top_p=1.0, top_k=-1, max_new_tokens=4)}
    rewards = DomainRewards(specs, timeout_s=60, error_reward=0.0, max_concurrency=2)
    prompt = Prompt(0, "1+1=", [1, 7, 8], domain="sums")
    samples = [Sample(prompt, 0, [9, EOS], [0.0, 0.0], 0, "stop"), Sample(prompt, 0, [10], [0.0], 0, "length")]
    try:
        rewards.score_sync(samples)
    finally:
        rewards.close()
    for s, ids in zip(samples, ([1, 7, 8, 9, EOS], [1, 7, 8, 10, EOS])):
        assert s.reward_error is None, s.reward_error
        assert abs(s.reward_heads["reward_model"] - float(_alone(model_dir, ids)[0])) < 1e-5
        assert s.reward == 2.0 * s.reward_heads["reward_model"]


def test_a_reward_model_that_cannot_read_every_policy_id_is_refused_before_workers_start(model_dir, tmp_path):
    """An id past the reward model's vocabulary makes its sample a reward error (left out of the loss),
    so a policy with a larger vocabulary could escape a low score: refused at validation, naming the key."""
    from mcore_rl.config import RLConfig, load_config
    from mcore_rl.config.errors import ConfigError
    from mcore_rl.config.rl_schema import DomainConfig, RewardHeadConfig
    from mcore_rl.config.rl_validate import validate_rl_config

    def config(vocab: int, path: str) -> RLConfig:
        cfg = load_config(RLConfig, None, [f"model.vocab_size={vocab}"])
        head = RewardHeadConfig(name="reward_model", options={"model_dir": path})
        cfg.data.domains = [DomainConfig(name="add", task="addition", rewards=[head])]
        return cfg

    validate_rl_config(config(VOCAB, model_dir), 1)  # the same vocabulary: accepted
    with pytest.raises(
        ConfigError, match=r"data.domains\[0\].rewards\[0\].options.model_dir: domain 'add': the reward "
    ):
        validate_rl_config(config(VOCAB + 1, model_dir), 1)
    with pytest.raises(ConfigError, match=r"options.model_dir: domain 'add': .*config.json cannot be read"):
        validate_rl_config(config(VOCAB, str(tmp_path / "nowhere")), 1)
