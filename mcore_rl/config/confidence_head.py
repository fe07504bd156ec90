"""The file format of DSpark's trained confidence head (`rollout.speculative_confidence_head`).

Read here, without torch, so the config check can refuse a bad file before any engine starts; the
engine's `rollout/engine/spec_confidence.py: ConfidenceHead.load` reads it through the same function.
"""

from __future__ import annotations

import json

# the per-draft features the engine computes, in the order the head's weights follow
FEATURES = ("bias", "log_position", "acceptance_logit", "draft_max_prob", "draft_entropy", "ngram_match")


def read_confidence_head(path: str) -> tuple[list[float], list[float]]:
    """(weights, per-position temperatures) of the head `tools/train_confidence_head.py` wrote;
    OSError for an unreadable file, ValueError naming what does not fit this engine."""
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_confidence_head: {path} is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_confidence_head: {path} holds no head (a JSON object)")
    if tuple(raw.get("features", ())) != FEATURES:
        raise ValueError(
            f"speculative_confidence_head: {path} was trained on features {raw.get('features')}, this engine "
            f"computes {list(FEATURES)}"
        )
    try:
        weights = [float(w) for w in raw["weights"]]
        temps = [float(t) for t in raw.get("temperatures", [1.0])]
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"speculative_confidence_head: {path}: weights or temperatures missing or not numbers"
        ) from None
    if len(weights) != len(FEATURES) or not temps or min(temps) <= 0:
        raise ValueError(f"speculative_confidence_head: {path}: bad weights or temperatures")
    return weights, temps
