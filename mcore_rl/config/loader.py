"""YAML recipe + dotted command-line overrides -> a typed config tree (design decision 7).

Everything is checked against the dataclass schema while loading, so an unknown key or a value of
the wrong type fails here, naming the full dotted key, instead of deep inside a training process.
Cross-field rules (parallel sizes, batch sizes, ...) live in `mcore_rl.config.validate`.

A recipe may start with `defaults: [base.yaml, ...]`: those files (paths relative to the recipe) are
loaded first and the recipe's own keys are merged over them, mapping by mapping.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal, TypeVar, Union, cast

import yaml

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.sections import Sectioned, is_sections_field, sections_of

T = TypeVar("T")

_MISSING = object()


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def load_config(root_cls: type[T], yaml_path: str | None = None, overrides: list[str] | None = None) -> T:
    """Build `root_cls` from a YAML recipe (optional) and `a.b.c=value` overrides, in that order."""
    raw: dict[str, Any] = _read_recipe(yaml_path, root_cls, stack=()) if yaml_path else {}
    for item in overrides or []:
        _apply_override(raw, root_cls, item)
    return _build(root_cls, raw, prefix="")


def config_from_dict(root_cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """`root_cls` from a nested dict of its YAML keys (`config_to_dict`'s inverse; sections' keys where
    the YAML has them, values checked as a recipe's are); `prefix` names the keys in messages."""
    return cast(T, _build(root_cls, data, prefix))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain nested dict of a config tree (what `save_config` writes), recipe sections at their YAML keys."""
    out = _plain(cfg)
    assert isinstance(out, dict)
    return out


def _plain(value: Any) -> Any:
    if not (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        if isinstance(value, (list, tuple)):
            return type(value)(_plain(v) for v in value)
        if isinstance(value, dict):
            return {k: _plain(v) for k, v in value.items()}
        return copy.deepcopy(value)
    out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not is_sections_field(f)}
    if isinstance(value, Sectioned):
        for s in sections_of(type(value)):
            body = _plain(value.section(s.cls))
            if s.flat:
                out.update({key: body[name] for key, name in s.yaml_keys().items()})
            else:
                out[s.key] = body
    return out


def save_config(cfg: Any, path: str) -> None:
    """Write the resolved config as YAML, so a run records exactly what it trained with."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------
# reading recipes
# ---------------------------------------------------------------------------------------------


def _read_recipe(path: str, root_cls: type, stack: tuple[str, ...]) -> dict[str, Any]:
    path = os.path.abspath(path)
    if path in stack:
        raise ConfigError(f"'defaults' cycle: {' -> '.join(stack + (path,))}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping, got {type(data).__name__}")
    has_defaults_field = any(f.name == "defaults" for f in dataclasses.fields(root_cls))
    bases = [] if has_defaults_field else data.pop("defaults", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: 'defaults' must be a list of YAML file paths, got {bases!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        if not os.path.isfile(base_path):
            raise ConfigError(
                f"{path}: 'defaults' names {base!r}, which is not a file (looked for {base_path}; "
                "relative paths are relative to the recipe)"
            )
        _deep_merge(merged, _read_recipe(base_path, root_cls, stack + (path,)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _deep_merge(dst[key], value)
        else:
            dst[key] = value


# ---------------------------------------------------------------------------------------------
# overrides
# ---------------------------------------------------------------------------------------------


_INDEXED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\[(\d+)\]$")


def _split_index(part: str) -> tuple[str, int | None]:
    """ "domains[2]" -> ("domains", 2); "lr" -> ("lr", None)."""
    m = _INDEXED.match(part)
    return (m.group(1), int(m.group(2))) if m else (part, None)


def _list_item_cls(tp: Any) -> type | None:
    """The dataclass of a `list[SomeConfig]` field's items (looking through Optional), else None."""
    for t in (tp, *typing.get_args(tp)) if _is_union(tp) else (tp,):
        if typing.get_origin(t) is list and typing.get_args(t) and dataclasses.is_dataclass(typing.get_args(t)[0]):
            return typing.get_args(t)[0]
    return None


def _apply_override(raw: dict[str, Any], root_cls: type, item: str) -> None:
    """Set `a.b.c=value` (or `a.items[i].c=value`, for an entry the recipe already lists) in the raw
    dict; the key path is checked against the schema first. A mapping given for a section is merged
    into the recipe's, as a dotted key per entry would be, so the section's other keys stay."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.path=value")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty component in key {key!r}")

    cls: Any = root_cls
    names: list[tuple[str, int | None]] = []
    leaf_type: Any = None
    for i, part in enumerate(parts):
        name, index = _split_index(part)
        dotted = ".".join(parts[:i] + [name])
        if cls is None:
            raise ConfigError(f"override {item!r}: '{'.'.join(parts[:i])}' is not a section, it has no key {name!r}")
        field_types = _keys(cls)
        if name not in field_types:
            raise ConfigError(f"override {item!r}: {_unknown_key_message(dotted, name, list(field_types))}")
        if index is None:
            leaf_type, cls = field_types[name], _dataclass_in(field_types[name])
        else:
            cls = _list_item_cls(field_types[name])
            if cls is None:
                raise ConfigError(f"override {item!r}: '{dotted}' is not a list of sections, it cannot be indexed")
            leaf_type = cls
        names.append((name, index))

    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: cannot parse value {text!r}: {e}") from e
    # A str field keeps the literal text, so `run_dir=2024` or `data.path=1.jsonl` stay strings.
    if isinstance(value, (int, float, bool)) and _accepts_str(leaf_type):
        value = text

    node: Any = raw
    for i, (name, index) in enumerate(names):
        where = ".".join(parts[: i + 1])
        last = i == len(names) - 1
        if index is not None:
            items = node.get(name)
            if not isinstance(items, list) or not 0 <= index < len(items):
                count = len(items) if isinstance(items, list) else 0
                raise ConfigError(
                    f"override {item!r}: '{'.'.join(parts[:i] + [name])}' has {count} entr"
                    f"{'y' if count == 1 else 'ies'} in the recipe, so [{index}] does not exist"
                )
            if last:
                items[index] = value
                return
            if not isinstance(items[index], dict):
                raise ConfigError(f"override {item!r}: '{where}' is {items[index]!r}, not a section")
            node = items[index]
            continue
        if last:
            if cls is not None and isinstance(value, dict) and isinstance(node.get(name), dict):
                _deep_merge(node[name], value)  # `optimizer={lr: 1e-5}` keeps the recipe's other keys
            else:
                node[name] = value
            return
        child = node.get(name)
        if not isinstance(child, dict):
            if child is not None:
                raise ConfigError(f"override {item!r}: '{where}' is {child!r}, not a section")
            child = node[name] = {}
        node = child


def _accepts_str(tp: Any) -> bool:
    return tp is str or (_is_union(tp) and str in typing.get_args(tp))


# ---------------------------------------------------------------------------------------------
# building typed objects
# ---------------------------------------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not is_sections_field(f)}


def _keys(cls: type) -> dict[str, Any]:
    """Every YAML key of `cls`'s mapping and its type: its fields, then the registered recipe sections
    (`config/sections.py`): a nested one as its key, a flat one as its prefixed fields."""
    keys = _field_types(cls)
    for s in sections_of(cls):
        if s.flat:
            hints = _field_types(s.cls)
            keys.update({key: hints[name] for key, name in s.yaml_keys().items()})
        else:
            keys[s.key] = s.cls
    return keys


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field holds (looking through Optional), or None for a leaf field."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if _is_union(tp):
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


def _unknown_key_message(dotted: str, key: str, allowed: list[str]) -> str:
    parent = dotted.rsplit(".", 1)[0] if "." in dotted else ""
    where = f"under '{parent}'" if parent else "at the top level"
    msg = f"unknown config key '{dotted}'"
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        msg += f"; did you mean '{(parent + '.') if parent else ''}{close[0]}'?"
    return msg + f" Allowed keys {where}: {', '.join(allowed)}"


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix or '<root>'}' must be a mapping of {cls.__name__} fields, got {data!r}")
    field_types = _field_types(cls)
    allowed = _keys(cls)
    for key in data:
        if key not in allowed:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(_unknown_key_message(dotted, str(key), list(allowed)))
    kwargs: dict[str, Any] = {}
    for name, tp in field_types.items():
        if name in data:
            kwargs[name] = _convert(tp, data[name], f"{prefix}.{name}" if prefix else name)
    if issubclass(cls, Sectioned):
        kwargs["sections"] = _build_sections(cls, data, prefix)
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.init
        and f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = prefix or "<root>"
        raise ConfigError(f"missing required config key(s) {', '.join(f'{where}.{m}' for m in missing)}")
    return cls(**kwargs)


def _build_sections(owner: type, data: dict[str, Any], prefix: str) -> dict[type, object]:
    """Every registered section of `owner` from its keys in `data` (defaults where it has none)."""
    out: dict[type, object] = {}
    where = f"{prefix}." if prefix else ""
    for s in sections_of(owner):
        if s.flat:
            body = {name: data[key] for key, name in s.yaml_keys().items() if key in data}
            hints = _field_types(s.cls)
            out[s.cls] = s.cls(**{name: _convert(hints[name], v, f"{where}{s.key}{name}") for name, v in body.items()})
        else:
            out[s.cls] = _convert(s.cls, data[s.key], f"{where}{s.key}") if s.key in data else s.cls()
    return out


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    """Check (and minimally coerce) one value against its annotated type."""
    value_out = _try_convert(tp, value, key)
    if value_out is _MISSING:
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value_out


def _try_convert(tp: Any, value: Any, key: str) -> Any:
    if tp is Any:
        return value
    if tp is type(None):
        return None if value is None else _MISSING
    origin = typing.get_origin(tp)
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None:
            return None if type(None) in args else _MISSING
        for arg in args:
            if arg is type(None):
                continue
            out = _try_convert(arg, value, key)
            if out is not _MISSING:
                return out
        return _MISSING
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if type(value) is type(allowed) and value == allowed:
                return value
        return _MISSING
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return _MISSING
        args = typing.get_args(tp)
        elem = args[0] if args else Any
        items = [_convert(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        return dict(value) if isinstance(value, dict) else _MISSING
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key) if isinstance(value, (dict, tp)) else _MISSING
    if tp is bool:
        return value if isinstance(value, bool) else _MISSING
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
    if tp is float:
        if isinstance(value, bool):
            return _MISSING
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                return _MISSING
        return _MISSING
    if tp is str:
        return value if isinstance(value, str) else _MISSING
    return value if isinstance(value, tp) else _MISSING
