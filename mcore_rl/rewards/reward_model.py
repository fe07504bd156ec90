"""A trained reward model as a reward head: scores a domain's samples in the trainer's process.

`reward_model_score` (registered as "reward_model" in `registry.py`) is an `async` reward function, so the runner
calls it on the trainer's event loop with its timeout (`base.py`). The model is a Hugging Face
sequence classifier (`mcore-rl rm-train`, exported by `mcore-rl convert mcore-to-hf`, or any stock
`*ForSequenceClassification`), loaded once per process and directory. Calls that arrive together —
the G samples of a group, the groups of a round — are scored as one padded batch
(`ScoreBatcher`): the first call of a loop iteration schedules the batch, every call made before
it runs joins it, up to `max_batch`. The forward runs in a thread, so the event loop (engines,
other rewards) goes on meanwhile.

The model reads the policy's own tokens, `[prompt ids] [response ids] [eos]`, as it was trained
(`data/preferences.py: sequence_ids`; the rollout puts the ids in `RewardInput.metadata`), so it
must share the policy's tokenizer: a sample whose ids fall outside the model's vocabulary is refused
with an error naming both sizes, as is a model whose end-of-text id differs from the policy's
(`eos_token_id`, an option the domain can set). A refused or failed sample costs that sample only
(`reward_error`); a failed forward costs the samples of its batch.

Options (a domain's `rewards: [{name: reward_model, options: {...}}]`): `model_dir` (required),
`head` (which of the model's `num_labels` scores, default 0), `max_batch` (64), `device` ("cpu",
or "cuda"), `eos_token_id` (the policy's, checked against the model's config when given).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.rewards.base import RewardInput


class RewardModelError(ValueError):
    """A sample the reward model cannot score, or a model it cannot load; the message says which."""


@dataclass
class _Pending:
    ids: list[int]
    future: asyncio.Future


@dataclass
class ScoreBatcher:
    """One model directory's queue: calls of one loop iteration become one forward."""

    model: Any  # a transformers *ForSequenceClassification, eval mode
    pad_id: int
    device: str
    max_batch: int = 64
    pending: list[_Pending] = field(default_factory=list)
    batches: int = 0  # forwards run so far (tests check that a group is one forward)
    _scheduled: bool = False

    async def score(self, ids: list[int]) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.pending.append(_Pending(ids, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush, loop)
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        todo, self.pending = self.pending, []
        todo = [p for p in todo if not p.future.done()]  # timed out before their batch ran
        for start in range(0, len(todo), self.max_batch):
            batch = todo[start : start + self.max_batch]
            self.batches += 1
            task = loop.run_in_executor(None, self._forward, [p.ids for p in batch])
            task.add_done_callback(functools.partial(_deliver, batch=batch))

    @torch.no_grad()
    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, num_labels] scores, each at its row's last token (right padding, HF's pooling)."""
        width = max(len(r) for r in rows)
        tokens = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        logits = self.model(tokens.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits.float().cpu()


def _deliver(done: asyncio.Future, *, batch: list[_Pending]) -> None:
    error = done.exception()
    for i, p in enumerate(batch):
        if p.future.done():
            continue
        if error is not None:
            p.future.set_exception(RewardModelError(f"reward-model forward failed: {error!r}"[:300]))
        else:
            p.future.set_result(done.result()[i])


_BATCHERS: dict[tuple[str, str, int], ScoreBatcher] = {}
_LOAD_LOCK = threading.Lock()


def load_batcher(model_dir: str, device: str = "cpu", max_batch: int = 64) -> ScoreBatcher:
    """The process's batcher of `model_dir` (loaded on first use)."""
    key = (model_dir, device, max_batch)
    with _LOAD_LOCK:
        if key not in _BATCHERS:
            from transformers import AutoModelForSequenceClassification  # lazy: transformers is slow to import

            try:
                model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True)
            except (OSError, ValueError) as err:
                raise RewardModelError(f"reward model {model_dir!r} does not load: {err}"[:500]) from None
            if model.config.pad_token_id is None:
                raise RewardModelError(f"{model_dir}/config.json: pad_token_id is not set; the classifier pools at it")
            _BATCHERS[key] = ScoreBatcher(model.to(device).eval(), model.config.pad_token_id, device, max_batch)
        return _BATCHERS[key]


def reward_ids(sample: RewardInput, eos_id: int | None) -> list[int]:
    """The sequence the model scores: the prompt's and the response's ids, ended by `eos_id`."""
    meta = sample.metadata
    if "prompt_ids" not in meta or "response_ids" not in meta:
        raise RewardModelError("the sample carries no token ids (metadata 'prompt_ids', 'response_ids')")
    ids = [int(i) for i in meta["prompt_ids"]] + [int(i) for i in meta["response_ids"]]
    if eos_id is not None and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)  # a response cut at its length budget: scored as if it ended there
    return ids


async def reward_model_score(
    sample: RewardInput,
    model_dir: str,
    head: int = 0,
    max_batch: int = 64,
    device: str = "cpu",
    eos_token_id: int | None = None,
) -> float:
    """The reward model's score (head `head`) of one sample; see the module docstring."""
    loop = asyncio.get_running_loop()
    batcher = _BATCHERS.get((model_dir, device, max_batch))
    if batcher is None:
        batcher = await loop.run_in_executor(None, load_batcher, model_dir, device, max_batch)
    config = batcher.model.config
    if eos_token_id is not None and config.eos_token_id is not None and config.eos_token_id != eos_token_id:
        raise RewardModelError(
            f"reward model {model_dir!r} ends sequences with token {config.eos_token_id}, the policy with "
            f"{eos_token_id}: it was trained with another tokenizer"
        )
    if not 0 <= head < config.num_labels:
        raise RewardModelError(f"head {head} is not one of the model's {config.num_labels} scores")
    ids = reward_ids(sample, eos_token_id if eos_token_id is not None else config.eos_token_id)
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise RewardModelError(
            f"token id {bad[0]} is outside the reward model's vocabulary of {config.vocab_size}: "
            "it was trained with another tokenizer than the policy's"
        )
    return float((await batcher.score(ids))[head])
