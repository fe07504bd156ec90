"""Cutting a long text to a character budget, from the side that matters least.

Tool results and observations can be huge (a program that prints a megabyte, a page of search hits);
the model's context cannot. "right" keeps the head (a listing, a page), "left" keeps the tail (a
traceback ends with the error), "middle" keeps both ends. The marker says how much went, so the model
knows the text was cut.
"""

from __future__ import annotations

from typing import Literal

TruncationSide = Literal["left", "right", "middle"]
SIDES: tuple[str, ...] = ("left", "right", "middle")


def truncate(text: str, limit: int, side: TruncationSide = "right") -> tuple[str, bool]:
    """`text` cut to at most `limit` characters (marker included) from `side`; whether it was cut."""
    if len(text) <= limit:
        return text, False
    marker = f"[...{len(text) - limit} chars cut...]"
    keep = max(0, limit - len(marker))
    if side == "right":
        return text[:keep] + marker, True
    if side == "left":
        return marker + text[len(text) - keep :], True
    if side == "middle":
        head = keep // 2
        return text[:head] + marker + text[len(text) - (keep - head) :], True
    raise ValueError(f"truncation side must be one of {', '.join(SIDES)}, got {side!r}")
