"""Instruction-following verifiers, the AutoIF filters and reward, and the word_format task."""

from __future__ import annotations

import pytest

from mcore_rl.data.tasks import get_task
from mcore_rl.data.tasks.word_format import FORMATS, constraints_for, format_example
from mcore_rl.rewards import RewardInput, get_reward_fn
from mcore_rl.rewards.instruction_following import (
    check,
    count_sentences,
    cross_validate,
    keep_response,
    preference_pairs,
    response_score,
    run_verifiers,
    satisfied,
)

TEXT = "Hello world. This is a test! Is it?\n\nSecond paragraph here"


@pytest.mark.parametrize(
    "constraint, ok",
    [
        ({"type": "words", "min": 10, "max": 11}, True),
        ({"type": "words", "max": 9}, False),
        ({"type": "sentences", "count": 4}, True),
        ({"type": "chars", "min": len(TEXT)}, True),
        ({"type": "chars", "max": 10}, False),
        ({"type": "paragraphs", "count": 2}, True),
        ({"type": "starts_with", "text": "Hello"}, True),
        ({"type": "ends_with", "text": "here"}, True),
        ({"type": "ends_with", "text": "."}, False),
        ({"type": "include", "words": ["hello", "TEST"]}, True),
        ({"type": "include", "words": ["tes"]}, False),  # whole words only
        ({"type": "exclude", "words": ["banana"]}, True),
        ({"type": "exclude", "words": ["world"]}, False),
        ({"type": "frequency", "word": "is", "count": 2}, True),
        ({"type": "frequency", "word": "is", "min": 3}, False),
        ({"type": "no_commas"}, True),
        ({"type": "case", "case": "lower"}, False),
    ],
)
def test_verifiers_on_one_text(constraint: dict, ok: bool) -> None:
    assert check(TEXT, constraint) is ok


def test_format_verifiers() -> None:
    bullets = "Intro\n- one\n* two\n1. three\nnot -a bullet"
    assert check(bullets, {"type": "bullets", "count": 3})
    assert check("SECTION 1\nx\nSECTION 2\ny", {"type": "sections", "marker": "SECTION", "count": 2})
    assert check("# A\n## B\ntext", {"type": "sections", "marker": "#", "min": 2})
    assert check("Dear [name], at [address]", {"type": "placeholders", "count": 2})
    assert check("ALL CAPS 123!", {"type": "case", "case": "upper"}) and not check(
        "Mixed", {"type": "case", "case": "upper"}
    )
    assert check("Title Case Words", {"type": "case", "case": "title"})
    assert check('"quoted text"', {"type": "quoted"}) and not check('"half', {"type": "quoted"})
    assert count_sentences("") == 0 and count_sentences("No end") == 1 and count_sentences("3.5 is. Two!") == 2


def test_json_verifier() -> None:
    assert check('{"a": 1, "b": [2]}', {"type": "json", "keys": ["a", "b"]})
    assert not check('{"a": 1}', {"type": "json", "keys": ["a", "b"]})
    assert check('Here it is:\n```json\n{"a": 1}\n```', {"type": "json", "kind": "object"})
    assert not check("{'a': 1}", {"type": "json"})  # Python, not JSON
    assert check("[1, 2]", {"type": "json", "kind": "array"}) and not check(
        "[1, 2]", {"type": "json", "kind": "object"}
    )


def test_bad_constraints_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown constraint type 'shout'"):
        check("x", {"type": "shout"})
    with pytest.raises(ValueError, match="'words': bad parameters"):
        check("x", {"type": "words", "at_least": 3})


def test_instruction_following_reward_fraction_or_all() -> None:
    fn = get_reward_fn("instruction_following")
    constraints = [
        {"type": "words", "max": 5},
        {"type": "include", "words": ["cat"]},
        {"type": "no_commas"},
        {"type": "ends_with", "text": "!"},
    ]
    out = fn(RewardInput("p", "the cat, it sat<|endoftext|>ignored!", constraints))
    assert out["reward"] == 0.5 and out["failed"] == ["no_commas", "ends_with"]
    assert fn(RewardInput("p", "the cat sat!", {"constraints": constraints, "mode": "all"}))["reward"] == 1.0
    assert fn(RewardInput("p", "the cat sat", {"constraints": constraints, "mode": "all"}))["reward"] == 0.0
    assert fn(RewardInput("p", "the cat sat", constraints), mode="all")["reward"] == 0.0  # a head's option
    with pytest.raises(ValueError):
        fn(RewardInput("p", "x", {"rules": []}))


# ------------------------------------------------------------------------------------- AutoIF


def test_cross_validation_keeps_rows_and_columns_above_half_strictly() -> None:
    passes = [
        [1, 1, 1, 0],  # 0.75: kept
        [1, 1, 0, 0],  # 0.5: dropped (strict)
        [1, 0, 0, 0],  # 0.25: dropped
        [1, 1, 1, 1],  # kept
    ]
    funcs, cases = cross_validate([[bool(x) for x in row] for row in passes])
    assert funcs == [0, 3]
    assert cases == [0, 1]  # column means 1.0, 0.75, 0.5 (dropped), 0.25
    assert cross_validate([[True, False], [False, True]]) == ([], [])  # no pair survives: instruction dropped
    assert cross_validate([[False, False, False]]) == ([], [])


def test_response_score_is_the_mean_and_half_is_rejected() -> None:
    assert response_score([True, True, False]) == pytest.approx(2 / 3) and keep_response(2 / 3)
    assert response_score([True, False]) == 0.5 and not keep_response(0.5)
    assert not keep_response(response_score([]))


def test_preference_pairs_never_use_the_middle() -> None:
    scores = [1.0, 0.5, 0.0, 0.75, 0.25, 0.0]
    pairs = preference_pairs(scores)
    assert set(pairs) == {(0, 2), (0, 5), (3, 2), (3, 5)}
    used = {i for pair in pairs for i in pair}
    assert not used & {i for i, s in enumerate(scores) if 0 < s <= 0.5}


def test_dpo_loss_is_log_2_at_the_reference_and_moves_chosen_up_rejected_down() -> None:
    import math

    import torch

    from mcore_rl.algos import get

    dpo = get("preference", "dpo")
    logp = torch.tensor([-3.0, -7.5, -1.2])
    loss = dpo(logp, logp - 1, logp, logp - 1, beta=0.5)
    assert torch.allclose(loss, torch.full((3,), math.log(2)))
    chosen = torch.tensor([-2.0, -4.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -1.0], requires_grad=True)
    dpo(chosen, rejected, torch.tensor([-2.5, -3.0]), torch.tensor([-2.0, -2.0]), beta=0.1).sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()  # descent raises log π(y_w), lowers log π(y_l)


def test_verification_functions_run_in_the_sandbox() -> None:
    functions = [
        "def evaluate(response):\n    return len(response.split()) <= 5",
        "def evaluate(response):\n    return response.endswith('!')",
        "def evaluate(response):\n    return 1 / 0",  # raises: False
        "def evaluate(response):\n    while True: pass",  # hangs: False, and the others still count
        "import os\ndef evaluate(response):\n    return os.path.exists('/etc/passwd') or 'yes'",  # not True: False
    ]
    from mcore_rl.rewards.sandbox import Limits

    assert run_verifiers("so short!", functions, Limits(cpu_s=1, wall_s=3)) == [True, True, False, False, False]
    fn = get_reward_fn("autoif")
    out = fn(RewardInput("p", "so short!", {"functions": functions[:3]}))
    assert out["reward"] == pytest.approx(2 / 3) and out["kept"] is True
    assert satisfied("hi", [{"type": "python", "code": functions[0]}, {"type": "chars", "max": 1}]) == [True, False]


# -------------------------------------------------------------------------------- word_format


def test_word_format_task_answers_satisfy_their_prompts_and_near_misses_score_partly() -> None:
    task = get_task("word_format")
    fn = get_reward_fn(task.reward)
    for prompt, answer in task.examples(60, seed=0):
        assert len(prompt) <= task.max_prompt_tokens() and len(answer) < task.max_answer_tokens() <= 21
        assert fn(RewardInput(prompt, answer + "<|endoftext|>"))["reward"] == 1.0 and task.score(prompt, answer) == 1.0
    assert {p.split(":")[0] for p, _ in task.examples(60, seed=0)} == set(FORMATS)
    near = fn(RewardInput("up:cat dog", "cat dog"))  # right words, wrong case
    assert 0 < near["reward"] < 1 and near["failed"] == ["case"]
    assert fn(RewardInput("up:cat dog", "cat dog"), mode="all")["reward"] == 0.0
    assert fn(RewardInput("list:cat dog", "- cat\n- dog\n- sun"))["reward"] < 1
    assert fn(RewardInput("json:cat", '["cat"'))["failed"] == ["json"]
    ex = format_example("quote", ["owl", "fig"])
    assert ex == {"prompt": "quote:owl fig", "response": '"owl fig"'}
    with pytest.raises(ValueError, match="word_format prompt"):
        constraints_for("shout:cat")
