"""Reward workers vs the old thread pool: start-up and per-call overhead, side by side.

Why: sync rewards now run in worker processes that can be killed (`mcore_rl/rewards/workers.py`)
instead of threads that cannot; this measures what that costs on the demo's addition reward,
which takes microseconds, so what is measured is the runner itself.

    .venv/bin/python benchmarks/bench_rewards.py                      # 1,024 samples, 16 workers
    .venv/bin/python benchmarks/bench_rewards.py --samples 4096 --concurrency 4 --repeats 7

start-up: a new runner's first batch of `concurrency` samples (thread pool: creating threads;
workers: starting every process and loading the function in it).
per call: a warm batch of `samples` samples, divided by `samples`, median (and minimum) of
`repeats`; "direct" is calling the function in a loop, for scale. The modes alternate, so load
from other processes on a shared machine hits them alike.

    .venv/bin/python benchmarks/bench_rewards.py --code               # the code sandbox's cost, side by side

`--code`: the code reward (`mcore_rl/rewards/checker.py`) on tiny_code answers and HumanEval
canonical solutions, each program run (a) as the reward runs it: in the sandbox, its tests in the
checker ("sandbox auto": the strongest isolation this machine allows; "sandbox user_ns"; "sandbox
none": rlimits, uid and seccomp without namespaces), (b) with its tests in one fresh `python -I -S`
subprocess, unsandboxed, (c) with `exec` in this process (no process at all), for scale.
`concurrency` calls at a time from a thread pool (default 2 here); throughput in samples/s and
per-sample latency p50/p90/p95, the modes interleaved over `repeats` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable

import mcore_rl.data.tasks  # noqa: F401  (registers the addition reward)
from mcore_rl.rewards import RewardFunction, RewardInput, RewardRunner, get_reward_fn
from mcore_rl.rewards.checker import run_tests
from mcore_rl.rewards.sandbox import Limits, probe


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


# ------------------------------------------------------------------------------ the code sandbox


def _code_workload(n: int) -> list[dict]:
    """Programs and their tests: tiny_code answers and HumanEval canonical solutions, alternating."""
    from mcore_rl.data.tasks.humaneval import problems, program_of
    from mcore_rl.data.tasks.tiny_code import checks_for, format_problem

    tiny = [format_problem(a, False, b) for a in range(2, 10) for b in (1, -1)]
    out = []
    for i in range(n):
        if i % 2 == 0:
            ex = tiny[i // 2 % len(tiny)]
            out.append(
                {
                    "program": "f = " + ex["response"],
                    "tests": checks_for(ex["prompt"]),
                    "context": "",
                    "entry_points": (),
                }
            )
        else:
            p = problems()[i // 2 % 32]
            out.append(
                {
                    "program": program_of(p, p["canonical_solution"]),
                    "tests": [f"{p['test']}\ncheck({p['entry_point']})\n"],
                    "context": p["prompt"],
                    "entry_points": (p["entry_point"],),
                }
            )
    return out


def _one_process_source(item: dict) -> str:
    """The program and its tests in one interpreter (no checker, no sandbox): the baselines."""
    return f"scope = {{}}\nexec({item['program']!r}, scope)\nfor t in {item['tests']!r}:\n    exec(t, scope)\n"


def _unsandboxed_subprocess(item: dict) -> bool:
    """The program and its tests in a fresh interpreter with no isolation."""
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _one_process_source(item)],
        env={},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
    )
    return proc.returncode == 0


def _in_process(item: dict) -> bool:
    exec(_one_process_source(item), {})
    return True


def _sandboxed(isolation: str) -> Callable[[dict], bool]:
    limits = Limits(cpu_s=10, wall_s=20, memory_mb=1024)

    def run(item: dict) -> bool:
        out = run_tests(
            item["program"],
            item["tests"],
            limits,
            context=item["context"],
            entry_points=item["entry_points"],
            isolation=isolation,
        )
        return out.kind == "pass"

    return run


def bench_code(samples: int, concurrency: int, rounds: int) -> None:
    modes = {
        "sandbox auto": _sandboxed("auto"),
        "sandbox user_ns": _sandboxed("user_ns"),
        "sandbox none": _sandboxed("none"),
        "subprocess, no sandbox": _unsandboxed_subprocess,
        "exec in-process": _in_process,
    }
    mech = probe()
    if not probe("none").get("stdlib"):
        del modes["sandbox none"]  # its uid cannot read this interpreter's standard library (docs/sandbox.md)
        print("sandbox none: skipped, its uid cannot read this interpreter's standard library")
    per_round = max(1, samples // rounds)
    work = _code_workload(per_round * rounds)
    latencies: dict[str, list[float]] = {m: [] for m in modes}
    busy: dict[str, float] = {m: 0.0 for m in modes}

    def timed(fn: Callable[[dict], bool], item: dict) -> tuple[bool, float]:
        start = time.perf_counter()
        ok = fn(item)
        return ok, time.perf_counter() - start

    with ThreadPoolExecutor(concurrency) as pool:
        for r in range(rounds):
            chunk = work[r * per_round : (r + 1) * per_round]
            for name, fn in modes.items():
                start = time.perf_counter()
                outs = list(pool.map(lambda item: timed(fn, item), chunk))
                busy[name] += time.perf_counter() - start
                assert all(ok for ok, _ in outs), f"{name}: a right program failed"
                latencies[name] += [t for _, t in outs]
    print(
        f"code reward harness: {per_round * rounds} samples per mode (tiny_code answers and HumanEval canonical "
        f"solutions, alternating), {concurrency} concurrent, {rounds} interleaved rounds"
    )
    print("in force with auto: " + ", ".join(f"{k}={v}" for k, v in mech.items() if k not in ("status", "error")))
    print(f"{'':<24}{'samples/s':>10}{'p50 ms':>10}{'p90 ms':>10}{'p95 ms':>10}{'p50 vs subprocess':>19}")
    base = statistics.median(latencies["subprocess, no sandbox"])
    for name in modes:
        lat = sorted(latencies[name])
        p50 = statistics.median(lat)
        p90, p95 = (lat[min(len(lat) - 1, int(q * len(lat)))] for q in (0.9, 0.95))
        print(
            f"{name:<24}{len(lat) / busy[name]:>10.1f}{p50 * 1e3:>10.1f}{p90 * 1e3:>10.1f}{p95 * 1e3:>10.1f}"
            f"{p50 / base:>18.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=None, help="default 1024 (--code: 128)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 16 (--code: 2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--code", action="store_true", help="the code sandbox's cost instead (see the docstring)")
    args = ap.parse_args()
    if args.code:
        bench_code(args.samples or 128, args.concurrency or 2, args.repeats)
        return
    args.samples, args.concurrency = args.samples or 1024, args.concurrency or 16
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
