"""What judge rewards leave in `Sample.info`, as reward heads the learner's algorithms read.

A reward head is one float per sample; some judges give several values per sample, in their info.
`JudgeHeads.batch_step` runs on every rank after a batch is broadcast (`RLRun.rollouts`), only for
the algorithms the recipe names, and adds heads *after* the reward was summed, so they never enter
`Sample.reward`:

* **ExpRL-Process** (advantage shaping "exprl_segments"): the "exprl_process" judge reward sees
  text only and leaves `segment_scores` and `segment_ends` (character offsets into the completion);
  the learner sees tokens only. Each segment end becomes a token index of the response with the
  run's tokenizer: heads `<prefix>_s<k>` / `<prefix>_e<k>` (`algos/exprl.py: segment_heads`). Token
  j ends at len(decode(ids[:j+1])); a segment ends after the last token that ends at or before its
  character end (`rewards/judge.py: token_advantages`' rule: a token belongs to the segment it ends
  in). The prefix lengths do not decrease, so each end is a binary search (K·log T decodes, not T);
  the last segment always ends at the response's last token.
* **RLCER** (reward shaping "rlcer"): the "rubric" judge reward leaves one 0/1 `verdicts` entry per
  rubric constraint; the prompt's label holds the rubrics' signed scores (`rubric_scores`, one per
  constraint). Heads `<prefix>_v<k>` (verdict) and `<prefix>_w<k>` (score).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.algos.exprl import segment_heads
from mcore_rl.hooks import Recipe

SEGMENT_SHAPING, RUBRIC_SHAPING = "exprl_segments", "rlcer"  # the algorithms that read the heads


def token_segment_ends(tokenizer: Any, ids: Sequence[int], char_ends: Sequence[int]) -> list[int]:
    """For each segment's character end, the number of response tokens that end at or before it
    (the segment's exclusive token end); the last one is len(ids)."""
    ids = list(ids)
    out: list[int] = []
    for c in char_ends[:-1]:
        lo, hi = 0, len(ids)  # the largest j with len(decode(ids[:j])) <= c
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tokenizer.decode(ids[:mid])) <= c:
                lo = mid
            else:
                hi = mid - 1
        out.append(max(lo, out[-1] if out else 0))
    return out + [len(ids)]


def add_segment_heads(samples: Sequence[Any], tokenizer: Any, prefix: str = "exprl") -> int:
    """ExpRL-Process's segment heads on every sample whose info holds its prefix scores; how many."""
    done = 0
    for s in samples:
        scores, ends = s.info.get("segment_scores"), s.info.get("segment_ends")
        if not scores or not ends or len(scores) != len(ends) or s.reward_error is not None:
            continue
        s.reward_heads.update(segment_heads(scores, token_segment_ends(tokenizer, s.response_ids, ends), prefix))
        done += 1
    return done


def rubric_scores_of(label: Any) -> Any:
    return label.get("rubric_scores") if isinstance(label, dict) else None


def add_rubric_heads(samples: Sequence[Any], prefix: str = "rlcer") -> int:
    """RLCER's verdict and score heads on every sample with rubric verdicts and as many scores in
    its prompt's label; how many."""
    done = 0
    for s in samples:
        verdicts, scores = s.info.get("verdicts"), rubric_scores_of(s.prompt.label)
        if (
            not verdicts
            or not isinstance(scores, (list, tuple))
            or len(scores) != len(verdicts)
            or s.reward_error is not None
        ):
            continue
        for k, (v, w) in enumerate(zip(verdicts, scores)):
            s.reward_heads[f"{prefix}_v{k}"] = float(v)
            s.reward_heads[f"{prefix}_w{k}"] = float(w)
        done += 1
    return done


def add_judge_heads(algorithm: Any, samples: Sequence[Any], tokenizer: Any) -> dict[str, float]:
    """The heads the recipe's algorithms read (`algorithm.advantage_shaping` / `reward_shaping`),
    and the share of samples that got them."""
    metrics: dict[str, float] = {}
    n = max(len(samples), 1)
    for step in algorithm.advantage_shaping:
        if step.name == SEGMENT_SHAPING:
            metrics["exprl/segmented_frac"] = (
                add_segment_heads(samples, tokenizer, step.options.get("prefix", "exprl")) / n
            )
    for step in algorithm.reward_shaping:
        if step.name == RUBRIC_SHAPING:
            metrics["rlcer/rubric_frac"] = add_rubric_heads(samples, step.options.get("prefix", "rlcer")) / n
    return metrics


class JudgeHeads(Recipe):
    """ExpRL's segment heads and RLCER's rubric heads on every batch, before the learner."""

    name = "judge_heads"

    @classmethod
    def enabled(cls, cfg: RLConfig) -> bool:
        a = cfg.algorithm
        return any(x.name == SEGMENT_SHAPING for x in a.advantage_shaping) or any(
            x.name == RUBRIC_SHAPING for x in a.reward_shaping
        )

    def batch_step(self, samples: Sequence[Any], run: Any) -> dict[str, float]:
        return add_judge_heads(self.cfg.algorithm, samples, run.tokenizer)
