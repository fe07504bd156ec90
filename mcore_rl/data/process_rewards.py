"""Process-reward-model data: solutions cut into steps, each step labelled with Monte-Carlo
continuation counts (K of N continuations from the step's prefix reached a correct answer), as
BetaPRM trains on them ("Process Rewards with Learned Reliability"; `algos/beta_prm.py`).

File format (`data.path` with `reward_model.objective: beta_prm`, one JSON object per line; key
names `data.prompt_key`, `steps_key`, `successes_key`, `rollouts_key`):

    {"prompt": "12+30+5=", "steps": ["12+30=42", "42+5=47"], "successes": [7, 8], "rollouts": 8}

`rollouts` is one N for every step or a list, one per step. A line with no steps, an empty step, a
step containing the delimiter, counts that are not integers with 0 <= K <= N, N >= 1, or lists of
different lengths is a bad line (`data.on_bad_line`: `file:line` before any worker starts, or
skipped and counted).

Rows: `[bos] prompt step₁ D step₂ D … step_H D` with D = `data.step_delimiter`'s ids, padded to
`seq_length`; step t is read at the last token of its D (`step_index` [rows, T], −1 where a row
has fewer steps or its step was cut by `seq_length`). The same positions are found in a policy's
response by `rewards/process_reward.py: step_ends`, so the PRM is read where it was trained.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.config.rm_schema import PreferenceDataConfig
from mcore_rl.data.files import BadLines, DataError, json_objects, read_lines
from mcore_rl.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ProcessExample:
    prompt: str
    steps: list[str]
    successes: list[int]  # K per step
    rollouts: list[int]  # N per step
    source: str = ""


def read_process_file(cfg: PreferenceDataConfig) -> list[ProcessExample]:
    """The step-labelled solutions of `cfg.path`; never empty."""
    path = str(cfg.path)
    bad = BadLines(path, cfg.on_bad_line)
    out: list[ProcessExample] = []
    for lineno, obj in json_objects(read_lines(cfg.path, bad), bad):
        problem, example = _example(obj, cfg)
        if problem or example is None:
            bad.report(lineno, problem or "unreadable")
            continue
        example.source = f"{path}:{lineno}"
        out.append(example)
    if bad.count:
        logger.warning("%s: skipped %d bad line(s)", path, bad.count)
    if not out:
        raise DataError(f"{path}: no usable step-labelled solutions")
    return out


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _example(obj: dict[str, Any], cfg: PreferenceDataConfig) -> tuple[str | None, ProcessExample | None]:
    pk, sk, kk, nk = cfg.prompt_key, cfg.steps_key, cfg.successes_key, cfg.rollouts_key
    missing = [k for k in (pk, sk, kk, nk) if k not in obj]
    if missing:
        return f"missing key(s) {missing}; got {sorted(obj)}", None
    prompt, steps, successes, rollouts = obj[pk], obj[sk], obj[kk], obj[nk]
    if not isinstance(prompt, str):
        return f"{pk!r} must be a string, got {type(prompt).__name__}", None
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
        return f"{sk!r} must be a non-empty list of strings, got {steps!r:.80}", None
    if any(not s.strip() for s in steps):
        return f"{sk!r}: step {[i for i, s in enumerate(steps) if not s.strip()][0]} is empty", None
    with_delimiter = [i for i, s in enumerate(steps) if cfg.step_delimiter in s]
    if with_delimiter:
        return f"{sk!r}: step {with_delimiter[0]} contains the step delimiter {cfg.step_delimiter!r}", None
    if _count(rollouts):
        rollouts = [rollouts] * len(steps)
    if not isinstance(successes, list) or not isinstance(rollouts, list):
        return f"{kk!r} must be a list and {nk!r} an integer or a list", None
    if len(successes) != len(steps) or len(rollouts) != len(steps):
        return f"{len(steps)} steps but {len(successes)} {kk!r} and {len(rollouts)} {nk!r}", None
    for t, (k, n) in enumerate(zip(successes, rollouts)):
        if not (_count(k) and _count(n) and n >= 1 and 0 <= k <= n):
            return f"step {t}: need integers 0 <= {kk} <= {nk} with {nk} >= 1, got {k!r} of {n!r}", None
    return None, ProcessExample(prompt, list(steps), list(successes), list(rollouts))


def process_ids(prompt: str, steps: list[str], delimiter: str, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(`[bos] prompt step₁ D … step_H D` ids, the index of each step's last delimiter token)."""
    ids = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    ids += tokenizer.encode(prompt) if prompt else []
    delimiter_ids = tokenizer.encode(delimiter)
    ends = []
    for step in steps:
        ids += tokenizer.encode(step) + delimiter_ids
        ends.append(len(ids) - 1)
    return ids, ends


def process_rows(
    examples: list[ProcessExample], seq_length: int, delimiter: str, tokenizer: Tokenizer
) -> dict[str, torch.Tensor]:
    """One row per solution: `tokens` [rows, seq_length], and per step `step_index`, `successes`,
    `rollouts` [rows, T] (T: the most steps of a row; −1 / 0 past a row's steps or its cut)."""
    width = max(len(e.steps) for e in examples)
    tokens = torch.full((len(examples), seq_length), tokenizer.pad_id, dtype=torch.long)
    index = torch.full((len(examples), width), -1, dtype=torch.long)
    k = torch.zeros((len(examples), width), dtype=torch.long)
    n = torch.ones((len(examples), width), dtype=torch.long)
    cut = 0
    for r, e in enumerate(examples):
        ids, ends = process_ids(e.prompt, e.steps, delimiter, tokenizer)
        if len(ids) > seq_length:
            ids, cut = ids[:seq_length], cut + 1
        tokens[r, : len(ids)] = torch.tensor(ids)
        for t, end in enumerate(ends):
            if end < seq_length:
                index[r, t], k[r, t], n[r, t] = end, e.successes[t], e.rollouts[t]
    if cut:
        logger.warning(
            "cut %d of %d solutions to train.seq_length=%d (their later steps dropped)", cut, len(examples), seq_length
        )
    if bool((index < 0).all(dim=1).any()):
        raise DataError(f"train.seq_length={seq_length} cuts some solution before its first step ends")
    return {"tokens": tokens, "step_index": index, "successes": k, "rollouts": n}
