"""Reading line-oriented data files (SFT jsonl/text, RL prompt jsonl) with one policy for bad lines.

Every problem is reported as `path:line: problem`. `data.on_bad_line=error` (the default) raises
`DataError` at the first one; `skip` logs it and leaves the line out.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """Unusable training data; the message names the file (and line) at fault."""


class BadLines:
    """The `data.on_bad_line` policy for one file; counts what it skipped."""

    def __init__(self, path: str, policy: str) -> None:
        self.path, self.policy, self.count = path, policy, 0

    def report(self, lineno: int, problem: str) -> None:
        msg = f"{self.path}:{lineno}: {problem}"
        if self.policy == "error":
            raise DataError(msg + " (set data.on_bad_line=skip to skip bad lines)")
        self.count += 1
        logger.warning("skipping bad line %s", msg)


def read_lines(path: str | None, bad: BadLines, key: str = "data.path") -> list[tuple[int, str | None]]:
    """(line number, text) of every line of `path`; None for a line that is not UTF-8 (reported to
    `bad`), so a single bad byte costs one line, not the file. `key` names the setting in errors."""
    if path is None or not os.path.isfile(path):
        what = "is a directory, not a file" if path and os.path.isdir(path) else "no such file"
        raise DataError(f"{key}: {what}: {path}")
    with open(path, "rb") as f:
        raw_lines = f.read().splitlines()
    lines: list[tuple[int, str | None]] = []
    for lineno, raw in enumerate(raw_lines, start=1):
        try:
            lines.append((lineno, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            bad.report(lineno, f"not valid UTF-8 ({e.reason} at byte {e.start})")
            lines.append((lineno, None))
    return lines


def json_objects(lines: list[tuple[int, str | None]], bad: BadLines) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every line that is a JSON object; blank and undecodable lines are
    passed over, anything else is reported to `bad`."""
    for lineno, line in lines:
        if line is None or not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            bad.report(lineno, f"invalid JSON: {e.msg} (column {e.colno})")
            continue
        if not isinstance(obj, dict):
            bad.report(lineno, f"expected a JSON object, got {type(obj).__name__}")
            continue
        yield lineno, obj
