"""The py_func code task: its problem space, its hidden tests, and its reward in the sandbox.

What is checked: every problem is distinct, names its function and signature and asks for a fenced
block; no single output answers more than half of a problem's tests (a constant program fails);
the reference program passes its tests (all problems in-process, a sample through the sandbox) and
a wrong one does not; programs that try to forge their result (print "PASS", exit(0) before the
tests, patch builtins, raise SystemExit in the call) score 0; a hang is killed at the time limit and
costs only its own sample; the fenced block is what runs; draws do not repeat a problem until the
space is used up; a domain refuses unknown templates naming the key.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest

from mcore_rl.config import RLConfig, load_config, validate_rl_config
from mcore_rl.data.tasks import get_task
from mcore_rl.data.tasks.py_func import TEMPLATES, all_problems, num_problems, py_func_reward
from mcore_rl.rewards import RewardInput, get_reward_fn
from tests.helpers import cfg_of, errors_of, recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a Python function `count_e(s)` that returns how many times the letter 'e' appears in the string s."


def _problem(name: str):
    return next(p for p in all_problems() if p.entry_point == name)


def _fenced(code: str, prose: str = "Here is the function:\n") -> str:
    return f"{prose}```python\n{code}\n```\nIt counts the letters.<|im_end|>"


def test_problems_are_distinct_and_state_their_function() -> None:
    probs = all_problems()
    assert len(probs) == num_problems() == len({p.prompt for p in probs}) == len({p.entry_point for p in probs})
    assert len(TEMPLATES) >= 30 and len(probs) >= 250
    for p in probs:
        assert f"`{p.entry_point}(" in p.prompt and p.prompt.endswith("Put the code in a ```python block.")
        assert len(p.tests) == 6 and all(t.startswith(f"assert {p.entry_point}(") for t in p.tests)
        outputs = Counter(t.rsplit(" == ", 1)[1] for t in p.tests)
        assert max(outputs.values()) <= 3, (p.entry_point, p.tests)  # a constant program fails
        ns: dict = {}
        exec(p.solution.split("```python\n", 1)[1].rsplit("```", 1)[0], ns)  # the reference passes
        for t in p.tests:
            exec(t, ns)
    assert all_problems() == tuple(all_problems())  # the same tests every time (seeded by the prompt)


def test_draws_do_not_repeat_until_the_space_is_used_up() -> None:
    task = get_task("py_func", templates=["count_char", "add"])
    n = len(task.problems())
    assert n == len(TEMPLATES[[t.key for t in TEMPLATES].index("count_char")].constants) + 29
    prompts = [q for q, _ in task.rl_examples(n, seed=5)]
    assert len(set(prompts)) == n
    assert [q for q, _ in task.rl_examples(n, seed=5)] == prompts and prompts != [q for q, _ in task.rl_examples(n, 6)]
    more = [q for q, _ in task.rl_examples(n + 3, seed=5)]
    assert more[:n] == prompts and set(more[n:]) <= set(prompts)
    with pytest.raises(ValueError, match="unknown py_func templates"):
        get_task("py_func", templates=["sorting_networks"])


def test_reward_of_right_wrong_and_partial_programs() -> None:
    p = _problem("count_e")
    fn = get_reward_fn("py_func")
    right = _fenced("def count_e(s):\n    return s.count('e')")
    assert fn(RewardInput(p.prompt, right, p.label()))["reward"] == 1.0
    assert fn(RewardInput(p.prompt, right))["reward"] == 1.0  # without a label the prompt finds the problem
    assert fn(RewardInput(p.prompt, p.solution, p.label()))["reward"] == 1.0  # the warm start's target
    wrong = _fenced("def count_e(s):\n    return s.count('e') + (len(s) > 3)")
    out = fn(RewardInput(p.prompt, wrong, p.label()))
    assert out["reward"] == 0.0 and out["kind"] == "wrong" and 0 < out["passed"] < out["total"]
    partial = py_func_reward(RewardInput(p.prompt, wrong, p.label()), mode="fraction")
    assert partial["reward"] == pytest.approx(out["passed"] / 6) and 0 < partial["reward"] < 1
    renamed = _fenced("def count(s):\n    return s.count('e')")
    assert fn(RewardInput(p.prompt, renamed, p.label()))["reward"] == 0.0  # the named function is what is tested
    assert get_task("py_func").score(p.prompt, right) == 1.0
    with pytest.raises(ValueError, match="not a py_func problem"):
        fn(RewardInput(PROMPT + " Now.", right))


def test_the_fenced_block_is_what_runs() -> None:
    p = _problem("count_e")
    code = "def count_e(s):\n    return s.count('e')"
    decoy = "```text\ndef count_e(s):\n    return 0\n```\n"
    for completion in (
        _fenced(code),
        decoy + _fenced(code),  # the python block, not the last block
        "```python\ndef count_e(s):\n    return 0\n```\nFixed:\n" + _fenced(code),  # the last python block
        "```python\n" + code,  # cut by the token budget before the closing fence
        code,  # bare code
    ):
        assert py_func_reward(RewardInput(p.prompt, completion, p.label()))["reward"] == 1.0, completion
    assert py_func_reward(RewardInput(p.prompt, "I cannot write code.<|im_end|>", p.label()))["reward"] == 0.0


@pytest.mark.parametrize(
    "program",
    [
        "print('PASS')\nprint('6/6 tests passed')\ndef count_e(s):\n    return -1",
        "import sys\nsys.exit(0)\ndef count_e(s):\n    return s.count('e')",
        "import os\nos._exit(0)",
        "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n"
        "builtins.exec = lambda *a, **k: None\ndef count_e(s):\n    return -1",
        "def count_e(s):\n    raise SystemExit(0)",
        "class Yes(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
        "def count_e(s):\n    return Yes(-1)",
    ],
    ids=["prints_pass", "exits_before_tests", "os_exit", "patches_builtins", "raises_systemexit", "always_equal"],
)
def test_programs_that_forge_their_result_score_zero(program: str) -> None:
    p = _problem("count_e")
    out = py_func_reward(RewardInput(p.prompt, _fenced(program), p.label()), mode="fraction")
    assert out["reward"] == 0.0, out


def test_a_hang_costs_its_own_sample_only() -> None:
    from concurrent.futures import ThreadPoolExecutor

    p = _problem("count_e")
    hang = _fenced("def count_e(s):\n    while True:\n        pass")
    right = _fenced("def count_e(s):\n    return s.count('e')")
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda c: py_func_reward(RewardInput(p.prompt, c, p.label())), [hang, right]))
    assert outs[0]["reward"] == 0.0 and outs[0]["kind"] == "timeout" and outs[1]["reward"] == 1.0
    assert time.monotonic() - t0 < 30  # killed at the limit (cpu 2 s, wall 5 s), not left running


def test_reference_programs_pass_in_the_sandbox() -> None:
    task = get_task("py_func")
    for prompt, answer in task.examples(6, seed=1):
        assert task.score(prompt, answer) == 1.0, prompt


def test_a_domain_names_the_task_and_refuses_unknown_templates(tmp_path) -> None:
    tmp = str(tmp_path)
    data = recipe(tmp)
    data["data"]["domains"][1].update(task="py_func", options={"templates": ["count_char"]})
    data["data"]["domains"][1].pop("rewards", None)
    validate_rl_config(cfg_of(tmp, data, "train.seq_length=256", "model.max_position_embeddings=256"), 1)
    data["data"]["domains"][1]["options"] = {"templates": ["nope"]}
    assert "data.domains[1].options: domain 'fmt': the task refuses its options" in errors_of(cfg_of(tmp, data))
    real = load_config(RLConfig, os.path.join(ROOT, "configs", "smollm2_reasoning_code.yaml"))
    validate_rl_config(real, 1)
    assert [d.name for d in real.data.domains] == ["products", "chain_sum", "gcd", "py_func"]
