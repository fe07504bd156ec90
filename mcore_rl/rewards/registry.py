"""Reward functions by name, so a recipe's `reward.name` picks one.

Tasks register the reward that scores them when their module is imported (`mcore_rl.data.tasks`);
general verifiers register here under a "module:function" path that is imported on first use
(math-verify is slow to import). Any other "package.module:function" is imported as given.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, TypeVar
from collections.abc import Callable

F = TypeVar("F", bound=Callable)

_REWARDS: dict[str, Callable | str] = {"math": "mcore_rl.rewards.math_verify:math_reward"}
# a trained reward model (`reward_model.py`: transformers, imported on first use)
_REWARDS["reward_model"] = "mcore_rl.rewards.reward_model:reward_model_score"
# a process reward model's step scores and a response's step count (`process_reward.py`)
_REWARDS["prm"] = "mcore_rl.rewards.process_reward:prm_score"
_REWARDS["prm_steps"] = "mcore_rl.rewards.process_reward:prm_steps"
# Z-Reward's generative teacher: a judge's score-token distribution (`generative_rm.py`)
_REWARDS["generative_rm"] = "mcore_rl.rewards.generative_rm:generative_rm_score"
# LLM judges (`judge.py`, aiohttp): async, options as keyword arguments (url, template, ...)
_REWARDS.update(
    {
        name: f"mcore_rl.rewards.judge:{fn}"
        for name, fn in (
            ("llm_judge", "llm_judge_reward"),
            ("rubric", "rubric_reward"),
            ("exprl_judge", "exprl_reward"),
            ("exprl_process", "exprl_process_reward"),
        )
    }
)


def register_reward(name: str) -> Callable[[F], F]:
    """Decorator: make `fn` available as `get_reward_fn(name)`; a name cannot be taken twice."""

    def deco(fn: F) -> F:
        known = _REWARDS.get(name)
        if known is not None and known is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return deco


def reward_names() -> list[str]:
    """Registered names (a task's reward appears once `mcore_rl.data.tasks` is imported)."""
    return sorted(_REWARDS)


def is_import_path(name: str) -> bool:
    return ":" in name and name not in _REWARDS


def resolve_import_path(path: str) -> Any:
    """The object that "package.module:name" (or "package.module:Class.name") names; imports the
    module. Reward workers load their function this way, so nothing needs to be pickled."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def import_path_of(fn: Any) -> str | None:
    """fn's "module:qualname" when importing that gives back `fn` itself, else None (lambdas,
    closures, bound methods, callable objects, functions of `__main__` or wrapped under a new name)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" or "<" in qualname:
        return None
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return f"{module}:{qualname}" if obj is fn else None


def get_reward_fn(name: str) -> Callable:
    """A registered reward function, or any "package.module:function" (ImportError,
    AttributeError or TypeError when that path does not name a callable)."""
    target = _REWARDS.get(name, name)
    if callable(target):
        return target
    if ":" not in target:
        raise KeyError(
            f"unknown reward function {name!r}; registered: {', '.join(reward_names())} "
            "(or give 'package.module:function')"
        )
    fn = resolve_import_path(target)
    if not callable(fn):
        raise TypeError(f"{target!r} is a {type(fn).__name__}, not a function")
    if name in _REWARDS:
        _REWARDS[name] = fn
    return fn
