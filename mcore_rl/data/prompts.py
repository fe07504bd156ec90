"""Prompt streams for RL: the training stream, the held-out evaluation set, the MIPU validation
stream, each deterministic and resumable.

The prompts come from a jsonl file (`data.path`, `eval.path`) or from a task
(`mcore_rl.data.tasks`) drawn with a different seed per purpose. Held out means held out: training,
the SFT warm start and validation never see an evaluation prompt (with 2-digit addition there are
only 10^4 problems; random draws would overlap).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np

from mcore_rl.config.rl_schema import RLConfig
from mcore_rl.config.sections import validation_prompts_needed
from mcore_rl.data.files import BadLines, DataError, json_objects, read_lines
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tasks import get_task

# One prompt of a pool: (text, label), or (text, label, max_new_tokens) when the line sets a budget.
PoolEntry = tuple[str, Any] | tuple[str, Any, int]

logger = logging.getLogger(__name__)

# (domain config, n, seed) -> n (prompt text, label) pairs of a domain `data` cannot draw itself
ExampleSource = Callable[[Any, int, int], list[tuple]]

HELD_OUT_SEED_OFFSET = 1_000_003  # evaluation problems are drawn with seed + this (SFT and RL)
VALIDATION_SEED_OFFSET = 2_000_003  # MIPU validation prompts: i.i.d., neither training nor eval


class PromptSource:
    """A deterministic, resumable stream of prompts over a fixed pool.

    Each epoch is a fresh permutation of the pool, seeded by (seed, epoch); `state_dict()` holds
    the epoch and position so a resumed run draws exactly the prompts an uninterrupted one would.
    """

    def __init__(
        self,
        pool: Sequence[PoolEntry],
        tokenizer: Any,
        seed: int,
        add_bos: bool = True,
        domain: str = "",
        render: Callable[[str], str] | None = None,
    ) -> None:
        if not pool:
            raise ValueError("the prompt pool is empty")
        self.pool, self.tokenizer, self.seed, self.add_bos = pool, tokenizer, seed, add_bos
        self.domain, self.render = domain, render  # render: the text the model sees (template, chat template)
        self.epoch, self.position, self.drawn = 0, 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.pool))
            self._perm_epoch = self.epoch
        return self._perm

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(self.render(text) if self.render is not None else text)
        bos = self.tokenizer.bos_id
        if not self.add_bos or bos is None or (ids and ids[0] == bos):  # a chat template may start with it
            return ids
        return [bos] + ids

    # one domain: no stages, nothing to learn from the scores (the interface of `MixtureSource`)
    temperature: float | None = None

    def set_step(self, step: int) -> None:
        pass

    def observe(self, groups: Any) -> None:
        pass

    def take(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        for _ in range(n):
            if self.position >= len(self.pool):
                self.epoch, self.position = self.epoch + 1, 0
            entry = self.pool[int(self._permutation()[self.position])]
            text, label, budget = entry[0], entry[1], entry[2] if len(entry) == 3 else None
            out.append(Prompt(self.drawn, text, self.encode(text), label, self.domain, budget))
            self.position += 1
            self.drawn += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "drawn": self.drawn,
            "seed": self.seed,
            "pool": len(self.pool),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed or int(state["pool"]) != len(self.pool):
            raise ValueError(
                f"data state is for seed {state['seed']} with {state['pool']} prompts, but this run has "
                f"seed {self.seed} with {len(self.pool)}; the data or seed changed since the checkpoint"
            )
        self.epoch, self.position, self.drawn = int(state["epoch"]), int(state["position"]), int(state["drawn"])


def read_prompt_file(
    path: str, prompt_key: str, label_key: str, on_bad_line: str = "error", key: str = "data.path"
) -> list[PoolEntry]:
    """(prompt, label) pairs of a jsonl file (plus the line's `max_new_tokens`, a per-prompt response
    budget, when it has one). A bad line (not UTF-8, not JSON, no string prompt) is
    reported as `path:line: problem` and raises, or is skipped with `on_bad_line="skip"`
    (`mcore_rl.data.files`); `key` names the setting when the file is missing."""
    bad = BadLines(path, on_bad_line)
    pool: list[PoolEntry] = []
    for lineno, obj in json_objects(read_lines(path, bad, key), bad):
        if not isinstance(obj.get(prompt_key), str):
            bad.report(lineno, f"expected an object with a string {prompt_key!r}")
            continue
        budget = obj.get("max_new_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            bad.report(lineno, f"'max_new_tokens' must be a positive integer, got {budget!r}")
            continue
        pool.append(
            (obj[prompt_key], obj.get(label_key), budget)
            if budget is not None
            else (obj[prompt_key], obj.get(label_key))
        )
    if bad.count:
        logger.warning("%s: skipped %d bad line(s)", path, bad.count)
    if not pool:
        raise DataError(f"{path}: no prompts" + (f" ({bad.count} bad line(s) skipped)" if bad.count else ""))
    return pool


def task_pool(task: str, n: int, seed: int, max_digits: int) -> list[tuple[str, Any]]:
    """(prompt, answer) pairs of a registered task (the answer is the SFT response and the label)."""

    try:
        return get_task(task, max_digits=max_digits).examples(n, seed)
    except KeyError as err:
        raise DataError(f"data.synthetic_task: {err.args[0]}") from None


def distinct_draw(draw: Callable[[int], Sequence[Any]], n: int, what: str) -> list[Any]:
    """`n` examples with distinct prompt texts (`x[0]`), the first of each text in the order `draw(m)`
    makes them: a held-out set that repeats a question counts it twice and makes its confidence
    interval too narrow. Draws n, then 4n and 16n where the generator repeats itself; a generator with
    fewer than `n` distinct questions gives what it has, and says so."""
    out: list[Any] = []
    for m in (n, 4 * n, 16 * n):
        first: dict[str, Any] = {}
        for x in draw(m):
            first.setdefault(x[0], x)
        out = list(first.values())
        if len(out) >= n:
            return out[:n]
    logger.warning("%s: only %d distinct questions for a held-out set of %d", what, len(out), n)
    return out


@dataclass
class PromptSets:
    """The three prompt sets of an RL run."""

    train: PromptSource  # or a `MixtureSource` over the domains (same interface)
    validation: PromptSource  # MIPU Step 2
    eval_prompts: list[Prompt]  # the fixed held-out set

    @property
    def held_out_texts(self) -> set[str]:
        return {p.text for p in self.eval_prompts}


def read_prompt_files(cfg: RLConfig) -> dict[str, list[PoolEntry]]:
    """The prompt files an `RLConfig` names (`data.path`, `eval.path`), read and checked; the CLI
    calls this before any worker starts so a bad file fails in a second."""
    d = cfg.data
    if d.domains:
        from mcore_rl.data.domains import read_domain_files  # lazy: import cycle

        return read_domain_files(cfg)
    paths = {"data.path": d.path, "eval.path": cfg.eval.path}
    return {
        key: read_prompt_file(path, d.prompt_key, d.label_key, d.on_bad_line, key)
        for key, path in paths.items()
        if path is not None
    }


def build_prompt_sets(cfg: RLConfig, tokenizer: Any, environment_examples: ExampleSource | None = None) -> PromptSets:
    """The training stream, validation stream and held-out set an `RLConfig` describes
    (`environment_examples`: the prompts of environment domains, which `data` cannot import)."""
    if cfg.data.domains:
        from mcore_rl.data.domains import build_domain_sets  # lazy: import cycle

        return build_domain_sets(cfg, tokenizer, environment_examples)
    d, e, seed = cfg.data, cfg.eval, cfg.train.seed
    domain = d.synthetic_task if d.path is None else d.path
    files = read_prompt_files(cfg)
    pool: list[PoolEntry]
    held_out: list[PoolEntry]
    validation: list[PoolEntry]
    if d.path is not None:
        pool = files["data.path"]
        held_out = files.get("eval.path", pool)
        validation = pool
    else:
        pool = list(task_pool(d.synthetic_task, d.synthetic_num_prompts, seed, d.synthetic_max_digits))
        held_out = (
            files["eval.path"]
            if e.path
            # the demo's draw as it was (its 200 hold 197 distinct): drawing them distinct changes the SFT
            # warm start's pool, and seed 1234 then stays on the carry plateau (see docs/demo.md)
            else list(task_pool(d.synthetic_task, e.num_prompts, seed + HELD_OUT_SEED_OFFSET, d.synthetic_max_digits))
        )
        validation = list(
            task_pool(
                d.synthetic_task,
                max(1000, validation_prompts_needed(cfg)),
                seed + VALIDATION_SEED_OFFSET,
                d.synthetic_max_digits,
            )
        )
    eval_prompts = PromptSource(held_out, tokenizer, seed + HELD_OUT_SEED_OFFSET, d.add_bos, domain).take(
        min(e.num_prompts, len(held_out))
    )
    held_out_texts = {p.text for p in eval_prompts}
    if d.path is None or e.path:
        pool = [x for x in pool if x[0] not in held_out_texts] or pool
        validation = [x for x in validation if x[0] not in held_out_texts] or validation
    train: Any = PromptSource(pool, tokenizer, seed, d.add_bos, domain)
    if cfg.rollout.temperature_stages:  # POLARIS: staged temperature (and stage filter) on one source
        from mcore_rl.data.domains import MixtureSchedule, MixtureSource, single_source_stages  # lazy: import cycle

        train = MixtureSource(
            {domain: train},
            MixtureSchedule({domain: 1.0}, single_source_stages(cfg)),
            seed,
            cfg.rollout.prompts_per_step,
        )
    return PromptSets(
        train=train,
        validation=PromptSource(validation, tokenizer, seed + VALIDATION_SEED_OFFSET, d.add_bos, domain),
        eval_prompts=eval_prompts,
    )
