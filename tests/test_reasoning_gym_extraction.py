"""reasoning-gym tasks for a real chat model: answer extraction and generator options."""

from __future__ import annotations

import pytest

from mcore_rl.data.tasks import get_task
from mcore_rl.data.tasks.reasoning_gym import answer_of, reasoning_gym_reward
from mcore_rl.rewards import RewardInput


def test_answer_extraction_modes():
    prose = "To solve 3 * 9, we multiply 3 by 9, which gives us 1,027.<|im_end|>ignored 5"
    assert answer_of(prose, "last_number") == "1027"  # after the stop marker nothing counts
    assert answer_of(prose, "auto") == "To solve 3 * 9, we multiply 3 by 9, which gives us 1,027."
    assert answer_of(prose, "tag") == ""
    tagged = "work: 2 + 2 = 4 <answer>5</answer> and 7"
    assert {answer_of(tagged, m) for m in ("auto", "tag", "last_number")} == {"5"}  # the tag wins
    assert answer_of("no digits here", "last_number") == ""
    assert answer_of("x = -12.5 then -3", "last_number") == "-3"
    with pytest.raises(ValueError, match="extract: 'first' is not one of auto, tag, last_number"):
        answer_of("1", "first")


def test_the_scorer_sees_the_extracted_answer():
    task = get_task("reasoning_gym", dataset="products", min_digits=1, max_digits=1)
    ((question, entry),) = task.rl_examples(1, seed=7)
    prose = f"The product is {entry['answer']}."
    assert reasoning_gym_reward(RewardInput(question, prose, entry), extract="last_number") == 1.0
    assert reasoning_gym_reward(RewardInput(question, prose, entry)) < 1.0  # the whole sentence is not the answer
    wrong = f"The product is {int(entry['answer']) + 1}."
    assert reasoning_gym_reward(RewardInput(question, wrong, entry), extract="last_number") < 1.0


def test_generator_options_reach_the_generator_including_max_digits():
    task = get_task("reasoning_gym", dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert task.options["max_digits"] == 1
    for question, entry in task.rl_examples(20, seed=1):
        a, b = [int(t) for t in question.split(":")[1].replace("=", "").replace("-", "+").split("+")]
        assert 0 <= a <= 9 and 0 <= b <= 9, question
    # `data.synthetic_max_digits` reaches every task as max_digits: dropped where the generator has none
    assert "max_digits" not in get_task("reasoning_gym", dataset="gcd", max_digits=2, max_value=30).options
