"""The calculator tool: arithmetic on numbers, parsed as a Python expression and evaluated node by node.

Never `eval`: the expression's syntax tree may hold only numbers, + - * / // % **, unary signs,
parentheses and a few math functions (sqrt, abs, round, min, max, floor, ceil, log, exp, factorial,
gcd); a name, an attribute, a call of anything else is refused. Powers and factorials are capped so
one call cannot spend minutes or gigabytes on `9**9**9`.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from mcore_rl.data.tool_calls import ToolSpec
from mcore_rl.envs.tools.toolset import Tool, ToolError

Number = int | float
MAX_EXPONENT = 1000
MAX_FACTORIAL = 1000
MAX_DIGITS = 4300  # Python's own limit on int -> str
MAX_BITS = int(MAX_DIGITS * 3.33)
MAX_CHARS = 500

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _factorial(x: Number) -> int:
    if not float(x).is_integer() or not 0 <= x <= MAX_FACTORIAL:
        raise ToolError(f"factorial takes an integer from 0 to {MAX_FACTORIAL}")
    return math.factorial(int(x))


_FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "factorial": _factorial,
    "gcd": math.gcd,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) not in (0, 1):
            if abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
            if isinstance(left, int) and left.bit_length() * abs(right) > MAX_BITS:
                raise ToolError(f"the result would have more than {MAX_DIGITS} digits")
        return _BINARY[type(node.op)](left, right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*[_eval(a) for a in node.args])
    raise ToolError(f"not arithmetic: {ast.unparse(node)!r}")


def calculate(expression: str) -> str:
    """The value of `expression` as text; `ToolError` naming what is wrong with it."""
    if len(expression) > MAX_CHARS:
        raise ToolError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    try:
        value = _eval(tree)
    except ToolError:
        raise
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise ToolError(f"{type(exc).__name__}: {exc}") from None
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ToolError(f"the result has more than {MAX_DIGITS} digits")
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


class Calculator(Tool):
    spec = ToolSpec(
        name="calculator",
        description="Evaluate an arithmetic expression (+ - * / // % **, sqrt, log, factorial, ...).",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 * 23) - sqrt(16)"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    )

    def run(self, arguments: dict[str, Any], timeout_s: float) -> str:
        return calculate(arguments["expression"])
