"""The configuration reference, generated from the schema's dataclasses: `docs/configuration.md`.

Every key of `mcore-rl sft`, `mcore-rl train` and `mcore-rl rm-train` recipes with its type, default and one line of
help. The help is the field's own comment (on its line, or the comment block right above it); a
nested section without one takes its class docstring's first sentence. The page is written from the
code so that it cannot drift from it: `tests/test_config_reference.py` fails when it is stale.

    python -m mcore_rl.config.reference > docs/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.config.rm_schema import RMConfig
from mcore_rl.config.schema import SFTConfig
from mcore_rl.config.sections import Sectioned, is_sections_field, sections_of

ROOTS: tuple[tuple[str, type], ...] = (
    ("mcore-rl sft", SFTConfig),
    ("mcore-rl train", RLConfig),
    ("mcore-rl rm-train", RMConfig),
)


@dataclass(frozen=True)
class Key:
    """One row of the reference: a dotted key and what the schema says about it."""

    path: str
    type: str
    default: str
    help: str


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its comment in `cls`'s own source: one inside the field's statement (the
    formatter may have wrapped it), else the comment block right above it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # 1-based line -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    (class_def,) = ast.parse(source).body
    assert isinstance(class_def, ast.ClassDef)
    out: dict[str, str] = {}
    for stmt in class_def.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        inside = [comments[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in comments]
        block: list[str] = []
        n = stmt.lineno - 1
        while n in comments and source.splitlines()[n - 1].lstrip().startswith("#"):
            block.insert(0, comments[n])
            n -= 1
        text = " ".join(inside or block)
        if text:
            out[stmt.target.id] = text
    return out


def _comment_of(cls: type, name: str) -> str:
    for klass in cls.__mro__:  # an inherited field's comment sits in the class that declares it
        if name in getattr(klass, "__annotations__", {}):
            return field_comments(klass).get(name, "")
    return ""


def _first_sentence(doc: str | None) -> str:
    if not doc:
        return ""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.match(r"(.+?\.)(\s|$)", text)
    return m.group(1) if m else text


def _nested(hint: object) -> tuple[type | None, bool]:
    """The dataclass a field holds (directly, as list elements, or as an optional section `X | None`),
    and whether it is a list."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        held = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(held) == 1 and dataclasses.is_dataclass(held[0]) and isinstance(held[0], type):
            return held[0], False
    if typing.get_origin(hint) is list:
        (arg,) = typing.get_args(hint) or (None,)
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg, True
    return None, False


def _default(f: dataclasses.Field, owner_default: object) -> str:
    value = getattr(owner_default, f.name)
    return "`" + repr(value) + "`"


def walk(cls: type, prefix: str = "", instance: object | None = None) -> Iterator[Key]:
    """Every key under `cls`, depth first; `instance` holds the defaults (a parent may override them)."""
    if instance is None:
        instance = cls()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if is_sections_field(f):
            continue
        path = f"{prefix}{f.name}"
        help_ = _comment_of(cls, f.name)
        sub, is_list = _nested(hints[f.name])
        type_name = str(f.type).replace("typing.", "")
        if sub is None:
            yield Key(path, type_name, _default(f, instance), help_)
            continue
        help_ = help_ or _first_sentence(sub.__doc__)
        if is_list:
            yield Key(path, type_name, _default(f, instance), help_)
            yield from walk(sub, f"{path}[].")
        elif getattr(instance, f.name) is None:  # an optional section, off by default: its keys' defaults once set
            yield Key(path, type_name, _default(f, instance), help_)
            yield from walk(sub, f"{path}.")
        else:
            yield Key(path, type_name, "(section)", help_)
            yield from walk(sub, f"{path}.", getattr(instance, f.name))
    if isinstance(instance, Sectioned):
        yield from _recipe_sections(instance, prefix)


def _recipe_sections(owner: Sectioned, prefix: str) -> Iterator[Key]:
    """The keys of the recipes' sections registered under `owner` (`config/sections.py`)."""
    for s in sections_of(type(owner)):
        section: object = owner.section(s.cls)
        if not s.flat:
            path = f"{prefix}{s.key}"
            yield Key(path, s.cls.__name__, "(section)", s.help or _first_sentence(s.cls.__doc__))
            yield from walk(s.cls, f"{path}.", section)
            continue
        for f in dataclasses.fields(s.cls):
            help_ = _comment_of(s.cls, f.name)
            yield Key(f"{prefix}{s.key}{f.name}", str(f.type).replace("typing.", ""), _default(f, section), help_)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m mcore_rl.config.reference > docs/configuration.md`; do not edit by hand:",
        "     tests/test_config_reference.py fails when this page and the schema differ. -->",
        "",
        "Every key of the three recipe roots, from the dataclasses in `mcore_rl/config/` (`schema.py`,",
        "`rl_schema.py`, `rm_schema.py`, `observability.py`) and the sections the recipes register",
        "(`mcore_rl/recipes/config/`), with its type, its default and the field's own comment.",
        "A recipe is YAML (`defaults: [base.yaml]` to start from another); any key can be overridden on",
        "the command line as `dotted.key=value` (`data.domains[0].weight=3` for a listed entry).",
        "Unknown keys, wrong types and values the rules refuse fail before any worker starts, naming",
        "the key. `[]` marks the fields of each entry of a list.",
        "",
    ]
    for command, root in ROOTS:
        out += [f"## `{command}` ({root.__name__})", "", _first_sentence(root.__doc__), ""]
        out += ["| key | type | default | help |", "| --- | --- | --- | --- |"]
        for k in walk(root):
            out.append(f"| `{k.path}` | `{_cell(k.type)}` | {_cell(k.default)} | {_cell(k.help)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
