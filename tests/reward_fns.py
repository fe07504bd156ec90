"""Reward functions that misbehave for real, at module level so reward workers import them by name.

The completion says what to do: "hang" sleeps for an hour, "spin" holds the GIL in C code for
minutes, "exit" raises SystemExit, "interrupt" KeyboardInterrupt, "base" a bare BaseException
subclass, "os_exit" calls os._exit, "pid" returns the worker's pid; anything else scores its length.
"""

from __future__ import annotations

import os
import time

from mcore_rl.rewards import RewardInput


class Abort(BaseException):
    pass


def misbehave(s: RewardInput) -> float:
    what = s.completion
    if what == "hang":
        time.sleep(3600)
    elif what == "spin":
        sum(range(10**12))  # one C call: no bytecode boundary, so no thread of this process runs
    elif what == "exit":
        raise SystemExit(3)
    elif what == "interrupt":
        raise KeyboardInterrupt
    elif what == "base":
        raise Abort("not an Exception")
    elif what == "os_exit":
        os._exit(7)
    elif what == "pid":
        return float(os.getpid())
    return float(len(what))


def group_lengths(group: list[RewardInput]) -> list[float]:
    if any(s.completion == "hang" for s in group):
        time.sleep(3600)
    return [float(len(s.completion)) for s in group]


def digit_count(s: RewardInput) -> float:
    """A dense signal an untrained model gets: how many digits the completion has."""
    return float(sum(ch.isdigit() for ch in s.completion))
