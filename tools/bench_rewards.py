"""Reward workers vs the old thread pool: start-up and per-call overhead, side by side.

Why: sync rewards now run in worker processes that can be killed (`mcore_rl/rewards/workers.py`)
instead of threads that cannot; this measures what that costs on the demo's addition reward,
which takes microseconds, so what is measured is the runner itself.

    .venv/bin/python tools/bench_rewards.py                      # 1,024 samples, 16 workers
    .venv/bin/python tools/bench_rewards.py --samples 4096 --concurrency 4 --repeats 7

start-up: a new runner's first batch of `concurrency` samples (thread pool: creating threads;
workers: starting every process and loading the function in it).
per call: a warm batch of `samples` samples, divided by `samples`, median (and minimum) of
`repeats`; "direct" is calling the function in a loop, for scale. The modes alternate, so load
from other processes on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import mcore_rl.data.tasks  # noqa: F401  (registers the addition reward)
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn


def _batch(n: int) -> list[RewardInput]:
    return [RewardInput(f"{i % 10}+{i // 10 % 10}=", f"{i % 10 + i // 10 % 10:02d}"[::-1]) for i in range(n)]


def _runner(mode: str, concurrency: int) -> RewardRunner:
    fn = RewardFunction(get_reward_fn("addition"), timeout_s=30)
    executor = ThreadPoolExecutor(concurrency, thread_name_prefix="reward") if mode == "thread" else None
    runner = RewardRunner(fn, max_concurrency=concurrency, executor=executor)
    assert runner.isolation == mode, runner.isolation
    return runner


def _timed(runner: RewardRunner, samples: list[RewardInput]) -> float:
    start = time.perf_counter()
    results = runner.score_sync(samples)
    elapsed = time.perf_counter() - start
    assert all(r.error is None and r.reward == 1.0 for r in results), [r.error for r in results if r.error][:3]
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    modes = ("thread", "process")
    small, big = _batch(args.concurrency), _batch(args.samples)
    fn = get_reward_fn("addition")
    start = time.perf_counter()
    for s in big:
        fn(s)
    direct = (time.perf_counter() - start) / len(big)

    startup: dict[str, list[float]] = {m: [] for m in modes}
    per_call: dict[str, list[float]] = {m: [] for m in modes}
    runners = {}
    for rep in range(args.repeats):
        for mode in modes:
            runner = _runner(mode, args.concurrency)
            startup[mode].append(_timed(runner, small))
            if rep == 0:
                runners[mode] = runner
            else:
                runner.close()
    for _ in range(args.repeats):
        for mode in modes:
            per_call[mode].append(_timed(runners[mode], big) / len(big))
    for runner in runners.values():
        runner.close()

    def row(name: str, values: dict[str, list[float]], scale: float, unit: str) -> str:
        med = {m: statistics.median(v) for m, v in values.items()}
        low = {m: min(v) for m, v in values.items()}
        cells = "".join(f"{med[m] * scale:>10.1f} ({low[m] * scale:.1f})" for m in modes)
        return f"{name:<22}{cells}{med['process'] / med['thread']:>10.1f}x   {unit}"

    print(f"addition reward, {args.samples} samples, {args.concurrency} concurrent, median (min) of {args.repeats}")
    print(f"{'':<22}{'thread':>17}{'process':>17}{'ratio':>11}")
    print(row("start-up", startup, 1e3, "ms"))
    print(row("per call", per_call, 1e6, "us / sample"))
    print(f"{'direct call':<22}{direct * 1e6:>10.1f}{'':>7}{'':>17}{'':>11}   us / sample")


if __name__ == "__main__":
    main()
