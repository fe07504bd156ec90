"""Environments by name: `make_env(name, **options)` builds one episode's environment (see `base.Environment`).

Each registered environment also says where its prompts come from (`env_prompts(name, **options)`):
its own seeded generator, a registered task (HumanEval, `tiny_code`), or a reasoning-gym dataset, so a
domain can name just the environment. Options are one frozen dataclass per environment, shared by the
environment and its prompt source, so an unknown option key fails once, naming it, before any worker
starts. Importing the package imports every environment module, which registers it, as
`mcore_rl.data.tasks` does for tasks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mcore_rl.data.tool_calls import ToolSpec
from mcore_rl.envs.base import PRIVILEGED, AgentAction, Environment, EnvReset, EnvStep, Message


class PromptSource(Protocol):
    """Where an environment's episodes start: `examples(n, seed)` gives `n` (prompt text, label) pairs,
    deterministic in `seed` (the label is what `Environment.reset` reads from `Prompt.label`)."""

    def examples(self, n: int, seed: int) -> list[tuple[str, Any]]: ...


@dataclass(frozen=True)
class EnvEntry:
    """A registered environment: its options dataclass, the factory of one episode's environment, the
    factory of its prompt source, and the tools it offers (all three called with the same options)."""

    name: str
    options: type
    factory: Callable[[Any], Environment]
    prompts: Callable[[Any], PromptSource]
    origin: str  # where the prompts come from, in words ("own generator", "task humaneval", ...)
    tools: Callable[[Any], list[ToolSpec]]
    privileged: tuple[str, ...] = ()  # the privileged texts it gives (`base.PRIVILEGED` + name)


_ENVS: dict[str, EnvEntry] = {}


def _no_tools(options: Any) -> list[ToolSpec]:
    return []


def register_env(
    name: str,
    *,
    options: type,
    prompts: Callable[[Any], PromptSource],
    origin: str,
    tools: Callable[[Any], list[ToolSpec]] = _no_tools,
    privileged: tuple[str, ...] = (),
) -> Callable[[Callable[[Any], Environment]], Callable[[Any], Environment]]:
    """Decorator over an environment factory (a class taking the options object): make it available as
    `make_env(name, **options)`, its prompts as `env_prompts(name, **options)`, the tools it offers as
    `env_tools(name, **options)` (so a config check can refuse a domain whose model family has no
    tool-call format for an environment with tools, before any worker starts). `privileged`: the names
    of the privileged texts it gives (`base.PRIVILEGED`), so a teacher reading one is checked too."""
    if not dataclasses.is_dataclass(options):
        raise TypeError(f"environment {name!r}: options must be a dataclass, got {options!r}")

    def deco(factory: Callable[[Any], Environment]) -> Callable[[Any], Environment]:
        if name in _ENVS and _ENVS[name].factory is not factory:
            raise ValueError(f"environment {name!r} is already registered ({_ENVS[name].factory.__module__})")
        _ENVS[name] = EnvEntry(name, options, factory, prompts, origin, tools, tuple(privileged))
        return factory

    return deco


def env_entry(name: str) -> EnvEntry:
    """The registration of `name`; a KeyError that lists the registered environments otherwise."""
    if name not in _ENVS:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(env_names())}")
    return _ENVS[name]


def env_options(name: str, **options: Any) -> Any:
    """The options object of environment `name`; a ValueError naming an unknown or bad option key."""
    entry = env_entry(name)
    known = [f.name for f in dataclasses.fields(entry.options)]
    for key in options:
        if key not in known:
            raise ValueError(f"environment {name!r} has no option {key!r}; its options: {', '.join(known) or 'none'}")
    try:
        return entry.options(**options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment {name!r}: {exc}") from exc


def make_env(name: str, **options: Any) -> Environment:
    """A fresh environment for one episode (environments are never shared between episodes)."""
    return env_entry(name).factory(env_options(name, **options))


def env_prompts(name: str, **options: Any) -> PromptSource:
    """Where the episodes of environment `name` (with these options) start."""
    return env_entry(name).prompts(env_options(name, **options))


def env_tools(name: str, **options: Any) -> list[ToolSpec]:
    """The tools environment `name` offers with these options (empty: its turns are plain text)."""
    return env_entry(name).tools(env_options(name, **options))


def env_has_player(name: str) -> bool:
    """Does environment `name` ship a scripted player (`Environment.demonstrate`) for warm starts?"""
    factory = env_entry(name).factory
    return (
        isinstance(factory, type)
        and issubclass(factory, Environment)
        and (factory.demonstrate is not Environment.demonstrate)
    )


def env_names() -> list[str]:
    return sorted(_ENVS)


from mcore_rl.envs import code_repair, frozen_lake, guess_number, reasoning_tools, taxi  # noqa: E402,F401  (each registers its environment)

__all__ = [
    "AgentAction",
    "EnvEntry",
    "EnvReset",
    "EnvStep",
    "Environment",
    "Message",
    "PRIVILEGED",
    "PromptSource",
    "env_entry",
    "env_has_player",
    "env_names",
    "env_options",
    "env_prompts",
    "env_tools",
    "make_env",
    "register_env",
]
