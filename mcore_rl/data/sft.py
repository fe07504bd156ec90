"""SFT data: examples from a file (or the synthetic task) -> fixed-length rows -> per-rank batches.

Input formats (`DataConfig.format`; "auto" picks jsonl for a `.jsonl` path, text otherwise):

* jsonl: one JSON object per line with `prompt_key` and `response_key` strings, or a `text_key`
  string (all of it trained on). Blank lines are ignored.
* text: one document per paragraph; paragraphs are separated by blank lines, and the newlines inside
  a paragraph are kept. Every token is trained on.

A malformed line is reported as `path:line: problem`; `on_bad_line=skip` logs and skips it,
`error` raises `DataError` (`mcore_rl.data.files`, shared with the RL prompt files).

Each example becomes `[bos] prompt response [eos]` (no bos if the tokenizer has none) and rows hold
`seq_length + 1` tokens, megatron-style: `tokens = row[:-1]`, `labels = row[1:]`, and `loss_mask[i]`
says whether `labels[i]` is trained on. The label after a document's last token belongs to the next
document (or padding) and is always masked, so no loss crosses a document boundary; `position_ids`
restart at 0 in every document and `segment_ids` number the documents of a row 1, 2, ... (0 =
padding) so the model can attend block-diagonally. An example longer than a row is truncated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from collections.abc import Collection, Iterator

import numpy as np
import torch

from mcore_rl.config.schema import DataConfig
from mcore_rl.data.files import BadLines, DataError, json_objects, read_lines
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.data.prompts import task_pool

logger = logging.getLogger(__name__)

ROW_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "segment_ids")


@dataclass
class SFTExample:
    prompt: str  # "" for plain-text documents
    response: str
    source: str  # "path:line" (or "synthetic:i"), for messages


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def load_examples(cfg: DataConfig, seed: int) -> list[SFTExample]:
    """The examples `cfg` describes: its file if `cfg.path` is set, else the task's answers."""
    if cfg.path is None:
        return task_examples(cfg.synthetic_task, cfg.synthetic_max_digits, cfg.synthetic_num_examples, seed)
    return read_examples(cfg)


def task_examples(task: str, max_digits: int, n: int, seed: int, exclude: Collection[str] = ()) -> list[SFTExample]:
    """`n` prompt/answer pairs of a task (`mcore_rl.data.tasks`), leaving out prompts in `exclude`."""

    pairs = task_pool(task, n, seed, max_digits)
    drop = set(exclude)
    return [SFTExample(p, a, f"synthetic:{i}") for i, (p, a) in enumerate(pairs) if p not in drop]


def read_examples(cfg: DataConfig) -> list[SFTExample]:
    """Read `cfg.path` as jsonl or text (see module docstring); never returns an empty list."""
    path = str(cfg.path)
    bad = BadLines(path, cfg.on_bad_line)
    lines = read_lines(cfg.path, bad)  # raises DataError if there is no such file
    fmt = cfg.format
    if fmt == "auto":
        fmt = "jsonl" if path.endswith(".jsonl") else "text"
    examples = _parse_jsonl(lines, cfg, bad) if fmt == "jsonl" else _parse_text(lines, path)
    if bad.count:
        logger.warning("%s: skipped %d bad line(s)", path, bad.count)
    if not examples:
        raise DataError(f"{path}: no usable examples")
    return examples


def _parse_jsonl(lines: list[tuple[int, str | None]], cfg: DataConfig, bad: BadLines) -> list[SFTExample]:
    pk, rk, tk = cfg.prompt_key, cfg.response_key, cfg.text_key
    out: list[SFTExample] = []
    for lineno, obj in json_objects(lines, bad):
        if pk in obj or rk in obj:
            keys: tuple[str, ...] = (pk, rk)
        elif tk in obj:
            keys = (tk,)
        else:
            bad.report(lineno, f"missing keys: expected {pk!r} and {rk!r}, or {tk!r}; got {sorted(obj)}")
            continue
        missing = [k for k in keys if k not in obj]
        wrong = [f"{k!r} is {type(obj[k]).__name__}" for k in keys if k in obj and not isinstance(obj[k], str)]
        if missing or wrong:
            bad.report(lineno, f"missing key(s) {missing}" if missing else "expected strings: " + ", ".join(wrong))
            continue
        source = f"{bad.path}:{lineno}"
        out.append(SFTExample(obj[pk], obj[rk], source) if len(keys) == 2 else SFTExample("", obj[tk], source))
    return out


def _parse_text(lines: list[tuple[int, str | None]], path: str) -> list[SFTExample]:
    out: list[SFTExample] = []
    para: list[str] = []
    start = 0
    for lineno, line in lines + [(len(lines) + 1, "")]:
        if line is None:  # bad UTF-8 (already reported): ends the paragraph
            line = ""
        if line.strip():
            if not para:
                start = lineno
            para.append(line)
        elif para:
            out.append(SFTExample("", "\n".join(para), f"{path}:{start}"))
            para = []
    return out


# ---------------------------------------------------------------------------------------------
# tokenising and building rows
# ---------------------------------------------------------------------------------------------


def tokenize_example(ex: SFTExample, tokenizer: Tokenizer, mask_prompt: bool) -> tuple[list[int], list[int]]:
    """Token ids and a per-token "is a training target" flag for `[bos] prompt response [eos]`."""
    prompt_ids = tokenizer.encode(ex.prompt) if ex.prompt else []
    response_ids = tokenizer.encode(ex.response)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    ids = bos + prompt_ids + response_ids + [tokenizer.eos_id]
    target = [0] * len(bos) + [0 if mask_prompt else 1] * len(prompt_ids) + [1] * (len(response_ids) + 1)
    return ids, target


def build_rows(
    samples: list[tuple[list[int], list[int]]], seq_length: int, pack: bool, pad_id: int
) -> dict[str, torch.Tensor]:
    """Rows of `seq_length` positions from (ids, target) samples; see the module docstring."""
    row_len = seq_length + 1
    rows: list[tuple[list[int], list[int], list[int], list[int]]] = []  # ids, target, pos, seg
    cur: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
    truncated = 0
    for ids, target in samples:
        if len(ids) > row_len:
            truncated += 1
            ids, target = ids[:row_len], target[:row_len]
        if cur[0] and (not pack or len(cur[0]) + len(ids) > row_len):
            rows.append(cur)
            cur = ([], [], [], [])
        seg = (cur[3][-1] if cur[3] else 0) + 1
        cur[0].extend(ids)
        cur[1].extend(target)
        cur[2].extend(range(len(ids)))
        cur[3].extend([seg] * len(ids))
    if cur[0]:
        rows.append(cur)
    if truncated:
        logger.warning("truncated %d of %d examples to %d tokens", truncated, len(samples), row_len)

    n = len(rows)
    ids_t = torch.full((n, row_len), pad_id, dtype=torch.long)
    tgt_t = torch.zeros((n, row_len), dtype=torch.bool)
    pos_t = torch.zeros((n, row_len), dtype=torch.long)
    seg_t = torch.zeros((n, row_len), dtype=torch.long)
    for r, (ids, target, pos, segs) in enumerate(rows):
        k = len(ids)
        ids_t[r, :k] = torch.tensor(ids)
        tgt_t[r, :k] = torch.tensor(target, dtype=torch.bool)
        pos_t[r, :k] = torch.tensor(pos)
        seg_t[r, :k] = torch.tensor(segs)
    same_doc = (seg_t[:, 1:] == seg_t[:, :-1]) & (seg_t[:, :-1] > 0)
    return {
        "tokens": ids_t[:, :-1].contiguous(),
        "labels": ids_t[:, 1:].contiguous(),
        "loss_mask": (tgt_t[:, 1:] & same_doc).float(),
        "position_ids": pos_t[:, :-1].contiguous(),
        "segment_ids": seg_t[:, :-1].contiguous(),
    }


def build_sft_rows(cfg: DataConfig, seq_length: int, tokenizer: Tokenizer, seed: int) -> dict[str, torch.Tensor]:
    """`load_examples` -> `tokenize_example` -> `build_rows`, as configured."""
    samples = [tokenize_example(ex, tokenizer, cfg.mask_prompt) for ex in load_examples(cfg, seed)]
    return build_rows(samples, seq_length, cfg.pack_sequences, tokenizer.pad_id)


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------


class SFTBatches:
    """Endless, deterministic, resumable stream of training steps for one data-parallel rank.

    Each epoch is a fresh permutation of the rows (seeded by `(seed, epoch)`); each step takes the
    next `micro_batch_size * num_microbatches * dp_size` rows of it, and a trailing remainder too
    small for a step is dropped. Micro-batch j of rank r is rows `[r*mbs, (r+1)*mbs)` of the j-th
    `mbs * dp_size` slice, so ranks never share a row. The state (epoch, position in the epoch) is
    the same on every rank and counts rows globally, so a resumed run continues exactly where an
    uninterrupted one would be.
    """

    def __init__(
        self,
        rows: dict[str, torch.Tensor],
        micro_batch_size: int,
        num_microbatches: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_size})")
        self.rows = rows
        self.num_rows = next(iter(rows.values())).shape[0]
        self.micro_batch_size, self.num_microbatches = micro_batch_size, num_microbatches
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.rows_per_step = micro_batch_size * num_microbatches * dp_size
        if self.num_rows < self.rows_per_step:
            raise ValueError(
                f"only {self.num_rows} rows of data, fewer than one global batch of {self.rows_per_step} "
                f"(micro_batch_size {micro_batch_size} x {num_microbatches} micro-batches x dp {dp_size})"
            )
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_rows // self.rows_per_step

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        return self

    def __next__(self) -> list[dict[str, torch.Tensor]]:
        if self.position + self.rows_per_step > self.num_rows:
            self.epoch, self.position = self.epoch + 1, 0
        step = self._permutation(self.epoch)[self.position : self.position + self.rows_per_step]
        self.position += self.rows_per_step
        mbs, width = self.micro_batch_size, self.micro_batch_size * self.dp_size
        batches = []
        for j in range(self.num_microbatches):
            mine = torch.from_numpy(step[j * width + self.dp_rank * mbs : j * width + (self.dp_rank + 1) * mbs])
            batches.append({k: v[mine] for k, v in self.rows.items()})
        return batches

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed or state["num_rows"] != self.num_rows:
            raise ValueError(
                f"data state is for seed {state['seed']} with {state['num_rows']} rows, but this run has "
                f"seed {self.seed} with {self.num_rows} rows; the data or seed changed since the checkpoint"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
