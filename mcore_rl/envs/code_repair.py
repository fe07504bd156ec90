"""Multi-turn code repair: the policy writes a program, the sandbox's test results come back, it tries
again, up to `max_attempts` times.

The prompts and the verdict are the code tasks' own: `humaneval` (the problem's `check`) or `tiny_code`
(unit tests at five points), scored by their registered rewards over the sandboxed code checker
(`mcore_rl/rewards/checker.py`), so the reward comes from the checker and never from anything the
program printed. The feedback is the verdict only (tests passed, the failure kind, the first failing
test), kept to `feedback_chars`, short enough for the byte-level demo model on `tiny_code`. The
episode's reward is the last attempt's score (given on the final step); `info["attempts"]` says how
many it took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcore_rl.data.samples import Prompt
from mcore_rl.data.tasks import get_task
from mcore_rl.data.tasks.base import Task
from mcore_rl.envs import register_env
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep
from mcore_rl.rewards import RewardInput

TASKS = ("humaneval", "tiny_code")


@dataclass(frozen=True)
class CodeRepairOptions:
    task: str = "tiny_code"
    max_attempts: int = 3
    feedback_chars: int = 200

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"option 'task' must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.max_attempts < 1:
            raise ValueError(f"option 'max_attempts' must be >= 1, got {self.max_attempts}")
        if self.feedback_chars < 16:
            raise ValueError(f"option 'feedback_chars' must be >= 16, got {self.feedback_chars}")


def _prompts(options: CodeRepairOptions) -> Task:
    return get_task(options.task)


def _checker(task: str) -> Callable[[RewardInput], dict[str, Any]]:
    if task == "humaneval":
        from mcore_rl.data.tasks.humaneval import humaneval_reward

        return humaneval_reward
    from mcore_rl.data.tasks.tiny_code import tiny_code_reward

    return tiny_code_reward


def feedback_of(verdict: dict[str, Any], limit: int) -> str:
    """The verdict as a short message: "pass", or the failure kind with the tests passed and the first
    failing test ("wrong 2/5: test 0: AssertionError")."""
    if verdict.get("reward", 0.0) >= 1.0:
        return "pass"
    tests = f" {verdict['passed']}/{verdict['total']}" if "total" in verdict else ""
    detail = str(verdict.get("detail", "")).strip()
    text = f"{verdict.get('kind', 'fail')}{tests}" + (f": {detail}" if detail else "")
    return text[:limit]


@register_env("code_repair", options=CodeRepairOptions, prompts=_prompts, origin="task humaneval or tiny_code")
class CodeRepairEnv(Environment):
    def __init__(self, options: CodeRepairOptions) -> None:
        self.options = options
        self.check = _checker(options.task)
        self.prompt: Prompt | None = None
        self.attempts = 0

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        self.prompt, self.attempts = prompt, 0
        return EnvReset(messages=[{"role": "user", "content": prompt.text}], state="attempt 0")

    def step(self, action: AgentAction) -> EnvStep:
        assert self.prompt is not None, "step before reset"
        self.attempts += 1
        verdict = self.check(RewardInput(prompt=self.prompt.text, completion=action.text, label=self.prompt.label))
        score = float(verdict["reward"])
        info: dict[str, Any] = {"attempts": self.attempts, "verdict": verdict.get("kind", "")}
        done = score >= 1.0 or self.attempts >= self.options.max_attempts
        message = {"role": "user", "content": feedback_of(verdict, self.options.feedback_chars)}
        state = "solved" if score >= 1.0 else f"attempt {self.attempts}: {verdict.get('kind', '')}"
        return EnvStep([message], reward=score if done else 0.0, done=done, state=state, info=info)
