"""The code reward (program extraction, tests in the sandbox, failure kinds), HumanEval and tiny_code."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from mcore_rl.data.tasks import get_task
from mcore_rl.data.tasks.humaneval import mean_pass_at_k, pass_at_k, problems, program_of
from mcore_rl.data.tasks.tiny_code import all_problems, format_problem, checks_for
from mcore_rl.rewards import RewardInput, get_reward_fn, reward_names
from mcore_rl.rewards.code import extract_program, score_completion
from mcore_rl.rewards.sandbox import Limits

TESTS = ["assert f(1) == 4", "assert f(2) == 7", "assert f(0) == 1", "assert f(-1) == -2"]
# wait_credit: time the sandbox's processes waited for a CPU moves the wall deadline back (up to 2 x 4 s), so
# a syntax error whose interpreter was starved on a loaded machine is an "error", not a "timeout"; the
# spinning program is still one (its 2 s of CPU)
QUICK = Limits(cpu_s=2, wall_s=4, memory_mb=256, output_bytes=4096, wait_credit=2.0)


def test_extracts_fenced_or_bare_code() -> None:
    assert extract_program("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_program("```\nx = 3\n```") == "x = 3\n"
    assert extract_program("```python\nx = 4\n```\n```text\nnot code\n```") == "x = 4\n"
    assert extract_program("```python\nx = 5\ny = 6") == "x = 5\ny = 6"  # cut by the token budget
    assert extract_program("x = 7<|endoftext|>junk") == "x = 7"
    assert extract_program("  \n<|im_end|>") is None


def _score(completion: str, mode: str = "fraction", **kw) -> dict:
    return score_completion(completion, TESTS, mode=mode, template="f = {program}", limits=QUICK, **kw)


def test_reward_is_the_fraction_passed_or_all_or_nothing() -> None:
    assert _score("lambda x: 3*x+1") == {"reward": 1.0, "kind": "pass", "passed": 4, "total": 4, "detail": ""}
    half = _score("lambda x: 3*x+1 if x > 0 else 0")
    assert half["reward"] == 0.5 and half["kind"] == "wrong" and half["passed"] == 2
    assert _score("lambda x: 3*x+1 if x > 0 else 0", mode="all")["reward"] == 0.0
    assert _score("lambda x: 3*x+1", mode="all")["reward"] == 1.0
    with pytest.raises(ValueError, match="mode"):
        _score("lambda x: x", mode="most")


@pytest.mark.parametrize(
    "completion, kind",
    [
        ("lambda x: 1/0", "error"),
        ("lambda x: (", "error"),
        ("lambda x: bytearray(8 << 30)", "memory"),
        ("lambda x: [None for _ in iter(int, 1)]", "timeout"),
        ("lambda x: print('y' * 10**6)", "output"),
        ("", "no_code"),
    ],
)
def test_failure_kinds(completion: str, kind: str) -> None:
    out = _score(completion)
    assert out["reward"] == 0.0 and out["kind"] == kind, out


def test_cheating_does_not_pass() -> None:
    """Ending the run before the tests, or printing/writing fake results, scores nothing."""
    for cheat in (
        "(__import__('sys').exit(0), lambda x: x)[1]",
        "(__import__('os')._exit(0), lambda x: x)[1]",
        "(__import__('os').write(3, b'x test 0 pass -\\nx test 1 pass -\\nx done\\n'), lambda x: x)[1]",
        "(print('test 0 pass'), lambda x: x)[1]",
    ):
        out = _score(cheat)
        assert out["reward"] <= 0.25 and out["kind"] in ("error", "wrong"), (cheat, out)


def test_code_rewards_are_registered_and_read_their_label() -> None:
    assert {"code", "code_all", "humaneval", "tiny_code"} <= set(reward_names())
    label = {"tests": TESTS, "template": "f = {program}", "limits": {"wall_s": 4}}
    half = "lambda x: 3*x+1 if x > 0 else 0"
    assert get_reward_fn("code")(RewardInput("p", half, label))["reward"] == 0.5
    assert get_reward_fn("code")(RewardInput("p", half, dict(label, mode="all")))["reward"] == 0.0
    assert get_reward_fn("code_all")(RewardInput("p", half, label))["reward"] == 0.0
    assert get_reward_fn("code")(RewardInput("p", half, label), mode="all")["reward"] == 0.0  # a head's options
    slow = get_reward_fn("code")(RewardInput("p", "lambda x: __import__('time').sleep(5)", label), limits={"wall_s": 1})
    assert slow["kind"] == "timeout"
    assert get_reward_fn("tiny_code")(RewardInput("f(x)=3x", "lambda x:x*0"), mode="all")["reward"] == 0.0
    with_setup = {"tests": TESTS, "setup": "g = lambda x: 3*x+1\n"}
    assert get_reward_fn("code")(RewardInput("p", "def f(x):\n    return g(x)", with_setup))["reward"] == 1.0
    with pytest.raises(ValueError, match="tests"):
        get_reward_fn("code")(RewardInput("p", half, {"test": []}))
    with pytest.raises(ValueError, match="unknown sandbox limits"):
        get_reward_fn("code")(RewardInput("p", half, dict(label, limits={"gpu": 1})))


# --------------------------------------------------------------------------------- HumanEval


def test_humaneval_has_164_problems_and_their_canonical_solutions_pass() -> None:
    probs = problems()
    assert len(probs) == 164 and probs[0]["task_id"] == "HumanEval/0"
    fn = get_reward_fn("humaneval")
    picked = [probs[i] for i in (0, 32, 81, 129, 163)]
    with ThreadPoolExecutor(2) as pool:
        right = list(pool.map(lambda p: fn(RewardInput(p["prompt"], p["canonical_solution"], p)), picked))
        wrong = list(pool.map(lambda p: fn(RewardInput(p["prompt"], "    return None\n", p)), picked))
    assert [r["reward"] for r in right] == [1.0] * 5, right
    assert [r["reward"] for r in wrong] == [0.0] * 5 and {r["kind"] for r in wrong} <= {"wrong", "error"}


def test_humaneval_completions_as_body_or_as_a_whole_function() -> None:
    p = problems()[0]
    body = p["canonical_solution"] + "\n\ndef unrelated():\n    pass\nprint('stop here')\n"
    assert program_of(p, body) == p["prompt"] + p["canonical_solution"] + "\n"
    whole = f"```python\n{p['prompt']}{p['canonical_solution']}```"
    fn = get_reward_fn("humaneval")
    assert fn(RewardInput(p["prompt"], whole, p))["reward"] == 1.0
    assert fn(RewardInput(p["prompt"], body, p["task_id"]))["reward"] == 1.0  # label as a task_id
    assert fn(RewardInput(p["prompt"], body))["reward"] == 1.0  # no label: found by its prompt
    with pytest.raises(ValueError, match="HumanEval"):
        fn(RewardInput("def f():", body))


def test_pass_at_k_estimator() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert mean_pass_at_k({"a": [True, False], "b": [False, False]}, 1) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_humaneval_task_draws_every_problem_once_per_pass() -> None:
    task = get_task("humaneval")
    first = task.examples(164, seed=1)
    assert len({p for p, _ in first}) == 164 and first == task.examples(164, seed=1)
    assert first != task.examples(164, seed=2)
    assert [p for p, _ in task.examples(200, seed=1)][164:] == [p for p, _ in first][:36]
    prompt, label = first[0]
    assert label["prompt"] == prompt and task.reward == "humaneval"
    assert len(prompt.encode()) <= task.max_prompt_tokens()


# --------------------------------------------------------------------------------- tiny_code


def test_tiny_code_problems_are_short_and_their_answers_pass() -> None:
    task = get_task("tiny_code")
    probs = all_problems()
    assert len(probs) == len(set(probs)) and len(probs) > 150
    for spec in probs:
        ex = format_problem(*spec)
        assert len(ex["prompt"]) <= task.max_prompt_tokens() and len(ex["response"]) < task.max_answer_tokens() <= 20
    f = {}
    for spec in probs:  # the tests encode f: the reference lambda passes them (checked here in-process)
        ex = format_problem(*spec)
        exec(f"f = {ex['response']}", f)
        for t in checks_for(ex["prompt"]):
            exec(t, f)
    fn = get_reward_fn("tiny_code")
    prompt, answer = task.examples(1, seed=3)[0]
    assert fn(RewardInput(prompt, answer + "<|endoftext|>"))["reward"] == 1.0
    assert fn(RewardInput("f(x)=3x+1", "lambda x:x*3+1\nmore"))["reward"] == 1.0  # any program that computes f
    assert fn(RewardInput("f(x)=3x+1", "lambda x:3*x"))["reward"] == pytest.approx(0.0)
    assert fn(RewardInput("f(x)=3x", "lambda x:2*x+x*0"))["reward"] == pytest.approx(0.2)  # f(0) only
    assert task.score("f(x)=x^2+1", "lambda x:x*x+1") == 1.0 and task.score("f(x)=x^2+1", "lambda x:x+1") == 0.0
    with pytest.raises(ValueError, match="tiny_code"):
        fn(RewardInput("g(y)=1", "lambda y:1"))


# ------------------------------------------------------------------ programs that try to forge a reward
# Each earned a reward it did not solve for when the program and the tests shared one interpreter and
# one reporting channel (checked against that design); the checker (mcore_rl/rewards/checker.py) must
# score each as the wrong answer it is. Tests: f(x) = 3x + 1; `abs` is the checker's own.

FORGE_TESTS = ["assert f(1) == 4", "assert f(2) == 7", "assert abs(f(0) - 1) < 1e-9", "assert f(-1) == -2"]
FORGERS = {
    # every forked copy ran the tests and reported: 2 right answers counted twice -> 1.0
    "fork_duplicates_reports": (
        """
import os
pid = os.fork()
if pid:
    os.waitpid(pid, 0)
def f(x):
    return 3 * x + 1 if x > 0 else 0
""",
        0.5,
    ),
    "patch_os_write": (
        """
import os
_write = os.write
os.write = lambda fd, data: _write(fd, data.replace(b" wrong ", b" pass ").replace(b"AssertionError", b"-"))
def f(x):
    return 0
""",
        0.0,
    ),
    "patch_builtins_compile": (
        """
import builtins
_compile = builtins.compile
builtins.compile = lambda src, name, mode, *a, **k: _compile("pass" if name.startswith("test") else src, name, mode)
def f(x):
    return 0
""",
        0.0,
    ),
    "patch_builtins_exec": (
        """
import builtins
builtins.exec = lambda *a, **k: None
def f(x):
    return 0
""",
        0.0,
    ),
    "frame_walk_for_the_token": (
        """
import os, sys
frame = sys._getframe()
while frame is not None and "token" not in frame.f_locals:
    frame = frame.f_back
token, n = frame.f_locals["token"], len(frame.f_locals["tests"])
lines = [f"{token} program ok -"] + [f"{token} test {i} pass -" for i in range(n)] + [f"{token} done"]
os.write(3, ("\\n".join(lines) + "\\n").encode())
os._exit(0)
""",
        0.0,
    ),
    "gc_finds_the_job": (
        """
import gc, os, re
for o in gc.get_objects():
    if type(o) is dict and "source" in o and "limits" in o:
        token = re.search(r"_mcore_harness\\('([0-9a-f]{32})'", o["source"]).group(1)
        n = len(re.search(r", (\\[.*\\])\\)\\n$", o["source"]).group(1).split("', '"))
        lines = [f"{token} program ok -"] + [f"{token} test {i} pass -" for i in range(n)] + [f"{token} done"]
        os.write(3, ("\\n".join(lines) + "\\n").encode())
        os._exit(0)
def f(x):
    return 0
""",
        0.0,
    ),
    "always_equal_int_subclass": (
        """
class Yes(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
def f(x):
    return Yes(0)
""",
        0.0,
    ),
    "always_equal_object": (
        """
class Yes:
    def __eq__(self, other):
        return True
    def __sub__(self, other):
        return 0
def f(x):
    return Yes()
""",
        0.0,
    ),
    "shadows_a_builtin_the_tests_use": (
        """
def abs(x):
    return 0
def f(x):
    return 0
""",
        0.0,
    ),
    # (against the checker's own protocol: replies sent before any request, out of turn)
    "fake_replies_on_the_channel": (
        """
import os
os.write(3, b'{"loaded":true}\\n' + b''.join(b'{"id":%d,"value":4}\\n' % i for i in range(1, 9)))
def f(x):
    return 0
""",
        0.0,
    ),
}


@pytest.mark.parametrize("name", sorted(FORGERS))
def test_programs_cannot_forge_passes(name: str) -> None:
    program, honest = FORGERS[name]
    out = score_completion(f"```python\n{program}```", FORGE_TESTS, limits=QUICK)
    assert out["reward"] == honest and out["passed"] <= out["total"], out


def test_an_exception_that_steers_iteration_does_not_pass() -> None:
    """StopIteration out of the candidate inside `all(map(...))` ended the iteration: the test passed."""
    stop = "```python\ndef f(x):\n    raise StopIteration\n```"
    out = score_completion(stop, ["assert all(map(lambda x: f(x) == 3 * x + 1, [1, 2]))"], limits=QUICK)
    assert out["reward"] == 0.0 and out["kind"] == "error", out


def test_a_run_that_ends_in_error_scores_nothing_it_answered() -> None:
    ends_badly = (
        "```python\nimport os\n_read = os.read\n"
        "os.read = lambda fd, n: _read(fd, n) or os._exit(3)\n"  # exit 3 once the checker is done
        "def f(x):\n    return 3 * x + 1\n```"
    )
    out = score_completion(ends_badly, FORGE_TESTS, limits=QUICK)
    assert out["reward"] == 0.0 and out["kind"] == "error" and "exit status 3" in out["detail"], out


def test_each_test_counts_once_and_the_score_stays_in_range() -> None:
    forked = "```python\nimport os\nos.fork()\ndef f(x):\n    return 3 * x + 1\n```"
    assert score_completion(forked, FORGE_TESTS, limits=QUICK)["reward"] == 1.0  # not 2.0


def test_the_humaneval_reward_is_judged_outside_the_program() -> None:
    fn = get_reward_fn("humaneval")
    p0, p38 = problems()[0], problems()[38]
    patched = (
        "```python\nimport builtins\n_compile = builtins.compile\n"
        "builtins.compile = lambda s, n, m, *a, **k: _compile('pass' if n.startswith('test') else s, n, m)\n"
        "def has_close_elements(numbers, threshold):\n    return False\n```"
    )
    assert fn(RewardInput(p0["prompt"], patched, p0))["reward"] == 0.0
    # check(decode_cyclic) encodes with the prompt's encode_cyclic: redefining it in the program must not count
    helper = "```python\nencode_cyclic = lambda s: s\ndef decode_cyclic(s: str):\n    return s\n```"
    assert fn(RewardInput(p38["prompt"], helper, p38))["reward"] == 0.0
    assert fn(RewardInput(p38["prompt"], p38["canonical_solution"], p38))["reward"] == 1.0


def test_plain_data_crosses_and_nothing_else() -> None:
    """What a candidate may return: exact built-in types, rebuilt as ours; the checker's own values
    for every kind; a non-data answer fails the test that called it."""
    from mcore_rl.rewards.candidate import WireError, from_wire, to_wire

    values = [
        None,
        True,
        0,
        -(10**30),
        1.5,
        float("inf"),
        "é",
        b"\x00",
        [1, (2, 3)],
        {"a": {1, 2}},
        frozenset({4}),
        1 + 2j,
        {(1, 2): [None]},
    ]
    for v in values:
        back = from_wire(json.loads(json.dumps(to_wire(v))))
        assert back == v and type(back) is type(v)
    assert from_wire(json.loads(json.dumps(to_wire(float("nan"))))) != from_wire({"nan": 1})  # still a NaN
    for bad in (True.__class__.__mro__[1].__subclasses__, object(), type("I", (int,), {})(3)):
        with pytest.raises(WireError):
            to_wire(bad)
    for forged in ({"__class__": "x"}, {"t": 1}, {"s": [[1]]}, {"d": [[[], 1]]}, {"t": [], "s": []}):
        with pytest.raises(WireError):
            from_wire(forged)
    tests = ["assert f(1) == (1, [2], {'k': {3}})", "assert f(0) is None", "assert isinstance(f(2), int)"]
    ok = "```python\ndef f(x):\n    return [None, (1, [2], {'k': {3}}), 5][x]\n```"
    assert score_completion(ok, tests, limits=QUICK)["reward"] == 1.0
    gen = "```python\ndef f(x):\n    return (i for i in range(x))\n```"
    out = score_completion(gen, ["assert list(f(2)) == [0, 1]"], limits=QUICK)
    assert out["reward"] == 0.0 and out["kind"] == "error" and "not plain data" in out["detail"], out


def test_the_code_label_gives_the_checker_its_context_and_entry_points() -> None:
    label = {
        "tests": ["assert g(2) == double(2)", "assert g(3) == double(3)"],
        "context": "def double(x):\n    return 2 * x\ndef g(x):\n    return 2 * x\n",
        "entry_points": ["g"],
        "limits": {"wall_s": 4},
    }
    fn = get_reward_fn("code")
    assert fn(RewardInput("p", "```python\ndef g(x):\n    return x + x\n```", label))["reward"] == 1.0
    # the context's g is a stub the entry point replaces; its double is the tests' own
    cheat = "```python\ndef double(x):\n    return 0\ndef g(x):\n    return 0\n```"
    assert fn(RewardInput("p", cheat, label))["reward"] == 0.0
    missing = fn(RewardInput("p", "```python\nh = 1\n```", label))
    assert missing["reward"] == 0.0 and missing["kind"] == "error" and "NameError" in missing["detail"], missing
