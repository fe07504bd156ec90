"""How an analysis's numbers are printed: nested dicts of numbers and strings as an indented table."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_table(result: dict[str, Any], indent: int = 0) -> str:
    """One `key  value` line per leaf; nested dicts indent; lists of dicts become rows of a table."""
    lines: list[str] = []
    pad = " " * indent
    width = max((len(str(k)) for k in result), default=0)
    for key, value in result.items():
        if isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines.append(format_table(value, indent + 2))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            cols = list(dict.fromkeys(c for row in value for c in row))
            cells = [[_fmt(row.get(c, "")) for c in cols] for row in value]
            widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
            lines.append(f"{pad}{key}:")
            lines.append(pad + "  " + "  ".join(c.rjust(w) for c, w in zip(cols, widths)))
            lines.extend(pad + "  " + "  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in cells)
        else:
            lines.append(f"{pad}{str(key).ljust(width)}  {_fmt(value)}")
    return "\n".join(lines)
