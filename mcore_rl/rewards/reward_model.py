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
must share the policy's tokenizer: a model whose end-of-text id differs from the policy's
(`eos_token_id`, an option the domain can set) fails with an error saying so; a directory holding a
tokenizer that does not tokenize like the policy's is refused before workers start
(`config/rl_domains.py: check_reward_model_tokenizer`). A sample whose ids
the model cannot read (outside its vocabulary; over HTTP, a row the server refuses) is the policy's
own doing: it scores the domain's worst outcome (`worst_score`: `refused_score`, else the lowest
score bin, else the lowest score this model gave so far), with the reason in its info as `refused`,
never a reward error that would leave it out of the loss. A sample without token ids, or a failed
forward, is a reward error costing that sample, or the samples of its batch.

The model may also be served (`url`): by `mcore-rl serve --is-embedding --model-path DIR` or by
SGLang itself (`python -m sglang.launch_server --model-path DIR --is-embedding`), scored over
SGLang's reward-model route, `POST {url}/classify {"input_ids": [[ids], ...]}` ->
`[{"embedding": [score per label], ...}, ...]`, one request per batch, with an HTTP `timeout`. A
batch the server refuses (400: an id outside its vocabulary, a row too long) is scored again row by
row, so the bad row alone is refused; a server that does not answer in time, or is gone, costs the
samples of that batch (reward errors: that says nothing about the samples). Before training, the
run checks a served model's tokenizer against the policy's (`rollout/classifier.py:
check_served_reward_model`).

Options (a domain's `rewards: [{name: reward_model, options: {...}}]`): `model_dir` or `url` (one
of them), `head` (which of the model's `num_labels` scores, default 0), `max_batch` (64), `device`
("cpu" or "cuda"; `model_dir` only), `eos_token_id` (the policy's, checked against the model's
config when given; with `url`, appended to a response cut at its length budget), `timeout`
(seconds per HTTP request, 25), `api_key` (the server's `--api-key`), `score_bins` (Z-Reward's
student, `rm-train`'s `score_distribution`: the reward is the expected score Σ_s s·softmax(logits)_s
over these bins, one per label, instead of one head's logit), `refused_score` (what a refused
sample scores).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import torch

from mcore_rl.algos.z_reward import expected_score, score_distribution
from mcore_rl.hf.classifier import last_token_scores, load_classifier
from mcore_rl.rewards.base import RewardInput


class RewardModelError(ValueError):
    """A sample the reward model cannot score, or a model it cannot load; the message says which."""


class Refused(RewardModelError):
    """The model cannot read this sample's row (an id outside its vocabulary, a row the server
    refuses as bad): the sample's own doing, so it scores the worst outcome (`worst_score`)."""


class BadRows(Refused):
    """The server refused a batch as a bad request (400): some row of it is bad."""


@dataclass
class _Pending:
    ids: Any  # a row: token ids (a classifier), or a judge's prompt text (`generative_rm.py`)
    future: asyncio.Future


# rows -> their scores: [rows, labels] (a classifier at each row's last token) or one [len, labels] per row
Forward = Callable[[list[Any]], Awaitable[torch.Tensor | list[torch.Tensor]]]


@dataclass
class ScoreBatcher:
    """One model's queue: the calls of one loop iteration become one forward (`forward(rows)` ->
    [rows, num_labels] scores: a local model's, or a server's)."""

    forward: Forward
    max_batch: int = 64
    pending: list[_Pending] = field(default_factory=list)
    batches: int = 0  # forwards run so far (tests check that a group is one forward)
    lowest: torch.Tensor | None = None  # per label, the lowest score of every row scored so far
    _scheduled: bool = False

    async def score(self, ids: Any) -> torch.Tensor:
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
            task = loop.create_task(self._forward_batch([p.ids for p in batch]))
            task.add_done_callback(functools.partial(_deliver, batch=batch))

    async def _forward_batch(self, rows: list[Any]) -> list[torch.Tensor | BaseException]:
        """Each row's scores; a batch refused as bad (`BadRows`) is scored row by row, so that only
        the bad rows fail."""
        try:
            return self._seen(list(await self.forward(rows)))
        except BadRows as err:
            if len(rows) == 1:
                return [err]
        out: list[torch.Tensor | BaseException] = []
        for row in rows:
            try:
                out += self._seen(list(await self.forward([row])))
            except BadRows as err:
                out.append(err)
        return out

    def _seen(self, scores: list[torch.Tensor]) -> list[torch.Tensor | BaseException]:
        """Keep the lowest score per label (a row's scores [labels], or per token [len, labels])."""
        for s in scores:
            low = s.reshape(-1, s.shape[-1]).min(0).values
            self.lowest = low if self.lowest is None else torch.minimum(self.lowest, low)
        return list(scores)


def _deliver(done: asyncio.Future, *, batch: list[_Pending]) -> None:
    error = None if done.cancelled() else done.exception()
    for i, p in enumerate(batch):
        if p.future.done():
            continue
        if done.cancelled():
            p.future.set_exception(RewardModelError("reward-model forward cancelled"))
        elif error is not None:
            message = str(error) if isinstance(error, RewardModelError) else f"reward-model forward failed: {error!r}"
            p.future.set_exception(RewardModelError(message[:300]))
        else:
            result = done.result()[i]
            if isinstance(result, BaseException):
                p.future.set_exception(result)
            else:
                p.future.set_result(result)


@dataclass
class LocalClassifier:
    """A HF sequence classifier in this process; its forward runs in a thread."""

    model: Any  # a transformers *ForSequenceClassification, eval mode
    pad_id: int
    device: str

    async def __call__(self, rows: list[list[int]]) -> torch.Tensor:
        return await asyncio.get_running_loop().run_in_executor(None, self.forward, rows)

    def forward(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, num_labels] scores, each at its row's last token (`hf/classifier.py`)."""
        return last_token_scores(self.model, rows, self.pad_id, self.device)


@dataclass
class RemoteClassifier:
    """A reward model behind SGLang's `/classify` (`mcore-rl serve --is-embedding`, or SGLang)."""

    url: str
    timeout: float = 25.0
    api_key: str | None = None

    async def __call__(self, rows: list[list[int]]) -> torch.Tensor:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        where = f"reward model {self.url}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as http:
                async with http.post(f"{self.url}/classify", json={"input_ids": rows}, headers=headers) as resp:
                    text = await resp.text()
                    status = resp.status
        except TimeoutError:
            raise RewardModelError(f"{where}: no reply within {self.timeout:g}s") from None
        except aiohttp.ClientError as err:
            raise RewardModelError(f"{where}: {type(err).__name__}: {err}"[:300]) from None
        if status == 400:
            raise BadRows(f"{where} refused the sequence: {_error_message(text)}"[:300])
        if status != 200:
            raise RewardModelError(f"{where}: HTTP {status}: {_error_message(text)}"[:300])
        try:
            replies = json.loads(text)
            scores = [[float(x) for x in r["embedding"]] for r in replies]
        except (ValueError, TypeError, KeyError) as err:
            raise RewardModelError(f"{where}: not a /classify reply ({err!r}): {text[:120]!r}") from None
        if len(scores) != len(rows) or len({len(s) for s in scores}) != 1:
            raise RewardModelError(f"{where}: {len(scores)} scores of uneven width for {len(rows)} rows")
        return torch.tensor(scores, dtype=torch.float32)


def _error_message(text: str) -> str:
    """SGLang's error message of a reply body (`{"error": {"message": ...}}` or `{"message": ...}`)."""
    try:
        body = json.loads(text)
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return text[:200]


_BATCHERS: dict[tuple, ScoreBatcher] = {}
_LOAD_LOCK = threading.Lock()


def load_batcher(model_dir: str, device: str = "cpu", max_batch: int = 64) -> ScoreBatcher:
    """The process's batcher of `model_dir` (loaded on first use)."""
    key = (model_dir, device, max_batch)
    with _LOAD_LOCK:
        if key not in _BATCHERS:
            try:
                model = load_classifier(model_dir, device)
            except ValueError as err:
                raise RewardModelError(str(err)) from None
            local = LocalClassifier(model, model.config.pad_token_id, device)
            _BATCHERS[key] = ScoreBatcher(local, max_batch)
        return _BATCHERS[key]


def remote_batcher(url: str, max_batch: int = 64, timeout: float = 25.0, api_key: str | None = None) -> ScoreBatcher:
    """The process's batcher of the reward model served at `url`."""
    url = url.rstrip("/")
    key = ("url", url, max_batch, timeout, api_key)
    with _LOAD_LOCK:
        if key not in _BATCHERS:
            _BATCHERS[key] = ScoreBatcher(RemoteClassifier(url, timeout, api_key), max_batch)
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
    model_dir: str | None = None,
    url: str | None = None,
    head: int = 0,
    max_batch: int = 64,
    device: str = "cpu",
    eos_token_id: int | None = None,
    timeout: float = 25.0,
    api_key: str | None = None,
    score_bins: list[float] | None = None,
    refused_score: float | None = None,
) -> float | dict[str, Any]:
    """The reward model's score (head `head`, or the expected score over `score_bins`) of one
    sample; a sample it refuses scores `worst_score` (with `refused` in its info); see the module
    docstring."""
    try:
        return await _score(sample, model_dir, url, head, max_batch, device, eos_token_id, timeout, api_key, score_bins)
    except Refused as err:
        key = ("url", url.rstrip("/"), max_batch, timeout, api_key) if url else (model_dir, device, max_batch)
        batcher = _BATCHERS.get(key)
        lowest = None if batcher is None else batcher.lowest
        seen = float(lowest[head]) if lowest is not None and 0 <= head < len(lowest) else None
        return {"reward": worst_score(refused_score, score_bins, seen, str(err)), "refused": str(err)[:300]}


def worst_score(
    refused_score: float | None, score_bins: list[float] | None, lowest_seen: float | None, why: str
) -> float:
    """The domain's worst outcome for a sample the model refuses: `refused_score` if set, else the
    lowest score bin, else the lowest score the model gave so far; with none of them the sample is a
    reward error (`RewardModelError`), as before any score exists nothing says what "worst" is."""
    if refused_score is not None:
        return float(refused_score)
    if score_bins:
        return float(min(score_bins))
    if lowest_seen is not None:
        return lowest_seen
    raise RewardModelError(f"{why} (and no refused_score is set, nor any score seen yet to stand for the worst)"[:400])


async def _score(
    sample: RewardInput,
    model_dir: str | None,
    url: str | None,
    head: int,
    max_batch: int,
    device: str,
    eos_token_id: int | None,
    timeout: float,
    api_key: str | None,
    score_bins: list[float] | None,
) -> float:
    if (model_dir is None) == (url is None):
        raise RewardModelError("give the reward model's `model_dir` or the `url` it is served at (one of them)")
    if url is not None:
        scores = await remote_batcher(url, max_batch, timeout, api_key).score(reward_ids(sample, eos_token_id))
        if score_bins is not None:
            return _expected(scores, score_bins, url)
        if not 0 <= head < len(scores):
            raise RewardModelError(f"head {head} is not one of the model's {len(scores)} scores ({url})")
        return float(scores[head])
    assert model_dir is not None
    loop = asyncio.get_running_loop()
    batcher = _BATCHERS.get((model_dir, device, max_batch))
    if batcher is None:
        batcher = await loop.run_in_executor(None, load_batcher, model_dir, device, max_batch)
    assert isinstance(batcher.forward, LocalClassifier)
    config = batcher.forward.model.config
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
        raise Refused(
            f"token id {bad[0]} is outside the reward model's vocabulary of {config.vocab_size}: "
            "it was trained with another tokenizer than the policy's"
        )
    scores = await batcher.score(ids)
    return _expected(scores, score_bins, model_dir) if score_bins is not None else float(scores[head])


def _expected(scores: torch.Tensor, bins: list[float], where: str) -> float:
    """Σ_s s·softmax(scores)_s: a score-distribution model's expected score (`algos/z_reward.py`)."""
    if len(bins) != scores.shape[-1]:
        raise RewardModelError(f"score_bins has {len(bins)} bins, the reward model {where} {scores.shape[-1]} labels")
    return float(expected_score(score_distribution(scores), torch.tensor(bins, dtype=torch.float64)))
