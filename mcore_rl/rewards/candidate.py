"""The sandbox side of a checked code run, and the plain-data format that crosses the sandbox.

The checker (`mcore_rl/rewards/checker.py`) holds the tests; the candidate program runs in the
sandbox and never sees them. This module's source is the sandbox's `main.py` (standard library
only: it runs under `python -I -S`, without site-packages): `serve` loads the program, then answers
the checker's requests on file descriptor 3, one JSON line each way — "which of these names do you
define" and "call `name` with these arguments". Only data crosses: a value is sent as JSON built by
`to_wire` and rebuilt by `from_wire` from exact built-in types (None, bool, int, float, complex,
str, bytes, list, tuple, dict, set, frozenset). `from_wire` makes new objects of those types and
nothing else, so whatever the program returns — an `int` subclass whose `__eq__` is always true,
an object with a patched `__repr__` — reaches the checker as plain data or not at all. The program
controls what it answers (that is what is being tested), never how the answer is judged.
"""

import json
import os
import sys
from typing import Any

_MAX_DEPTH = 64
_TAGS = ("t", "d", "s", "fs", "b", "c", "nan", "inf")


class WireError(ValueError):
    """A value that is not plain data, or a message that is not in the format."""


def to_wire(value: Any, depth: int = 0) -> Any:
    """`value` as JSON-able data (exact built-in types only; WireError otherwise)."""
    if depth > _MAX_DEPTH:
        raise WireError("nested deeper than %d levels" % _MAX_DEPTH)
    t = type(value)
    if value is None or t is bool or t is int or t is str:
        return value
    if t is float:
        if value != value:
            return {"nan": 1}
        if value in (float("inf"), float("-inf")):
            return {"inf": 1 if value > 0 else -1}
        return value
    if t is list:
        return [to_wire(v, depth + 1) for v in value]
    if t is tuple:
        return {"t": [to_wire(v, depth + 1) for v in value]}
    if t is dict or (isinstance(value, dict) and t.__module__ == "collections"):  # OrderedDict, Counter, ...
        return {"d": [[to_wire(k, depth + 1), to_wire(v, depth + 1)] for k, v in dict.items(value)]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [to_wire(v, depth + 1) for v in value]}
    if t is bytes:
        import base64  # only when bytes cross (its import costs a few ms of every run)

        return {"b": base64.b64encode(value).decode()}
    if t is complex:
        return {"c": [to_wire(value.real, depth + 1), to_wire(value.imag, depth + 1)]}
    raise WireError("a %s is not plain data" % t.__name__)


def from_wire(data: Any, depth: int = 0) -> Any:
    """The value `to_wire` encoded, rebuilt from exact built-in types (WireError otherwise)."""
    if depth > _MAX_DEPTH:
        raise WireError("nested deeper than %d levels" % _MAX_DEPTH)
    t = type(data)
    if data is None or t is bool or t is int or t is float or t is str:
        return data
    if t is list:
        return [from_wire(v, depth + 1) for v in data]
    if t is not dict or len(data) != 1 or next(iter(data)) not in _TAGS:
        raise WireError("not a value of the wire format: %.80r" % (data,))
    tag, body = next(iter(data.items()))
    try:
        if tag == "nan":
            return float("nan")
        if tag == "inf":
            return float("inf") if body == 1 else float("-inf")
        if tag == "b":
            import base64

            return base64.b64decode(str(body), validate=True)
        if type(body) is not list:
            raise WireError("a %r value needs a list" % tag)
        items = [from_wire(v, depth + 1) for v in body]
        if tag == "t":
            return tuple(items)
        if tag == "s":
            return set(items)
        if tag == "fs":
            return frozenset(items)
        if tag == "c":
            if len(items) != 2 or not all(type(v) in (int, float) for v in items):
                raise WireError("a complex needs two numbers")
            return complex(items[0], items[1])
        if not all(type(kv) is list and len(kv) == 2 for kv in body):
            raise WireError("a dict needs [key, value] pairs")
        return {from_wire(k, depth + 1): from_wire(v, depth + 1) for k, v in body}
    except (TypeError, ValueError) as exc:  # unhashable set members or keys, bad base64
        if isinstance(exc, WireError):
            raise
        raise WireError("%s: %s" % (type(exc).__name__, exc)) from None


def dumps(message: dict[str, Any]) -> bytes:
    """One line of the protocol (JSON, no raw newline)."""
    return (json.dumps(message, separators=(",", ":"), allow_nan=False) + "\n").encode()


def loads(line: str | bytes) -> dict[str, Any]:
    """A message line -> dict (WireError if it is not one)."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise WireError("not a JSON line: %s" % exc) from None
    if type(message) is not dict:
        raise WireError("a message must be a JSON object")
    return message


# ------------------------------------------------------------------------------ in the sandbox


def _describe(exc: BaseException) -> dict[str, Any]:
    return {"raised": type(exc).__name__, "message": str(exc)[:300]}


def _answer(scope: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The reply to one request (see the module docstring)."""
    op = request.get("op")
    if op == "names":
        kinds = {}
        for name in request.get("names", []):
            if name not in scope:
                kinds[name] = {"kind": "missing"}
            elif type(scope[name]) is type(sys):
                kinds[name] = {"kind": "module", "module": getattr(scope[name], "__name__", "")}
            elif callable(scope[name]):
                kinds[name] = {"kind": "callable"}
            else:
                try:
                    kinds[name] = {"kind": "value", "value": to_wire(scope[name])}
                except WireError as exc:
                    kinds[name] = {"kind": "opaque", "why": str(exc)}
        return {"names": kinds}
    if op == "call":
        fn = scope.get(str(request.get("name")))
        if fn is None:
            return {"raised": "NameError", "message": "name %r is not defined" % request.get("name")}
        try:
            args = from_wire(request.get("args", []))
            kwargs = from_wire(request.get("kwargs", {"d": []}))
            result = fn(*args, **kwargs)
        except BaseException as exc:
            return _describe(exc)
        try:
            return {"value": to_wire(result)}
        except WireError as exc:
            return {"raised": "TypeError", "message": "the candidate returned %s" % exc}
    return {"raised": "ValueError", "message": "unknown request %r" % (op,)}


def serve(program: str, fd: int = 3) -> None:
    """Load `program` as module `solution`, then answer requests on `fd` until it closes."""
    import builtins

    me = os.getpid()
    scope = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(program, "solution.py", "exec"), scope)
        loaded: dict[str, Any] | None = {"loaded": True}
    except BaseException as exc:
        loaded = dict(_describe(exc), loaded=False)
    buffer = b""
    while True:
        if os.getpid() != me:  # a forked copy of the program: only the original answers
            os._exit(0)
        if loaded is not None:
            _write_all(fd, dumps(loaded))
            if not loaded["loaded"]:
                return
            loaded = None
        while b"\n" not in buffer:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            buffer += chunk
        line, buffer = buffer.split(b"\n", 1)
        request = loads(line)
        reply = _answer(scope, request)
        if os.getpid() != me:
            os._exit(0)
        reply["id"] = request.get("id")
        _write_all(fd, dumps(reply))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
