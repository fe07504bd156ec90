"""Tasks: the registry, the addition task's parts, and the prompt sets built from a task."""

from __future__ import annotations

import pytest

from mcore_rl.config import RLConfig
from mcore_rl.data.prompts import build_prompt_sets
from mcore_rl.data.tasks import get_task, task_names
from mcore_rl.data.tasks.addition import make_addition_examples
from mcore_rl.data.tokenizer import load_tokenizer
from mcore_rl.rewards import RewardInput, get_reward_fn, reward_names


def test_registry_builds_the_addition_task_and_registers_its_reward() -> None:
    assert "addition" in task_names()
    task = get_task("addition", max_digits=2)
    pairs = task.examples(5, seed=7)
    assert pairs == [(ex["prompt"], ex["response"]) for ex in make_addition_examples(5, 7, 2)]
    prompt, answer = pairs[0]
    assert task.score(prompt, answer) == 1.0 and task.score(prompt, "x") == 0.0
    assert len(prompt) <= task.max_prompt_tokens() and task.max_answer_tokens() == len(answer) + 1
    assert task.reward in reward_names()
    assert get_reward_fn(task.reward)(RewardInput(prompt, answer + "<|endoftext|>")) == 1.0


def test_addition_lsd_writes_every_number_least_significant_digit_first() -> None:
    task = get_task("addition_lsd", max_digits=2)
    pairs = task.examples(200, seed=3)
    plain = get_task("addition", max_digits=2).examples(200, seed=3)
    for (prompt, answer), (p0, a0) in zip(pairs, plain):  # the same problems, the operands reversed
        x, y = p0[:-1].split("+")
        assert prompt == f"{x[::-1]}+{y[::-1]}=" and answer == a0
        assert task.score(prompt, answer) == 1.0
    assert task.score("70+53=", "240") == 1.0 and task.score("70+53=", "321") == 0.0  # 07 + 35, not 70 + 53
    assert get_reward_fn(task.reward)(RewardInput("70+53=", "240<|endoftext|>")) == 1.0
    assert get_reward_fn("addition")(RewardInput("70+53=", "321")) == 1.0  # the plain reward reads 70 + 53


def test_unknown_task_lists_the_registered_ones() -> None:
    with pytest.raises(KeyError, match="unknown task 'nope'; registered: .*addition"):
        get_task("nope")


def test_prompt_sets_keep_the_held_out_set_apart_and_carry_the_domain() -> None:
    cfg = RLConfig()
    cfg.data.synthetic_max_digits, cfg.data.synthetic_num_prompts, cfg.eval.num_prompts = 1, 300, 20
    sets = build_prompt_sets(cfg, load_tokenizer(None))
    held_out = sets.held_out_texts
    assert len(sets.eval_prompts) == 20
    train = sets.train.take(200)
    assert not held_out & {p.text for p in train}
    assert not held_out & {p.text for p in sets.validation.take(50)}
    assert {p.domain for p in train + sets.eval_prompts} == {"addition"}
