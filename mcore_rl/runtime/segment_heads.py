"""ExpRL-Process's segment scores from `Sample.info` to reward heads the learner reads.

The "exprl_process" judge reward (`rewards/judge.py`) sees text only: it scores every prefix that
ends a "###" segment and leaves `segment_scores` and `segment_ends` (character offsets into the
completion) in its info. The learner sees tokens only. This step, run on every rank after a batch
is broadcast (`RLRun.rollouts`), maps each segment end to a token index of the response with the
run's tokenizer and writes the heads `exprl_s<k>` / `exprl_e<k>` (`algos/exprl.py:
segment_heads`) that advantage shaping "exprl_segments" spreads over the tokens. The heads are added
after the reward was summed, so they never enter `Sample.reward`.

Token k ends at len(decode(ids[:k+1])); a segment ends after the last token that ends at or before
its character end (`rewards/judge.py: token_advantages`' rule: a token belongs to the segment it
ends in). The prefix lengths are non-decreasing in k, so each end is a binary search: K·log T
decodes per sample, not T. The last segment always ends at the response's last token.
"""

from __future__ import annotations

from typing import Any, Sequence

from mcore_rl.algos.exprl import segment_heads


def token_segment_ends(tokenizer: Any, ids: Sequence[int], char_ends: Sequence[int]) -> list[int]:
    """For each segment's character end, the number of response tokens that end at or before it
    (the segment's exclusive token end); the last one is len(ids)."""
    ids = list(ids)
    out = []
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
    """Write the segment heads of every sample whose info holds ExpRL-Process's prefix scores;
    the number of samples that got them."""
    done = 0
    for s in samples:
        scores, ends = s.info.get("segment_scores"), s.info.get("segment_ends")
        if not scores or not ends or len(scores) != len(ends) or s.reward_error is not None:
            continue
        s.reward_heads.update(segment_heads(scores, token_segment_ends(tokenizer, s.response_ids, ends), prefix))
        done += 1
    return done
