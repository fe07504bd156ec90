"""Samples with their provenance, and the prompt streams they come from.

Every sample carries what made it (DESIGN.md decision 5): the policy (weight) version the engine
reported for it, the engine's per-token log-probs μ of its response tokens, and the position of its
prompt in the data stream. The learner checks the versions against its staleness bound, the
mismatch correction uses μ, and a resumed run continues the prompt stream where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mcore_rl.data.synthetic import make_addition_examples

HELD_OUT_SEED_OFFSET = 1_000_003  # the SFT demo's held-out offset: eval problems are drawn apart
VALIDATION_SEED_OFFSET = 2_000_003  # MIPU validation prompts: i.i.d., neither training nor eval


@dataclass
class Prompt:
    """One prompt of the stream: its text and ids, the reference answer, where it came from."""

    index: int  # position in the stream (global count of prompts drawn so far)
    text: str
    ids: list[int]
    label: Any = None


@dataclass
class Sample:
    """One completion of one prompt, with everything the learner needs to know about its origin."""

    prompt: Prompt
    group: int  # samples of one prompt share a group id (the prompt's stream index)
    response_ids: list[int]
    rollout_logp: list[float]  # μ: the engine's log-prob of each response token
    policy_version: int  # the weight version the engine generated it with
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""  # decoded completion (stop token trimmed)
    engine: str = ""  # which engine (URL or "embedded:i")
    reward: float = 0.0
    reward_error: Optional[str] = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.ids

    def provenance(self) -> dict[str, Any]:
        return {"prompt_index": self.prompt.index, "policy_version": self.policy_version,
                "engine": self.engine, "finish_reason": self.finish_reason}


class PromptSource:
    """A deterministic, resumable stream of prompts over a fixed pool.

    Each epoch is a fresh permutation of the pool, seeded by (seed, epoch); `state_dict()` holds
    the epoch and position so a resumed run draws exactly the prompts an uninterrupted one would.
    """

    def __init__(self, pool: list[tuple[str, Any]], tokenizer: Any, seed: int, add_bos: bool = True) -> None:
        if not pool:
            raise ValueError("the prompt pool is empty")
        self.pool, self.tokenizer, self.seed, self.add_bos = pool, tokenizer, seed, add_bos
        self.epoch, self.position, self.drawn = 0, 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.pool))
            self._perm_epoch = self.epoch
        return self._perm

    def encode(self, text: str) -> list[int]:
        bos = [self.tokenizer.bos_id] if self.add_bos and self.tokenizer.bos_id is not None else []
        return bos + self.tokenizer.encode(text)

    def take(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        for _ in range(n):
            if self.position >= len(self.pool):
                self.epoch, self.position = self.epoch + 1, 0
            text, label = self.pool[int(self._permutation()[self.position])]
            out.append(Prompt(self.drawn, text, self.encode(text), label))
            self.position += 1
            self.drawn += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "drawn": self.drawn, "seed": self.seed,
                "pool": len(self.pool)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["seed"]) != self.seed or int(state["pool"]) != len(self.pool):
            raise ValueError(f"data state is for seed {state['seed']} with {state['pool']} prompts, but this run has "
                             f"seed {self.seed} with {len(self.pool)}; the data or seed changed since the checkpoint")
        self.epoch, self.position, self.drawn = int(state["epoch"]), int(state["position"]), int(state["drawn"])


def read_prompt_file(path: str, prompt_key: str, label_key: str) -> list[tuple[str, Any]]:
    """(prompt, label) pairs of a jsonl file; a bad line raises naming `path:line`."""
    pool = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
            if not isinstance(obj, dict) or not isinstance(obj.get(prompt_key), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string {prompt_key!r}")
            pool.append((obj[prompt_key], obj.get(label_key)))
    if not pool:
        raise ValueError(f"{path}: no prompts")
    return pool


def synthetic_pool(task: str, n: int, seed: int, max_digits: int) -> list[tuple[str, Any]]:
    """(prompt, answer) pairs of the synthetic task (the answer is the SFT response)."""
    if task != "addition":
        raise ValueError(f"data.synthetic_task: unknown task {task!r}")
    return [(ex["prompt"], ex["response"]) for ex in make_addition_examples(n, seed, max_digits)]
