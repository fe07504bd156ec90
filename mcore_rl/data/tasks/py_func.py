"""Short Python functions from one-line specs: a code task a 135M chat model can partly solve.

    prompt  "Write a Python function `count_char_e(s)` that returns how many times the letter 'e'
             appears in the string s. Put the code in a ```python block."
    label   {"entry_point": "count_char_e", "tests": ["assert count_char_e('tree') == 2", ...]}

Templates of list, string and number operations (`TEMPLATES`), each with varied constants in its
name and spec; `all_problems()` lists every distinct problem (`num_problems()`; `examples` draws
without repeats until the space is used up). Each problem carries hidden unit tests: inputs drawn
from a generator seeded by the prompt text (so a prompt always has the same tests), outputs
computed by the template's reference implementation, edge cases (empty list, zero, negatives)
included where the spec defines them.

The reward "py_func" runs the completion's program (the last ```python block, `rewards/code.py`)
in the sandbox and the tests in the checker outside it (`rewards/checker.py`), so a program that
prints "PASS", exits early or patches builtins scores 0. It is all-or-nothing by default
(`mode: fraction` for the share of tests passed): a constant `return True` passes half of a
predicate's tests, and the fraction would pay for it, while the measure to move, HumanEval
pass@1, is all-or-nothing too. A program that hangs is killed at the time limit and scores 0.
"""

from __future__ import annotations

import random
import string
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from mcore_rl.data.tasks import register_task
from mcore_rl.rewards import RewardInput, register_reward
from mcore_rl.rewards.code import MODES, score_completion
from mcore_rl.rewards.sandbox import Limits

LIMITS = Limits(cpu_s=2, wall_s=5, memory_mb=256, nproc=8, output_bytes=4096)
NUM_TESTS = 6
INSTRUCTION = "Put the code in a ```python block."

Rng = random.Random
Gen = Callable[[Rng], tuple]  # one test's arguments


def _ints(lo: int, hi: int) -> Gen:
    return lambda r: (r.randint(lo, hi),)


def _int_list(lo: int, hi: int, min_len: int = 0, max_len: int = 7) -> Gen:
    return lambda r: ([r.randint(lo, hi) for _ in range(r.randint(min_len, max_len))],)


def _word(r: Rng, alphabet: str = string.ascii_lowercase, lo: int = 0, hi: int = 8) -> str:
    return "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))


def _words(lo: int = 0, hi: int = 8, alphabet: str = string.ascii_lowercase) -> Gen:
    return lambda r: (_word(r, alphabet, lo, hi),)


def _sentence(r: Rng) -> tuple:
    return (" ".join(_word(r, "abcdeilnorst", 1, 6) for _ in range(r.randint(1, 5))),)


@dataclass(frozen=True)
class Template:
    """One kind of problem: `name` and `spec` are format strings over the constant `k` (and `c`),
    `args` the signature, `ref(k)` the reference implementation, `gen` one test's arguments,
    `edge` arguments every problem of the template is tested on."""

    key: str
    name: str
    args: str
    spec: str
    constants: tuple[Any, ...]
    ref: Callable[[Any], Callable[..., Any]]
    gen: Gen
    edge: tuple[tuple, ...] = ()


VOWELS = "aeiou"
_LETTERS = "abcdeilnorst"
_NUMS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}

TEMPLATES: tuple[Template, ...] = (
    # numbers
    Template(
        "add",
        "add_{k}",
        "x",
        "returns x plus {k}",
        tuple(range(2, 31)),
        lambda k: lambda x: x + k,
        _ints(-50, 50),
        ((0,),),
    ),
    Template(
        "times",
        "times_{k}",
        "x",
        "returns x multiplied by {k}",
        tuple(range(2, 21)),
        lambda k: lambda x: x * k,
        _ints(-30, 30),
        ((0,),),
    ),
    Template(
        "square_plus",
        "square_plus_{k}",
        "x",
        "returns the square of x plus {k}",
        tuple(range(1, 21)),
        lambda k: lambda x: x * x + k,
        _ints(-12, 12),
        ((0,),),
    ),
    Template(
        "divisible",
        "is_divisible_by_{k}",
        "n",
        "returns True if n is divisible by {k} and False otherwise",
        tuple(range(2, 13)),
        lambda k: lambda n: n % k == 0,
        lambda r: (r.randint(0, 60),),
        ((0,), (1,)),
    ),
    Template(
        "power",
        "power_{k}",
        "x",
        "returns x raised to the power {k}",
        (2, 3, 4, 5),
        lambda k: lambda x: x**k,
        _ints(-6, 6),
        ((0,), (1,)),
    ),
    Template(
        "clamp",
        "clamp_0_{k}",
        "x",
        "returns x limited to the range 0 to {k}: 0 if x is below 0, {k} if x is above {k}, else x",
        tuple(range(5, 101, 5)),
        lambda k: lambda x: min(max(x, 0), k),
        _ints(-20, 120),
        ((-1,), (0,)),
    ),
    Template(
        "sum_to",
        "sum_to_n",
        "n",
        "returns the sum of the integers from 1 to n",
        (None,),
        lambda k: lambda n: n * (n + 1) // 2,
        _ints(1, 100),
        ((1,),),
    ),
    Template(
        "digit_sum",
        "digit_sum",
        "n",
        "returns the sum of the decimal digits of the non-negative integer n",
        (None,),
        lambda k: lambda n: sum(map(int, str(n))),
        _ints(0, 99999),
        ((0,), (7,)),
    ),
    Template(
        "max3",
        "max_of_three",
        "a, b, c",
        "returns the largest of the three numbers a, b and c",
        (None,),
        lambda k: lambda a, b, c: max(a, b, c),
        lambda r: tuple(r.randint(-20, 20) for _ in range(3)),
    ),
    Template(
        "factorial",
        "factorial",
        "n",
        "returns n factorial (n! with 0! = 1)",
        (None,),
        lambda k: lambda n: _fact(n),
        _ints(0, 10),
        ((0,), (1,)),
    ),
    # lists of integers
    Template(
        "sum_list",
        "sum_list",
        "nums",
        "returns the sum of the numbers in the list nums",
        (None,),
        lambda k: lambda xs: sum(xs),
        _int_list(-20, 20),
        (([],),),
    ),
    Template(
        "count_greater",
        "count_greater_than_{k}",
        "nums",
        "returns how many numbers in the list nums are greater than {k}",
        tuple(range(0, 21)),
        lambda k: lambda xs: sum(x > k for x in xs),
        _int_list(-5, 30),
        (([],),),
    ),
    Template(
        "filter_greater",
        "keep_greater_than_{k}",
        "nums",
        "returns a list of the numbers in nums that are greater than {k}, in their original order",
        tuple(range(0, 21)),
        lambda k: lambda xs: [x for x in xs if x > k],
        _int_list(-5, 30),
        (([],),),
    ),
    Template(
        "evens",
        "even_numbers",
        "nums",
        "returns a list of the even numbers in nums, in their original order",
        (None,),
        lambda k: lambda xs: [x for x in xs if x % 2 == 0],
        _int_list(-20, 20),
        (([],),),
    ),
    Template(
        "scale_list",
        "multiply_all_by_{k}",
        "nums",
        "returns a new list with every number in nums multiplied by {k}",
        tuple(range(2, 11)),
        lambda k: lambda xs: [x * k for x in xs],
        _int_list(-20, 20),
        (([],),),
    ),
    Template(
        "add_list",
        "add_{k}_to_all",
        "nums",
        "returns a new list with {k} added to every number in nums",
        tuple(range(1, 21)),
        lambda k: lambda xs: [x + k for x in xs],
        _int_list(-20, 20),
        (([],),),
    ),
    Template(
        "count_value",
        "count_{k}s",
        "nums",
        "returns how many times the number {k} appears in the list nums",
        tuple(range(0, 10)),
        lambda k: lambda xs: xs.count(k),
        _int_list(0, 9, 0, 10),
        (([],),),
    ),
    Template(
        "max_list",
        "largest",
        "nums",
        "returns the largest number in the non-empty list nums",
        (None,),
        lambda k: lambda xs: max(xs),
        _int_list(-50, 50, 1, 8),
    ),
    Template(
        "min_list",
        "smallest",
        "nums",
        "returns the smallest number in the non-empty list nums",
        (None,),
        lambda k: lambda xs: min(xs),
        _int_list(-50, 50, 1, 8),
    ),
    Template(
        "sum_squares",
        "sum_of_squares",
        "nums",
        "returns the sum of the squares of the numbers in nums",
        (None,),
        lambda k: lambda xs: sum(x * x for x in xs),
        _int_list(-10, 10),
        (([],),),
    ),
    Template(
        "first_k",
        "first_{k}",
        "items",
        "returns a list of the first {k} elements of the list items (all of them if it has fewer)",
        tuple(range(1, 8)),
        lambda k: lambda xs: xs[:k],
        _int_list(0, 99, 0, 10),
        (([],),),
    ),
    Template(
        "remove_value",
        "remove_{k}s",
        "nums",
        "returns a new list of the numbers in nums without any {k}, in their original order",
        tuple(range(0, 10)),
        lambda k: lambda xs: [x for x in xs if x != k],
        _int_list(0, 9, 0, 10),
        (([],),),
    ),
    Template(
        "sort_desc",
        "sort_descending",
        "nums",
        "returns the numbers of nums sorted from largest to smallest",
        (None,),
        lambda k: lambda xs: sorted(xs, reverse=True),
        _int_list(-20, 20),
        (([],),),
    ),
    Template(
        "reverse_list",
        "reverse_list",
        "items",
        "returns the list items in reverse order",
        (None,),
        lambda k: lambda xs: xs[::-1],
        _int_list(0, 99),
        (([],),),
    ),
    Template(
        "count_even",
        "count_even",
        "nums",
        "returns how many even numbers are in the list nums",
        (None,),
        lambda k: lambda xs: sum(x % 2 == 0 for x in xs),
        _int_list(-20, 20),
        (([],),),
    ),
    # strings
    Template(
        "count_vowels",
        "count_vowels",
        "s",
        "returns the number of vowels (a, e, i, o, u) in the lowercase string s",
        (None,),
        lambda k: lambda s: sum(ch in VOWELS for ch in s),
        _words(),
        (("",),),
    ),
    Template(
        "count_char",
        "count_{k}",
        "s",
        "returns how many times the letter '{k}' appears in the string s",
        tuple(_LETTERS),
        lambda k: lambda s: s.count(k),
        _words(0, 10, _LETTERS),
        (("",),),
    ),
    Template(
        "reverse_string",
        "reverse_string",
        "s",
        "returns the string s reversed",
        (None,),
        lambda k: lambda s: s[::-1],
        _words(),
        (("",),),
    ),
    Template(
        "palindrome",
        "is_palindrome",
        "s",
        "returns True if the string s reads the same forwards and backwards, False otherwise",
        (None,),
        lambda k: lambda s: s == s[::-1],
        lambda r: _palindromic(r),
        (("",), ("a",)),
    ),
    Template(
        "repeat",
        "repeat_{k}_times",
        "s",
        "returns the string s repeated {k} times",
        tuple(range(2, 11)),
        lambda k: lambda s: s * k,
        _words(0, 4),
        (("",),),
    ),
    Template(
        "upper",
        "shout",
        "s",
        "returns the string s in upper case with an exclamation mark added at the end",
        (None,),
        lambda k: lambda s: s.upper() + "!",
        _words(),
        (("",),),
    ),
    Template(
        "first_chars",
        "first_{k}_chars",
        "s",
        "returns the first {k} characters of the string s (all of it if it is shorter)",
        tuple(range(1, 8)),
        lambda k: lambda s: s[:k],
        _words(0, 10),
        (("",),),
    ),
    Template(
        "word_count",
        "count_words",
        "s",
        "returns the number of words in the string s (words are separated by single spaces)",
        (None,),
        lambda k: lambda s: len(s.split()),
        _sentence,
    ),
    Template(
        "replace_char",
        "replace_{k}",
        "s",
        "returns the string s with every letter '{k}' replaced by '*'",
        tuple(_LETTERS),
        lambda k: lambda s: s.replace(k, "*"),
        _words(0, 10, _LETTERS),
        (("",),),
    ),
    Template(
        "suffix",
        "add_suffix_{k}",
        "s",
        "returns the string s followed by '{k}'",
        ("ing", "ed", "er", "s", "ly", "ness", "ful", "less"),
        lambda k: lambda s: s + k,
        _words(1, 6),
    ),
    Template(
        "starts_with",
        "starts_with_{k}",
        "s",
        "returns True if the string s starts with the letter '{k}', False otherwise",
        tuple(_LETTERS),
        lambda k: lambda s: s.startswith(k),
        lambda r: _words(0, 6, _LETTERS)(r),
        (("",),),
    ),
)


def _fact(n: int) -> int:
    out = 1
    for i in range(2, n + 1):
        out *= i
    return out


def _palindromic(r: Rng) -> tuple:
    half = _word(r, "abc", 1, 4)
    return ((half + half[::-1][r.randint(0, 1) :]) if r.random() < 0.5 else _word(r, "abc", 2, 6),)


@dataclass(frozen=True)
class Problem:
    prompt: str
    entry_point: str
    tests: tuple[str, ...]
    solution: str  # a reference program (the SFT target)

    def label(self) -> dict[str, Any]:
        return {"entry_point": self.entry_point, "tests": list(self.tests)}


def make_problem(template: Template, k: Any) -> Problem:
    """The problem of `template` with constant `k`; its tests are seeded by its prompt text."""
    name = template.name.format(k=k)
    prompt = f"Write a Python function `{name}({template.args})` that {template.spec.format(k=k)}. {INSTRUCTION}"
    f = template.ref(k)
    r = random.Random(zlib.crc32(prompt.encode()))
    calls: list[tuple] = list(template.edge)
    seen = {repr(a) for a in calls}
    outputs = Counter(repr(f(*a)) for a in calls)
    for _ in range(2000):  # no output answers more than half the tests: a constant program fails
        if len(calls) >= NUM_TESTS:
            break
        args = template.gen(r)
        out = repr(f(*args))
        if repr(args) not in seen and outputs[out] < NUM_TESTS // 2:
            seen.add(repr(args))
            outputs[out] += 1
            calls.append(args)
    if len(calls) < NUM_TESTS:
        raise RuntimeError(f"py_func: {name} drew only {len(calls)} tests")
    tests = tuple(f"assert {name}({', '.join(map(repr, a))}) == {f(*a)!r}" for a in calls)
    return Problem(prompt, name, tests, _solution(template, name, k))


def _solution(template: Template, name: str, k: Any) -> str:
    """The reference as a fenced block (readable code for the warm start, not the lambda's source)."""
    body = _BODIES[template.key].format(k=repr(k) if isinstance(k, str) else k)
    return f"```python\ndef {name}({template.args}):\n    {body}\n```"


_BODIES = {
    "add": "return x + {k}",
    "times": "return x * {k}",
    "square_plus": "return x * x + {k}",
    "divisible": "return n % {k} == 0",
    "power": "return x ** {k}",
    "clamp": "return min(max(x, 0), {k})",
    "sum_to": "return n * (n + 1) // 2",
    "digit_sum": "return sum(int(d) for d in str(n))",
    "max3": "return max(a, b, c)",
    "factorial": "result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
    "sum_list": "return sum(nums)",
    "count_greater": "return sum(1 for x in nums if x > {k})",
    "filter_greater": "return [x for x in nums if x > {k}]",
    "evens": "return [x for x in nums if x % 2 == 0]",
    "scale_list": "return [x * {k} for x in nums]",
    "add_list": "return [x + {k} for x in nums]",
    "count_value": "return nums.count({k})",
    "max_list": "return max(nums)",
    "min_list": "return min(nums)",
    "sum_squares": "return sum(x * x for x in nums)",
    "first_k": "return items[:{k}]",
    "remove_value": "return [x for x in nums if x != {k}]",
    "sort_desc": "return sorted(nums, reverse=True)",
    "reverse_list": "return items[::-1]",
    "count_even": "return sum(1 for x in nums if x % 2 == 0)",
    "count_vowels": "return sum(1 for ch in s if ch in 'aeiou')",
    "count_char": "return s.count({k})",
    "reverse_string": "return s[::-1]",
    "palindrome": "return s == s[::-1]",
    "repeat": "return s * {k}",
    "upper": "return s.upper() + '!'",
    "first_chars": "return s[:{k}]",
    "word_count": "return len(s.split())",
    "replace_char": "return s.replace({k}, '*')",
    "suffix": "return s + {k}",
    "starts_with": "return s.startswith({k})",
}


def template_keys() -> list[str]:
    return [t.key for t in TEMPLATES]


@lru_cache(maxsize=64)
def all_problems(templates: tuple[str, ...] | None = None) -> tuple[Problem, ...]:
    """Every distinct problem of the named templates (all of them when None), in a fixed order."""
    chosen = [t for t in TEMPLATES if templates is None or t.key in templates]
    return tuple(make_problem(t, k) for t in chosen for k in t.constants)


@lru_cache(maxsize=1)
def _by_prompt() -> dict[str, Problem]:
    return {p.prompt: p for p in all_problems()}


def num_problems(templates: tuple[str, ...] | None = None) -> int:
    return len(all_problems(templates))


@register_reward("py_func")
def py_func_reward(sample: RewardInput, mode: str = "all") -> dict[str, Any]:
    """1.0 when the completion's function passes every hidden test (`mode: fraction`: the share that
    pass); the program runs in the sandbox, the tests in the checker. The label is the problem's
    (`Problem.label`); without one the prompt finds it."""
    label = sample.label if isinstance(sample.label, dict) else None
    if label is None:
        problem = _by_prompt().get(sample.prompt)
        if problem is None:
            raise ValueError("not a py_func problem: no label, and the prompt is not one of the task's")
        label = problem.label()
    return score_completion(
        sample.completion, label["tests"], mode=mode, limits=LIMITS, entry_points=[label["entry_point"]]
    )


@register_task("py_func")
@dataclass(frozen=True)
class PyFuncTask:
    """Python functions from one-line specs; option `templates`: the template keys to draw from
    (all when empty), `mode`: "all" or "fraction" for `score`."""

    name: str = "py_func"
    reward: str = "py_func"
    templates: tuple[str, ...] = ()
    mode: str = "all"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.templates) - set(template_keys()))
        if unknown:
            raise ValueError(f"unknown py_func templates {unknown}; known: {', '.join(template_keys())}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "templates", tuple(self.templates))

    def problems(self) -> tuple[Problem, ...]:
        return all_problems(tuple(sorted(self.templates)) or None)

    def _draw(self, n: int, seed: int) -> list[Problem]:
        """`n` problems in a seeded order: every problem once before any repeats."""
        probs = self.problems()
        order = list(range(len(probs)))
        random.Random(seed).shuffle(order)
        return [probs[i] for i in (order * (n // len(order) + 1))[:n]]

    def rl_examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        """(prompt, label): the reward reads the label's tests."""
        return [(p.prompt, p.label()) for p in self._draw(n, seed)]

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]:
        """(prompt, reference program as a fenced block): the warm start's pairs."""
        return [(p.prompt, p.solution) for p in self._draw(n, seed)]

    def score(self, prompt: str, completion: str) -> float:
        return float(py_func_reward(RewardInput(prompt=prompt, completion=completion), mode=self.mode)["reward"])

    def max_prompt_tokens(self) -> int:
        return max(len(p.prompt.encode()) for p in self.problems())

    def max_answer_tokens(self) -> int:
        return max(len(p.solution.encode()) for p in self.problems()) + 1
