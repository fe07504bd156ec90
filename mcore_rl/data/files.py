"""Reading line-oriented data files (SFT jsonl/text, RL prompt jsonl) with one policy for bad lines.

Every problem is reported as `path:line: problem`. `data.on_bad_line=error` (the default) raises
`DataError` at the first one; `skip` logs it and leaves the line out.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, NoReturn
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """Unusable training data; the message names the file (and line) at fault."""


class BadLines:
    """The `data.on_bad_line` policy for one file; counts what it skipped. `what`: a file that is
    read whole or not at all (no `data.on_bad_line` applies): its errors say `not <what>: ...`."""

    def __init__(self, path: str, policy: str, what: str | None = None) -> None:
        self.path, self.policy, self.count, self.what = path, policy, 0, what

    def fail(self, lineno: int, problem: str) -> NoReturn:
        """The error of a line of a file read whole or not at all."""
        raise DataError(f"{self.path}:{lineno}: not {self.what or 'usable'}: {problem}"[:300])

    def report(self, lineno: int, problem: str) -> None:
        if self.what is not None:
            self.fail(lineno, problem)
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


def strict_jsonl(path: str, what: str) -> Iterator[tuple[int, BadLines, dict[str, Any]]]:
    """(line number, the file's reporter, object) of every JSON-object line of `path`, for files that
    are read whole or not at all (a skill library, a search corpus, a diagnosis's texts): the first
    line that is not UTF-8, not JSON or not an object raises `DataError` (a ValueError) as
    `path:line: not <what>: <problem>`; the caller reports its own checks of an object the same way
    (`bad.fail(line, problem)`). Blank lines are passed over."""
    bad = BadLines(path, "error", what)
    for lineno, obj in json_objects(read_lines(path, bad, key="file"), bad):
        yield lineno, bad, obj
