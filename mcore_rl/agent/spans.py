"""Tagged step spans: which response tokens lie inside an action's tags (`<action>...</action>`).

StepOPSD ("Step-Aware Online Preference Distillation for Agent Reinforcement Learning", Independent
Researcher & Tencent, 2026) shapes only the action-centred span of each step ("action_only"): the
teacher's re-weighting applies to the tokens of the action, while the reasoning around it keeps its
RL advantage. A domain's `environment.distill_span_tags: [open, close]` turns this on; each sample
of the domain then carries, per response token, 1 inside a tagged span and 0 elsewhere
(`Sample.info[DISTILL_SPAN]`), and the learner multiplies the distillation mask by it
(`train/distillation.py: teacher_view`), so every distillation term sees only those tokens. A
response without a closed span distils nothing (StepOPSD: its advantages stay A).

A token is inside when its characters overlap the text between an opening and the next closing tag
(the tags themselves are not); tokens are mapped to characters by decoding, so this works for any
tokenizer, including byte-level ones whose tokens split a character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def char_spans(text: str, open_tag: str, close_tag: str) -> list[tuple[int, int]]:
    """[start, end) of the text inside each `open_tag ... close_tag` pair, left to right; an
    opening without a closing tag after it is no span."""
    spans: list[tuple[int, int]] = []
    at = 0
    while True:
        start = text.find(open_tag, at)
        if start < 0:
            return spans
        inner = start + len(open_tag)
        end = text.find(close_tag, inner)
        if end < 0:
            return spans
        spans.append((inner, end))
        at = end + len(close_tag)


def token_offsets(ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[tuple[int, int]]:
    """[start, end) characters of each token in `decode(ids)`: each token decoded alone when that
    rebuilds the text (the usual case), else by the growth of the decoded prefix (a token that ends
    in the middle of a character gets the characters its prefix completes)."""
    pieces = [decode([i]) for i in ids]
    if "".join(pieces) == decode(list(ids)):
        out: list[tuple[int, int]] = []
        at = 0
        for p in pieces:
            out.append((at, at + len(p)))
            at += len(p)
        return out
    out = []
    prev = 0
    for j in range(1, len(ids) + 1):
        n = len(decode(list(ids[:j])))
        out.append((prev, max(prev, n)))
        prev = max(prev, n)
    return out


def tagged_token_mask(
    ids: Sequence[int], decode: Callable[[list[int]], str], open_tag: str, close_tag: str
) -> list[int]:
    """Per token of `ids`: 1 when its characters overlap a tagged span of the decoded text, else 0."""
    spans = char_spans(decode(list(ids)), open_tag, close_tag)
    if not spans:
        return [0] * len(ids)
    return [int(any(a < e and s < b for s, e in spans)) for a, b in token_offsets(ids, decode)]
