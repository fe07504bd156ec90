"""Reward interface and runner (errors and timeouts never stop the run), math verifier, demo task."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, annotate, get_reward_fn
from mcore_rl.rewards import math_verify as mv
from mcore_rl.data.tasks.addition import addition_reward


def _inputs(*completions: str, label=None) -> list[RewardInput]:
    return [RewardInput(prompt="p", completion=c, label=label) for c in completions]


def _length_reward(s: RewardInput) -> float:
    return float(len(s.completion))


def test_sync_and_async_per_sample_in_order() -> None:
    async def async_reward(s: RewardInput) -> float:
        await asyncio.sleep(0.01 * (3 - len(s.completion)))  # finish out of order
        return len(s.completion)

    for fn in (_length_reward, async_reward):
        with RewardRunner(fn) as runner:
            results = runner.score_sync(_inputs("a", "bb", "ccc"))
        assert [r.reward for r in results] == [1.0, 2.0, 3.0]
        assert all(r.error is None and r.elapsed_s >= 0 for r in results)


def test_raising_and_invalid_rewards_are_contained() -> None:
    def bad(s: RewardInput):
        return {
            "raise": lambda: 1 / 0,
            "none": lambda: None,
            "nan": lambda: float("nan"),
            "str": lambda: "1.0",
            "dict": lambda: {"score": 1},
            "ok": lambda: {"reward": True, "parsed": "x"},
        }[s.completion]()

    results = RewardRunner(RewardFunction(bad, error_reward=-1.0)).score_sync(
        _inputs("raise", "none", "nan", "str", "dict", "ok")
    )
    assert [r.reward for r in results] == [-1.0] * 5 + [1.0]
    assert "ZeroDivisionError" in results[0].error
    assert "number" in results[1].error and "finite" in results[2].error and "number" in results[3].error
    assert "'reward' key" in results[4].error
    assert results[5].error is None and results[5].info == {"parsed": "x"}


def test_timeouts_sync_and_async() -> None:
    release = threading.Event()

    def hangs(s: RewardInput) -> float:
        if s.completion == "slow":
            release.wait(5)
        return 1.0

    async def ahangs(s: RewardInput) -> float:
        if s.completion == "slow":
            await asyncio.sleep(5)
        return 1.0

    for fn in (hangs, ahangs):
        start = time.monotonic()
        with RewardRunner(RewardFunction(fn, timeout_s=0.2)) as runner:
            results = runner.score_sync(_inputs("fast", "slow", "fast"))
        release.set()
        assert time.monotonic() - start < 3
        assert [r.reward for r in results] == [1.0, 0.0, 1.0]
        assert results[1].error == "timeout after 0.2s" and results[0].error is None


def test_per_group_rewards_and_group_failures() -> None:
    def rank_in_group(group: list[RewardInput]) -> list[float]:
        if any(s.completion == "boom" for s in group):
            raise RuntimeError("judge down")
        if any(s.completion == "short" for s in group):
            return [1.0]
        order = sorted(range(len(group)), key=lambda i: group[i].completion)
        return [float(order.index(i)) for i in range(len(group))]

    samples = _inputs("b", "x", "a", "boom", "y", "c", "short", "z")
    ids = [0, 1, 0, 1, 2, 0, 3, 3]
    results = RewardRunner(RewardFunction(rank_in_group, per_group=True)).score_sync(samples, ids)
    assert [r.reward for r in results[:3:2]] == [1.0, 0.0] and results[5].reward == 2.0
    assert results[1].error == results[3].error == "RuntimeError: judge down"
    assert results[4].reward == 0.0 and results[4].error is None  # a group of one
    assert "2 samples" in results[6].error and results[6].error == results[7].error
    with pytest.raises(ValueError):
        RewardRunner(RewardFunction(rank_in_group, per_group=True)).score_sync(samples, [0])


def test_concurrency_is_bounded() -> None:
    active, peak = [0], [0]

    async def count(s: RewardInput) -> float:
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        await asyncio.sleep(0.01)
        active[0] -= 1
        return 0.0

    RewardRunner(count, max_concurrency=3).score_sync(_inputs(*["x"] * 10))
    assert peak[0] == 3


def test_annotate_dicts_and_objects() -> None:
    from mcore_rl.rewards import RewardResult

    d: dict = {}
    annotate(d, RewardResult(0.0, error="timeout after 1s"))
    assert d == {"reward": 0.0, "reward_error": "timeout after 1s"}

    class S:
        pass

    s = S()
    annotate(s, RewardResult(1.0))
    assert s.reward == 1.0 and s.reward_error is None


# ------------------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    "text, want",
    [
        (r"so $x = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"first \boxed{1}, corrected: \boxed{\sqrt{\frac{3}{4}}}", r"\sqrt{\frac{3}{4}}"),
        (r"\fbox{7} done", "7"),
        (r"the set \boxed{\{1, 2\}}", r"\{1, 2\}"),
        ("work...\nThe final answer is $\\frac{3}{4}$.", r"\frac{3}{4}"),
        ("reasoning\n#### 1,234", "1,234"),
        ("**Answer:** 12", "12"),
        (r"\boxed{unterminated", None),
        ("I think it is 5", None),
    ],
)
def test_extract_answer(text: str, want) -> None:
    assert mv.extract_answer(text) == want


@pytest.mark.parametrize(
    "pred, gold, equal",
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\frac{2}{4}", "1/2", True),
        (r"\dfrac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
        ("x = 3", "3", True),
        ("(1,2)", "(1, 2)", True),
        (r"2\pi", r"\pi \cdot 2", True),
        ("3", "4", False),
        ("3", 3, True),
        (r"\frac{1}{3}", "0.33", False),
    ],
)
def test_math_equal(pred: str, gold, equal: bool) -> None:
    assert mv.math_equal(pred, gold) is equal


@pytest.mark.parametrize(
    "pred, gold, equal",
    [("0.5", r"\frac{1}{2}", True), (r"\frac{\sqrt{2}}{2}", "1/sqrt(2)", True), ("x=2", "2", True),
     ("50\\%", "50", True), ("1,000", "1000", True), ("3", "4", False), ("abc(", "1", False)],
)
def test_sympy_fallback(pred: str, gold: str, equal: bool, monkeypatch) -> None:
    monkeypatch.setattr(mv, "_math_verify_equal", lambda p, g: None)
    assert mv.math_equal(pred, gold) is equal


def test_math_reward_through_runner() -> None:
    samples = [
        RewardInput("q", r"... so the answer is $\boxed{\frac{6}{8}}$", label="0.75"),
        RewardInput("q", r"... \boxed{0.7}", label="0.75"),
        RewardInput("q", "I give up", label="0.75"),
        RewardInput("q", r"\boxed{1}", label=None),  # data error: recorded, not raised
    ]
    results = RewardRunner(get_reward_fn("math")).score_sync(samples)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert results[2].error is None and "label" in results[3].error


# -------------------------------------------------------------------------------- demo task


def test_addition_reward() -> None:
    ok = RewardInput("12+39=", "150")  # 51 reversed, zero-padded to 3 digits
    assert addition_reward(ok) == 1.0
    assert addition_reward(RewardInput("12+39=", "15\nmore text")) == 1.0
    assert addition_reward(RewardInput("12+39=", "150<|endoftext|>junk")) == 1.0
    assert addition_reward(RewardInput("12+39=", "51")) == 0.0
    results = RewardRunner(get_reward_fn("addition")).score_sync([ok, RewardInput("hello", "1")])
    assert results[0].reward == 1.0 and "not an addition prompt" in results[1].error


def test_get_reward_fn() -> None:
    assert get_reward_fn("addition") is addition_reward
    assert get_reward_fn("tests.test_rewards:_length_reward") is _length_reward
    with pytest.raises(KeyError, match="addition, math"):
        get_reward_fn("nope")
