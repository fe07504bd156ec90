"""Tasks by name: `get_task(name, **options)` builds one (see `base.Task`).

Importing the package imports every task module, which registers each task and its reward
function (in `mcore_rl.rewards`), as `mcore_rl.algos` does for algorithms.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from mcore_rl.data.tasks.base import Task

_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: make a task factory available as `get_task(name, **options)`."""

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _TASKS and _TASKS[name] is not factory:
            raise ValueError(f"task {name!r} is already registered ({_TASKS[name].__module__})")
        _TASKS[name] = factory
        return factory

    return deco


def get_task(name: str, **options: Any) -> Task:
    """The task `name` built with its options; a KeyError that lists the registered tasks otherwise."""
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {', '.join(task_names())}")
    return _TASKS[name](**options)


def task_names() -> list[str]:
    return sorted(_TASKS)


from mcore_rl.data.tasks import addition  # noqa: E402,F401  (after register_task, which the task modules import; registers the task and its reward)
from mcore_rl.data.tasks import formatting  # noqa: E402,F401  (as above)
from mcore_rl.data.tasks import reasoning_gym  # noqa: E402,F401  (as above; imports the reasoning-gym package only when used)
from mcore_rl.data.tasks import humaneval, py_func, tiny_code, word_format  # noqa: E402,F401  (as above)

__all__ = ["Task", "get_task", "register_task", "task_names"]
