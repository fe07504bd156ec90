"""Checking a tool call's arguments against its JSON schema: the subset tool schemas use.

`jsonschema` is not a dependency; tool parameter schemas use a small part of JSON Schema, checked
here: `type` (one or a list of: object, array, string, integer, number, boolean, null), `properties`,
`required`, `additionalProperties: false`, `enum`, `items`, `minimum`/`maximum`, `minLength`/
`maxLength`. A keyword outside that subset is refused when the tool is built (`unsupported`), so a
schema is never half-checked in silence.
"""

from __future__ import annotations

from typing import Any

SUPPORTED = frozenset(
    (
        "type",
        "properties",
        "required",
        "additionalProperties",
        "enum",
        "items",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "description",
        "title",
        "default",
    )
)
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def unsupported(schema: Any, where: str = "parameters") -> list[str]:
    """The keywords of `schema` (and its sub-schemas) this validator does not check, with their path."""
    if not isinstance(schema, dict):
        return [f"{where} is not an object"]
    out = [f"{where}.{key}" for key in schema if key not in SUPPORTED]
    for name, sub in (schema.get("properties") or {}).items():
        out += unsupported(sub, f"{where}.properties.{name}")
    if isinstance(schema.get("items"), dict):
        out += unsupported(schema["items"], f"{where}.items")
    types = schema.get("type", [])
    for t in [types] if isinstance(types, str) else types:
        if t not in _TYPES:
            out.append(f"{where}.type {t!r}")
    return out


def _is(value: Any, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[kind])


def validate(value: Any, schema: dict[str, Any], where: str = "arguments") -> list[str]:
    """Every way `value` breaks `schema`, each naming the field ("arguments.code: expected string")."""
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        kinds = [types] if isinstance(types, str) else list(types)
        if not any(_is(value, k) for k in kinds):
            return [f"{where}: expected {' or '.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{where}.{name}: required")
        for name, item in value.items():
            if name in props:
                errors += validate(item, props[name], f"{where}.{name}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}.{name}: not a parameter (expected: {', '.join(props) or 'none'})")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], f"{where}[{i}]")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: {value} is below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: {value} is above {schema['maximum']}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: longer than {schema['maxLength']} characters")
    return errors
