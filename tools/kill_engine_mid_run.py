"""SIGKILL one engine that a training run started, at a moment nobody chose.

The fault test of the asynchronous runtime on a real recipe: the trainer's started engines are
`python -m mcore_rl.cli serve` children of the trainer process; this tool waits until the run has
written a number of step records to `metrics.jsonl` — drawn with the operating system's random
source from `--after-steps LO HI`, so the moment is not picked to be convenient — then waits a
further random fraction of a step and kills one engine (also drawn at random) with SIGKILL.
It prints what it did as one JSON line, which goes into the report next to `accounting.json`.

    mcore-rl train configs/smollm2_reasoning.yaml rollout.runtime=async ... &
    python tools/kill_engine_mid_run.py --trainer-pid $! --run-dir RUN_DIR --after-steps 3 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time


def children(pid: int) -> list[int]:
    """Direct and indirect children of `pid`, from /proc (no psutil needed)."""
    parent_of: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: the parent pid follows the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        parent_of[int(name)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, par in parent_of.items() if par == p]
        found.extend(kids)
        frontier.extend(kids)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def engine_pids(trainer_pid: int) -> list[int]:
    """The trainer's started engines: `mcore_rl.cli serve` processes below it."""
    pids = []
    for pid in children(trainer_pid):
        argv = cmdline(pid)
        if "mcore_rl.cli" in argv and "serve" in argv:
            pids.append(pid)
    return sorted(pids)


def step_records(run_dir: str) -> int:
    """Trained steps so far: the records that carry a training reward (evaluations do not)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            return sum(1 for line in f if '"reward/mean"' in line)
    except OSError:
        return 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer-pid", type=int, required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--after-steps", type=int, nargs=2, default=(2, 20), metavar=("LO", "HI"))
    parser.add_argument("--poll-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    lo, hi = args.after_steps
    if not 0 <= lo <= hi:
        parser.error(f"--after-steps: need 0 <= LO <= HI, got {lo} {hi}")

    rng = random.SystemRandom()
    target = rng.randint(lo, hi)
    delay_fraction = rng.random()
    started = time.monotonic()
    last_records, last_change = step_records(args.run_dir), started
    step_s = 0.0
    while step_records(args.run_dir) < target:
        if not alive(args.trainer_pid):
            print(json.dumps({"killed": None, "reason": "the trainer ended first", "target_records": target}))
            return 1
        n = step_records(args.run_dir)
        if n != last_records:
            now = time.monotonic()
            step_s = (now - last_change) / max(1, n - last_records)
            last_records, last_change = n, now
        time.sleep(args.poll_s)
    time.sleep(delay_fraction * step_s)
    engines = engine_pids(args.trainer_pid)
    if not engines:
        print(json.dumps({"killed": None, "reason": "no started engine found below the trainer"}))
        return 1
    victim = rng.choice(engines)
    os.kill(victim, signal.SIGKILL)
    print(
        json.dumps(
            {
                "killed": victim,
                "engines": engines,
                "after_records": step_records(args.run_dir),
                "target_records": target,
                "extra_delay_s": round(delay_fraction * step_s, 1),
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
