"""Environments in a process of their own (`envs/process.py`): a hang in C code or a crash is killed,
not abandoned. The misbehaving environments are real registered environments run in real children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tool_calls import ParsedTurn
from mcore_rl.envs import register_env
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep
from mcore_rl.envs.guard import EnvGuards, GuardedEnv
from mcore_rl.envs.process import EnvProcessError, ProcessEnv, make_process_env


def act(text: str) -> AgentAction:
    return AgentAction(text=text, parsed=ParsedTurn(content=text))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_game_runs_in_its_own_process() -> None:
    env = make_process_env("guess_number", hi=8)
    pid = env.proc.pid
    try:
        start = env.reset(Prompt(0, "guess 1-8", [], 6), seed=0)
        assert start.state == "1-8" and pid != os.getpid()
        assert env.step(act("4")).messages[0]["content"] == "higher"
        assert env.step(act("6")).reward == 1.0
    finally:
        env.close()
    assert not alive(pid)


def test_a_bad_option_is_named_before_a_process_starts() -> None:
    with pytest.raises(ValueError, match="environment 'guess_number' has no option 'hii'"):
        make_process_env("guess_number", hii=3)


def test_an_exception_in_the_child_comes_back_named() -> None:
    env = make_process_env("guess_number", lo=1, hi=4)
    try:
        with pytest.raises(EnvProcessError, match="ValueError: guess_number: the prompt's secret 9 is outside 1-4"):
            env.reset(Prompt(0, "guess 1-4", [], 9), seed=0)
    finally:
        env.close()


# environments registered here live in this test module: the child imports it by name to find them
SPIN = "spin_in_c"


@dataclass(frozen=True)
class NoOptions:
    pass


class _NoPrompts:
    def examples(self, n: int, seed: int) -> list[tuple[str, object]]:
        return [("go", None)] * n


@register_env(SPIN, options=NoOptions, prompts=lambda o: _NoPrompts(), origin="test")
class SpinInC(Environment):
    """Steps into C code that holds the GIL for minutes (a regex with catastrophic backtracking) or
    crashes its interpreter."""

    def __init__(self, options: NoOptions) -> None:
        pass

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        return EnvReset([{"role": "user", "content": "go"}])

    def step(self, action: AgentAction) -> EnvStep:
        if action.text == "crash":
            os._exit(7)
        import re

        re.match(r"(a+)+$", "a" * 40 + "b")  # exponential backtracking inside the C regex engine
        return EnvStep([])


def spinning() -> ProcessEnv:
    return make_process_env(SPIN, modules=(__name__,))


def test_a_step_stuck_in_c_code_is_killed_not_abandoned() -> None:
    inner = spinning()
    pid = inner.proc.pid
    inner.reset(Prompt(0, "go", [], None), 0)  # outside the guard: only the step is timed
    env = GuardedEnv(inner, EnvGuards(step_timeout_s=1.0))
    t0 = time.monotonic()
    out = env.step(act("spin"))
    assert out.done and out.info["end_reason"] == "env_timeout"
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)  # the guard's close killed the child: no thread or CPU left spinning


def test_a_crashing_environment_costs_its_episode() -> None:
    env = GuardedEnv(spinning())
    env.reset(Prompt(0, "go", [], None), 0)
    out = env.step(act("crash"))
    assert out.done and out.info["end_reason"] == "env_error"
    assert "EnvProcessError: the environment's process exited with status 7" in out.info["end_detail"]


def test_the_child_dies_with_its_sigkilled_owner() -> None:
    script = (
        "from mcore_rl.envs.process import make_process_env\n"
        "env = make_process_env('guess_number')\n"
        "print(env.proc.pid, flush=True)\n"
        "import time\ntime.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        child = int(owner.stdout.readline())
        assert alive(child)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
