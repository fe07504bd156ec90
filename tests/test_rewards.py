"""Reward interface and runner (errors and timeouts never stop the run), math verifier, demo task."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, annotate, get_reward_fn
from mcore_rl.rewards import math_verify as mv
from mcore_rl.data.tasks.addition import addition_reward
from tests.reward_fns import group_lengths, misbehave


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


# ---------------------------------------------------------------------------- worker processes


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (read from /proc: no psutil needed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")


def test_where_calls_run() -> None:
    async def judge(s: RewardInput) -> float:
        return 1.0

    assert RewardRunner(misbehave).isolation == "process"
    assert RewardRunner(misbehave).reward.path == "tests.reward_fns:misbehave"
    assert RewardRunner(get_reward_fn("addition")).reward.path == "mcore_rl.data.tasks.addition:addition_reward"
    assert RewardRunner(lambda s: 1.0).isolation == "thread"  # no import path: in-process
    assert RewardRunner(judge).isolation == "async"
    with ThreadPoolExecutor(2) as pool:
        assert RewardRunner(misbehave, executor=pool).isolation == "thread"


@needs_proc
def test_hanging_reward_costs_its_sample_not_a_worker() -> None:
    """The issue's run: half the samples hang, 2 workers. Each hang costs its sample; the worker is
    killed by pid and replaced, and every other sample, now and later, is scored."""
    with RewardRunner(RewardFunction(misbehave, timeout_s=0.5), max_concurrency=2) as runner:
        runner.start(wait_ready=True)
        before = set(runner.worker_pids())
        assert len(before) == 2 and all(_alive(p) for p in before)
        start = time.monotonic()
        results = runner.score_sync(_inputs(*["hang", "abcd"] * 4))
        assert time.monotonic() - start < 10
        assert [r.reward for r in results] == [0.0, 4.0] * 4
        assert all(r.error == "timeout after 0.5s (its worker was killed)" for r in results[::2])
        assert all(r.error is None for r in results[1::2])
        assert _gone_within(before, 5)  # the workers that hung were killed (and reaped)
        start = time.monotonic()
        later = runner.score_sync(_inputs(*["abc"] * 20))
        assert [r.error for r in later] == [None] * 20 and time.monotonic() - start < 5
        pids = runner.worker_pids()
        assert len(pids) == 2 and not set(pids) & before and all(_alive(p) for p in pids)
    assert runner.worker_pids() == [] and _gone_within(pids, 5)


async def _async_misbehave(s: RewardInput) -> float:
    await asyncio.sleep(0)
    return misbehave(s)


@pytest.mark.parametrize("isolation", ["process", "thread", "async"])
def test_base_exceptions_cost_one_sample(isolation: str) -> None:
    """SystemExit, KeyboardInterrupt, any BaseException (and, in a worker, os._exit) end the call,
    not the run."""
    fn = RewardFunction(
        {"process": misbehave, "thread": lambda s: misbehave(s), "async": _async_misbehave}[isolation], timeout_s=10
    )
    kinds = ["exit", "interrupt", "base", "ok"] + (["os_exit", "ok"] if isolation == "process" else [])
    with RewardRunner(fn, max_concurrency=2) as runner:
        assert runner.isolation == isolation
        results = runner.score_sync(_inputs(*kinds))
        again = runner.score_sync(_inputs("ok", "ok"))
    errors = [r.error for r in results]
    assert errors[:4] == ["SystemExit: 3", "KeyboardInterrupt", "Abort: not an Exception", None]
    if isolation == "process":
        assert errors[4:] == ["the reward worker exited with code 7 during the call", None]
    assert [r.reward for r in results if r.error is None] == [2.0] * (len(kinds) - 3 - (isolation == "process"))
    assert [r.reward for r in again] == [2.0, 2.0]


def test_async_score_in_workers_and_group_timeouts() -> None:
    """`score` from an event loop runs the workers from a thread that ends with `asyncio.run`:
    the workers must outlive it (they are forked by the runner's long-lived spawner thread)."""
    with RewardRunner(RewardFunction(group_lengths, per_group=True, timeout_s=0.5), max_concurrency=2) as runner:
        samples = _inputs("a", "hang", "bb", "ccc", "dddd")
        results = asyncio.run(runner.score(samples, [0, 0, 1, 1, 2]))
        pids = runner.worker_pids()
        assert [r.reward for r in results] == [0.0, 0.0, 2.0, 3.0, 4.0]
        assert results[0].error == results[1].error == "timeout after 0.5s (its worker was killed)"
        time.sleep(0.2)
        assert all(_alive(p) for p in pids)
        assert [r.reward for r in asyncio.run(runner.score(samples[2:], [1, 1, 2]))] == [2.0, 3.0, 4.0]
        assert runner.worker_pids() == pids


def test_unloadable_function_fails_its_samples() -> None:
    with RewardRunner(RewardFunction(misbehave, path="nosuchmod:fn"), max_concurrency=2) as runner:
        results = runner.score_sync(_inputs("a", "b", "c"))
    assert [r.reward for r in results] == [0.0] * 3
    assert results[0].error == (
        "no reward worker could load 'nosuchmod:fn': ModuleNotFoundError: No module named 'nosuchmod'"
    )


_PARENT = """
import sys, time
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner
from tests.reward_fns import misbehave

def inputs(*c):
    return [RewardInput("p", x) for x in c]

closed = RewardRunner(RewardFunction(misbehave, timeout_s=0.5), max_concurrency=2)
assert [r.error is None for r in closed.score_sync(inputs("hang", "ok") * 2)] == [False, True] * 2
pids = closed.worker_pids()
closed.close()
left_open = RewardRunner(RewardFunction(misbehave, timeout_s=60), max_concurrency=2)
pids += [int(r.reward) for r in left_open.score_sync(inputs("pid", "pid"))]
print(" ".join(map(str, pids)), flush=True)
if sys.argv[1] == "busy":  # both workers stuck: one in C code holding the GIL, one asleep
    left_open.score_sync(inputs("spin", "hang"))
"""


@needs_proc
@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_worker_outlives_the_trainer(how: str) -> None:
    """A trainer exits at once after a hang (closed or not), and its workers die with it, also when
    it is SIGKILLed while they are stuck."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, "busy" if how == "sigkill" else "idle"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 4
        if how == "sigkill":
            time.sleep(0.5)  # the calls have reached the workers
            assert all(_alive(p) for p in pids[2:])
            proc.kill()
        assert proc.wait(timeout=20) == (-signal.SIGKILL if how == "sigkill" else 0)
        assert _gone_within(pids, 5), [p for p in pids if _alive(p)]
    finally:
        proc.kill()
        for p in pids:  # never leave a spinning process behind, even when the test fails
            if _alive(p):
                os.kill(p, signal.SIGKILL)


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
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\frac{\sqrt{2}}{2}", "1/sqrt(2)", True),
        ("x=2", "2", True),
        ("50\\%", "50", True),
        ("1,000", "1000", True),
        ("3", "4", False),
        ("abc(", "1", False),
    ],
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
    with RewardRunner(get_reward_fn("math"), max_concurrency=2) as runner:
        assert runner.isolation == "process"
        results = runner.score_sync(samples)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]
    assert results[2].error is None and "label" in results[3].error


def test_math_verifier_is_bounded_in_time() -> None:
    """sympy on 2^(2^(2^40)) runs for minutes: one deadline bounds the whole comparison. It is a
    CPU-time (SIGPROF) timer, so it is set in a main thread: a reward worker's (which runs the calls)
    or a direct caller's; in other threads the runner's timeout is the bound."""
    tower = RewardInput("q", r"so it is \boxed{2^{2^{2^{40}}}}", label="1")
    with RewardRunner(RewardFunction(get_reward_fn("math"), timeout_s=30), max_concurrency=2) as runner:
        start = time.monotonic()
        results = runner.score_sync([tower, RewardInput("q", r"\boxed{\frac{1}{2}}", label="0.5")])
        assert time.monotonic() - start < 4 * mv.VERIFY_TIMEOUT_S  # CPU seconds; a loaded machine stretches them
    assert [(r.reward, r.error) for r in results] == [(0.0, None), (1.0, None)]  # wrong, not an error
    start = time.process_time()
    assert mv.math_equal("2^{2^{2^{40}}}", "1", timeout_s=0.5) is False
    assert time.process_time() - start < 2.5
    assert signal.getsignal(signal.SIGPROF) in (signal.SIG_DFL, None) and signal.getitimer(signal.ITIMER_PROF)[0] == 0
    armed: list[bool] = []

    def elsewhere() -> None:
        with mv.deadline(1.0) as a:
            armed.append(a)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert armed == [False]


def test_waiting_for_the_cpu_does_not_count_against_the_verify_deadline() -> None:
    """On a loaded machine a comparison waits for a core; that wait must not make a right answer
    wrong. Time the process does not run (here: asleep, as when it waits to be scheduled) does
    not count; the CPU time it uses does."""
    with mv.deadline(0.3) as armed:
        time.sleep(0.6)  # twice the deadline of wall time, next to no CPU time
    assert armed
    with pytest.raises(mv.VerifyTimeout, match="CPU time"):
        with mv.deadline(0.3):
            start = time.process_time()
            while time.process_time() - start < 5:  # the deadline fires after 0.3 s of it
                pass
    assert signal.getitimer(signal.ITIMER_PROF)[0] == 0


# -------------------------------------------------------------------------------- demo task


def test_addition_reward() -> None:
    ok = RewardInput("12+39=", "150")  # 51 reversed, zero-padded to 3 digits
    assert addition_reward(ok) == 1.0
    assert addition_reward(RewardInput("12+39=", "15\nmore text")) == 1.0
    assert addition_reward(RewardInput("12+39=", "150<|endoftext|>junk")) == 1.0
    assert addition_reward(RewardInput("12+39=", "51")) == 0.0
    with RewardRunner(get_reward_fn("addition"), max_concurrency=2) as runner:
        results = runner.score_sync([ok, RewardInput("hello", "1")])
    assert results[0].reward == 1.0 and "not an addition prompt" in results[1].error


def test_get_reward_fn() -> None:
    assert get_reward_fn("addition") is addition_reward
    assert get_reward_fn("tests.test_rewards:_length_reward") is _length_reward
    with pytest.raises(KeyError, match="registered: .*addition.*math"):
        get_reward_fn("nope")
