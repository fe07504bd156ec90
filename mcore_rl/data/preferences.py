"""Reward-model data: preference pairs and labelled responses, read from jsonl or made from a task.

File format (`data.path`, one JSON object per line; the key names are `data.*_key`):

* pairs (`reward_model.objective: bradley_terry`): `{"prompt", "chosen", "rejected"}` strings, and
  optionally `"margin"` (a number >= 0, how strongly chosen is preferred), `"tie"` (true: neither is)
  and `"head"` (which value head the pair trains, default 0);
* labelled responses (`binary`): `{"prompt", "response", "label"}` with the label in [0, 1] (1 = good),
  and optionally `"head"`;
* a teacher's score distribution (`score_distribution`, Z-Reward's student): `{"prompt", "response",
  "label"}` with the label a list of `reward_model.num_heads` probabilities (one per score bin)
  summing to 1.

A pair whose responses are identical, an empty response, a missing or mistyped field, a margin or
label out of range or a head the model does not have is a bad line: `data.on_bad_line=error` stops
at it naming `file:line`, `skip` leaves it out (`mcore_rl.data.files`, as for SFT data). The
command checks the file before any worker starts.

Made from a task (`data.path` unset; `tools/make_preference_pairs.py` writes the same pairs to a
file): the chosen response is the task's verified answer and the rejected one a wrong answer the
task's verifier scores 0. `artifact` plants a spurious feature a reward model can learn instead
of correctness: "length" appends a confident sentence, "format" wraps the answer in an
"Answer: ..." line. It marks the correct answer in the training pairs and the wrong one in the
held-out pairs (`reverse_artifact=True`), so held-out accuracy drops where the model learned the
artefact.

Rows: one sequence per row, `[bos] prompt response [eos]` padded to `seq_length`, scored at its
last token (`*_index`); a longer sequence is cut at `seq_length` (logged) and scored there.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.config.rm_schema import PreferenceDataConfig
from mcore_rl.data.files import BadLines, DataError, json_objects, read_lines
from mcore_rl.data.tasks import get_task
from mcore_rl.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ARTIFACTS = ("none", "length", "format")
_LENGTH_SUFFIX = " - I checked it twice."


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    margin: float = 0.0
    tie: bool = False
    head: int = 0
    source: str = ""  # "path:line" or "task:i", for messages


@dataclass
class LabelledResponse:
    prompt: str
    response: str
    label: float
    head: int = 0
    source: str = ""
    distribution: list[float] | None = None  # score_distribution: the teacher's q over the score bins


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def read_preference_file(
    cfg: PreferenceDataConfig, objective: str, num_heads: int
) -> list[PreferencePair] | list[LabelledResponse]:
    """The pairs (`bradley_terry`) or labelled responses (`binary`) of `cfg.path`; never empty."""
    path = str(cfg.path)
    bad = BadLines(path, cfg.on_bad_line)
    lines = read_lines(cfg.path, bad)
    out: list[Any] = []
    for lineno, obj in json_objects(lines, bad):
        if objective == "bradley_terry":
            problem, example = _pair(obj, cfg, num_heads)
        else:
            problem, example = _labelled(obj, cfg, num_heads, distribution=objective == "score_distribution")
        if problem:
            bad.report(lineno, problem)
            continue
        example.source = f"{path}:{lineno}"
        out.append(example)
    if bad.count:
        logger.warning("%s: skipped %d bad line(s)", path, bad.count)
    if not out:
        raise DataError(f"{path}: no usable {'pairs' if objective == 'bradley_terry' else 'labelled responses'}")
    return out


def _strings(obj: dict[str, Any], keys: Sequence[str]) -> str | None:
    missing = [k for k in keys if k not in obj]
    if missing:
        return f"missing key(s) {missing}; got {sorted(obj)}"
    wrong = [f"{k!r} is {type(obj[k]).__name__}" for k in keys if not isinstance(obj[k], str)]
    if wrong:
        return "expected strings: " + ", ".join(wrong)
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def _head(obj: dict[str, Any], key: str, num_heads: int) -> tuple[str | None, int]:
    head = obj.get(key, 0)
    if not isinstance(head, int) or isinstance(head, bool) or not 0 <= head < num_heads:
        return f"{key!r} must be an integer in [0, {num_heads}) (reward_model.num_heads), got {head!r}", 0
    return None, head


def _pair(obj: dict[str, Any], cfg: PreferenceDataConfig, num_heads: int) -> tuple[str | None, Any]:
    pk, ck, rk = cfg.prompt_key, cfg.chosen_key, cfg.rejected_key
    problem = _strings(obj, (pk, ck, rk))
    if problem:
        return problem, None
    empty = [k for k in (ck, rk) if not obj[k].strip()]
    if empty:
        return f"empty response(s) {empty}", None
    if obj[ck] == obj[rk]:
        return f"{ck!r} and {rk!r} are the same response", None
    margin = obj.get(cfg.margin_key, 0.0)
    if not _number(margin) or margin < 0:
        return f"{cfg.margin_key!r} must be a number >= 0, got {margin!r}", None
    tie = obj.get(cfg.tie_key, False)
    if not isinstance(tie, bool):
        return f"{cfg.tie_key!r} must be true or false, got {tie!r}", None
    problem, head = _head(obj, cfg.head_key, num_heads)
    if problem:
        return problem, None
    return None, PreferencePair(obj[pk], obj[ck], obj[rk], float(margin), tie, head)


def _labelled(
    obj: dict[str, Any], cfg: PreferenceDataConfig, num_heads: int, distribution: bool = False
) -> tuple[str | None, Any]:
    pk, rk, lk = cfg.prompt_key, cfg.response_key, cfg.label_key
    problem = _strings(obj, (pk, rk))
    if problem:
        return problem, None
    if not obj[rk].strip():
        return f"empty response {rk!r}", None
    label: Any = obj.get(lk)
    if distribution:
        if (
            not isinstance(label, list)
            or len(label) != num_heads
            or not all(_number(p) and p >= 0 for p in label)
            or abs(sum(label) - 1.0) > 1e-4
        ):
            return (
                f"{lk!r} must be a list of {num_heads} probabilities (reward_model.num_heads score bins) "
                f"summing to 1, got {label!r:.80}"
            ), None
        return None, LabelledResponse(obj[pk], obj[rk], 0.0, 0, distribution=[float(p) for p in label])
    if isinstance(label, bool):
        label = float(label)
    if not _number(label) or not 0.0 <= label <= 1.0:
        return f"{lk!r} must be a number in [0, 1], got {label!r}", None
    problem, head = _head(obj, cfg.head_key, num_heads)
    if problem:
        return problem, None
    return None, LabelledResponse(obj[pk], obj[rk], float(label), head)


# ---------------------------------------------------------------------------------------------
# pairs made from a task
# ---------------------------------------------------------------------------------------------


def with_artifact(response: str, artifact: str) -> str:
    """`response` with the surface feature `artifact` planted (see the module docstring)."""
    if artifact == "length":
        return response + _LENGTH_SUFFIX
    if artifact == "format":
        return f"Answer: {response}\n"
    if artifact != "none":
        raise ValueError(f"unknown artifact {artifact!r}; known: {', '.join(ARTIFACTS)}")
    return response


def _wrong_answer(task_name: str, score: Any, prompt: str, answer: str, rng: random.Random) -> str:
    """A variant of `answer` the task's verifier scores 0: one character changed (digits to digits)."""
    for _ in range(100):
        chars = list(answer)
        i = rng.randrange(len(chars))
        pool = "0123456789" if chars[i].isdigit() else "abcdefghijklmnopqrstuvwxyz0123456789"
        chars[i] = rng.choice([c for c in pool if c != chars[i]])
        wrong = "".join(chars)
        if score(prompt, wrong) == 0.0:
            return wrong
    raise DataError(f"data.synthetic_task: could not make a wrong answer for task {task_name!r} prompt {prompt!r}")


def task_pairs(
    task: str, n: int, seed: int, max_digits: int, artifact: str = "none", reverse_artifact: bool = False
) -> list[PreferencePair]:
    """`n` pairs (verified answer ≻ wrong answer) of a registered task, deterministic in `seed`;
    `artifact` on the correct answer, or on the wrong one with `reverse_artifact`."""
    t = get_task(task, max_digits=max_digits)
    rng = random.Random(seed)
    pairs = []
    for i, (prompt, answer) in enumerate(t.examples(n, seed)):
        answer = str(answer)
        if t.score(prompt, answer) != 1.0:
            raise DataError(f"data.synthetic_task: task {task!r} does not verify its own answer to {prompt!r}")
        wrong = _wrong_answer(task, t.score, prompt, answer, rng)
        if reverse_artifact:
            wrong = with_artifact(wrong, artifact)
        else:
            answer = with_artifact(answer, artifact)
        pairs.append(PreferencePair(prompt, answer, wrong, source=f"{task}:{i}"))
    return pairs


def rrm_augment(pairs: Sequence[PreferencePair], seed: int) -> list[PreferencePair]:
    """RRM's causal augmentation ("RRM: Robust Reward Model Training Mitigates Reward Hacking",
    arXiv:2409.13156): each pair i, with pairs σ₁(i) and σ₂(i) of two random permutations, adds
    non-contextual pairs — its own response wins over another prompt's, whatever their quality:
    (yw_i ≻ yw_σ₁), (yw_i ≻ yl_σ₁), (yl_i ≻ yw_σ₁) — and neutral ones, ties between two other
    prompts' responses: (yw_σ₁ ~ yl_σ₁), (yw_σ₁ ~ yw_σ₂). A context-free artefact then predicts
    none of the new labels. Returns the originals followed by the new pairs (shuffled), before the
    paper's filter (`algos/reward_model.py: rrm_keep`, which needs a base model's scores)."""
    rng = random.Random(seed)
    n = len(pairs)
    s1, s2 = list(range(n)), list(range(n))
    rng.shuffle(s1)
    rng.shuffle(s2)
    new: list[PreferencePair] = []
    for i, p in enumerate(pairs):
        a, b = pairs[s1[i]], pairs[s2[i]]
        if a.prompt == p.prompt or b.prompt == p.prompt:
            continue  # the same prompt: not a counterfactual
        src = f"rrm({p.source})"
        candidates = [
            PreferencePair(p.prompt, p.chosen, a.chosen, head=p.head, source=src),
            PreferencePair(p.prompt, p.chosen, a.rejected, head=p.head, source=src),
            PreferencePair(p.prompt, p.rejected, a.chosen, head=p.head, source=src),
            PreferencePair(p.prompt, a.chosen, a.rejected, tie=True, head=p.head, source=src),
            PreferencePair(p.prompt, a.chosen, b.chosen, tie=True, head=p.head, source=src),
        ]
        own = (p.chosen, p.rejected)  # another prompt's response that is also this one's is no counterfactual
        new += [
            c
            for c in candidates
            if c.chosen != c.rejected and c.rejected not in own and (not c.tie or c.chosen not in own)
        ]
    rng.shuffle(new)
    return list(pairs) + new


def pair_to_json(pair: PreferencePair) -> dict[str, Any]:
    """The jsonl object of a pair (optional fields only where they differ from their defaults)."""
    obj: dict[str, Any] = {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}
    if pair.margin:
        obj["margin"] = pair.margin
    if pair.tie:
        obj["tie"] = True
    if pair.head:
        obj["head"] = pair.head
    return obj


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


def sequence_ids(prompt: str, response: str, tokenizer: Tokenizer) -> list[int]:
    """`[bos] prompt response [eos]`: what the reward model reads (the RL reward builds the same)."""
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    return bos + (tokenizer.encode(prompt) if prompt else []) + tokenizer.encode(response) + [tokenizer.eos_id]


def _pad(seqs: list[list[int]], seq_length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    tokens = torch.full((len(seqs), seq_length), pad_id, dtype=torch.long)
    index = torch.empty(len(seqs), dtype=torch.long)
    cut = 0
    for r, ids in enumerate(seqs):
        if len(ids) > seq_length:
            ids, cut = ids[:seq_length], cut + 1
        tokens[r, : len(ids)] = torch.tensor(ids)
        index[r] = len(ids) - 1
    return tokens, index, cut


def pair_rows(pairs: Sequence[PreferencePair], seq_length: int, tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    """One row per pair: the chosen and rejected sequences, their last-token index, margin, tie, head."""
    chosen, c_index, c_cut = _pad(
        [sequence_ids(p.prompt, p.chosen, tokenizer) for p in pairs], seq_length, tokenizer.pad_id
    )
    rejected, r_index, r_cut = _pad(
        [sequence_ids(p.prompt, p.rejected, tokenizer) for p in pairs], seq_length, tokenizer.pad_id
    )
    if c_cut or r_cut:
        logger.warning("cut %d of %d sequences to train.seq_length=%d", c_cut + r_cut, 2 * len(pairs), seq_length)
    return {
        "chosen_tokens": chosen,
        "chosen_index": c_index,
        "rejected_tokens": rejected,
        "rejected_index": r_index,
        "margin": torch.tensor([p.margin for p in pairs], dtype=torch.float32),
        "tie": torch.tensor([p.tie for p in pairs], dtype=torch.bool),
        "head": torch.tensor([p.head for p in pairs], dtype=torch.long),
    }


def labelled_rows(
    examples: Sequence[LabelledResponse], seq_length: int, tokenizer: Tokenizer
) -> dict[str, torch.Tensor]:
    """One row per response: its sequence, last-token index, label and head."""
    tokens, index, cut = _pad(
        [sequence_ids(e.prompt, e.response, tokenizer) for e in examples], seq_length, tokenizer.pad_id
    )
    if cut:
        logger.warning("cut %d of %d sequences to train.seq_length=%d", cut, len(examples), seq_length)
    return {
        "tokens": tokens,
        "index": index,
        "head": torch.tensor([e.head for e in examples], dtype=torch.long),
        **(
            {"target": torch.tensor([e.distribution for e in examples], dtype=torch.float32)}
            if examples[0].distribution is not None
            else {"label": torch.tensor([e.label for e in examples], dtype=torch.float32)}
        ),
    }
