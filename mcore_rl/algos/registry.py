"""Name -> function tables, one per kind of algorithm, so configs can pick algorithms by string."""

from __future__ import annotations

import inspect
import typing
from typing import Any, TypeVar
from collections.abc import Callable

F = TypeVar("F", bound=Callable)

_TABLES: dict[str, dict[str, Callable]] = {}


def register(kind: str, name: str) -> Callable[[F], F]:
    """Decorator: make `fn` available as `get(kind, name)`. Re-registering a name is an error, so
    two modules cannot silently shadow each other."""

    def deco(fn: F) -> F:
        table = _TABLES.setdefault(kind, {})
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered ({table[name].__module__})")
        table[name] = fn
        return fn

    return deco


def get(kind: str, name: str) -> Callable:
    """The function registered as `name`; a KeyError that lists the valid names otherwise."""
    if kind not in _TABLES:
        raise KeyError(f"unknown algorithm kind {kind!r}; kinds: {', '.join(sorted(_TABLES))}")
    table = _TABLES[kind]
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; registered: {', '.join(sorted(table))}")
    return table[name]


def names(kind: str) -> list[str]:
    """Registered names of one kind, sorted (empty if the kind has none)."""
    return sorted(_TABLES.get(kind, {}))


def kinds() -> list[str]:
    return sorted(_TABLES)


def literal_choices(fn: Any) -> dict[str, tuple]:
    """The keyword parameters of `fn` annotated `Literal[...]`, with their allowed values (so an option's
    value is checked with the config, not at the first batch it would fail or, worse, be ignored)."""
    try:
        hints = typing.get_type_hints(inspect.unwrap(fn))
    except Exception:
        return {}
    return {k: typing.get_args(v) for k, v in hints.items() if typing.get_origin(v) is typing.Literal}


def literal_problems(fn: Any, options: dict[str, Any]) -> list[tuple[str, str]]:
    """(option, message) for each of `options` whose value is outside its `Literal` choices in `fn`."""
    return [
        (name, f"{options[name]!r} is not one of {', '.join(map(repr, allowed))}")
        for name, allowed in literal_choices(fn).items()
        if name in options and options[name] not in allowed
    ]
