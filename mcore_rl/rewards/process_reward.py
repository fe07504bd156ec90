"""A process reward model (PRM) in use: per-step scores of a policy's response, read at its step
delimiters, as `mcore-rl rm-train` with `reward_model.objective: beta_prm` trained it
(`data/process_rewards.py`: step t is read at the last token of the delimiter that ends it).

The PRM is the exported sequence classifier with two labels, BetaPRM's (z₀, z₁): the classifier's
`score` layer applied at every position of the decoder's last hidden state gives per-token values,
and μ_t = σ(z₀), κ_t = softplus(z₁) at step t's end (`algos/beta_prm.py: beta_head`). The steps of a
response are the delimiter-ended spans of its ids (`steps_as_read`). One rule on both sides: every
step is read at the last token of the delimiter that ends it, so a last step the policy left without
one (eos excluded) is read with the delimiter's ids appended — the row `rm-train` trained on
(`[bos] prompt step₁ D … step_H D`), not one position earlier.

Rewards (registered in `registry.py`; a domain's heads, e.g. for PROF-GRPO's filter `prof_grpo`,
which reads `prm_head: prm` and `steps_head: prm_steps` — give both weight 0):

* `prm`: the response's steps' μ aggregated (`aggregate`: "mean", PROF's 1/H Σ r^h; "min"; "last");
  `info` carries every step's μ and σ = sqrt(μ(1 − μ)/(κ + 1)).
* `prm_steps`: the number of steps H (no model).

BetaPRM's adaptive best-of-N (`adaptive_best_of_n`) draws candidates in batches from a sampler (an
engine), scores each with the PRM (`candidate_belief`: the last step's μ and σ, the PRM's belief
that the whole solution succeeds) and stops when the best candidate's lower bound μ − zσ exceeds
every other's upper bound (`algos/beta_prm.py: adaptive_stop`), or at `max_candidates`.
`uncertain_prefix_best_of_n` is the paper's "keep sampling from uncertain prefixes": after the
first batch, each batch continues the step prefix whose σ_t is the largest
(`algos/beta_prm.py: most_uncertain_step`) instead of drawing from the prompt.

The model runs in the trainer's process, batched like `reward_model.py` (calls of one loop
iteration, one forward), or behind SGLang's `/classify` (`url`; `mcore-rl serve --is-embedding` or
SGLang): that route reads a row at its last token, so each step's prefix is sent as its own row
(`served_step_beliefs`; the decoder is causal, so the values are the same). A response the PRM
refuses (an id outside its vocabulary, an empty response) scores `refused_score` (default 0, the
worst μ), never a reward error a policy could hide a bad answer behind; a server that fails or
times out costs the samples of its batch.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mcore_rl.algos.beta_prm import adaptive_stop, beta_head, beta_std, most_uncertain_step
from mcore_rl.hf.classifier import token_scores
from mcore_rl.rewards.base import RewardInput
from mcore_rl.rewards.reward_model import Refused, RewardModelError, ScoreBatcher, remote_batcher


def steps_as_read(
    response_ids: Sequence[int], delimiter_ids: Sequence[int], eos_id: int | None = None
) -> tuple[list[int], list[int]]:
    """(the response's ids as the PRM reads them, the index of each step's last token in them).

    Every step ends at the last token of its delimiter — as `rm-train` reads `step₁ D … step_H D`
    (`data/process_rewards.py: process_ids`) — so text after the last delimiter (eos excluded) is a
    last step, read with the delimiter's ids appended."""
    ids = list(response_ids)
    if eos_id is not None and ids and ids[-1] == eos_id:
        ids = ids[:-1]
    d = list(delimiter_ids)
    if not d:
        raise ValueError("step_delimiter_ids: empty; a step needs a delimiter")
    ends, i = [], 0
    while i + len(d) <= len(ids):
        if ids[i : i + len(d)] == d:
            ends.append(i + len(d) - 1)
            i += len(d)
        else:
            i += 1
    if ids and (not ends or ends[-1] < len(ids) - 1):
        ids += d
        ends.append(len(ids) - 1)
    return ids, ends


def step_ends(response_ids: Sequence[int], delimiter_ids: Sequence[int], eos_id: int | None = None) -> list[int]:
    """The index of each step's last token in `steps_as_read`'s ids (their number is H)."""
    return steps_as_read(response_ids, delimiter_ids, eos_id)[1]


@dataclass
class TokenScorer:
    """A HF sequence classifier's `score` at every position: [len, num_labels] per row."""

    model: Any  # a transformers *ForSequenceClassification, eval mode
    pad_id: int
    device: str

    async def __call__(self, rows: list[list[int]]) -> list[torch.Tensor]:
        return await asyncio.get_running_loop().run_in_executor(None, self.forward, rows)

    def forward(self, rows: list[list[int]]) -> list[torch.Tensor]:
        return token_scores(self.model, rows, self.pad_id, self.device)


@dataclass
class PRM:
    """A loaded PRM: its per-token scorer and the batcher in front of it."""

    scorer: TokenScorer
    batcher: ScoreBatcher

    @property
    def vocab_size(self) -> int:
        return int(self.scorer.model.config.vocab_size)


_PRMS: dict[tuple[str, str, int], PRM] = {}
_LOCK = threading.Lock()


def load_prm(model_dir: str, device: str = "cpu", max_batch: int = 64) -> PRM:
    """The process's PRM of `model_dir` (loaded on first use)."""
    key = (model_dir, device, max_batch)
    with _LOCK:
        if key not in _PRMS:
            from transformers import AutoModelForSequenceClassification  # lazy: transformers is slow to import

            try:
                model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True)
            except (OSError, ValueError) as err:
                raise RewardModelError(f"process reward model {model_dir!r} does not load: {err}"[:500]) from None
            if model.config.num_labels != 2:
                raise RewardModelError(
                    f"{model_dir}: {model.config.num_labels} labels; a BetaPRM has 2 (mean, concentration)"
                )
            if model.config.pad_token_id is None or not hasattr(model, "score"):
                raise RewardModelError(f"{model_dir}: no pad_token_id or no `score` head; not a sequence classifier")
            scorer = TokenScorer(model.to(device).eval(), model.config.pad_token_id, device)
            _PRMS[key] = PRM(scorer, ScoreBatcher(scorer, max_batch))
        return _PRMS[key]


@dataclass
class StepBeliefs:
    """A response's per-step Beta beliefs."""

    mean: torch.Tensor  # μ_t [H]
    std: torch.Tensor  # σ_t [H]
    concentration: torch.Tensor = field(repr=False, default_factory=lambda: torch.zeros(0))


async def step_beliefs(
    prm: PRM,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    delimiter_ids: Sequence[int],
    eos_id: int | None = None,
) -> StepBeliefs:
    """μ_t, σ_t at each step's end of `response_ids` after `prompt_ids` (the PRM reads both; a last
    step without a delimiter gets one, `steps_as_read`)."""
    response, ends = steps_as_read([int(i) for i in response_ids], delimiter_ids, eos_id)
    if not ends:
        raise Refused("the response has no step to score (it is empty)")
    ids = [int(i) for i in prompt_ids] + response
    bad = [i for i in ids if not 0 <= i < prm.vocab_size]
    if bad:
        raise Refused(f"token id {bad[0]} is outside the process reward model's vocabulary of {prm.vocab_size}")
    values = await prm.batcher.score(ids)
    at = torch.tensor([len(prompt_ids) + e for e in ends])
    mu, kappa = beta_head(values[at])
    return StepBeliefs(mu, beta_std(mu, kappa), kappa)


def _ids(sample: RewardInput) -> tuple[list[int], list[int]]:
    meta = sample.metadata
    if "prompt_ids" not in meta or "response_ids" not in meta:
        raise RewardModelError("the sample carries no token ids (metadata 'prompt_ids', 'response_ids')")
    return list(meta["prompt_ids"]), list(meta["response_ids"])


async def served_step_beliefs(
    batcher: ScoreBatcher,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    delimiter_ids: Sequence[int],
    eos_id: int | None = None,
) -> StepBeliefs:
    """`step_beliefs` of a PRM behind SGLang's `/classify`, which reads a row at its last token: each
    step's prefix `prompt + response[: end + 1]` is its own row, all in one request. The decoder is
    causal, so a prefix's last-token value is the full row's value at that position
    (`hf/classifier.py`): the same beliefs as in the trainer's process, at H forwards' cost."""
    response, ends = steps_as_read([int(i) for i in response_ids], delimiter_ids, eos_id)
    if not ends:
        raise Refused("the response has no step to score (it is empty)")
    ids = [int(i) for i in prompt_ids] + response
    rows = [ids[: len(prompt_ids) + e + 1] for e in ends]
    values = torch.stack(list(await asyncio.gather(*(batcher.score(r) for r in rows))))
    if values.shape[-1] != 2:
        raise RewardModelError(f"the served model has {values.shape[-1]} labels; a BetaPRM has 2 (mean, concentration)")
    mu, kappa = beta_head(values)
    return StepBeliefs(mu, beta_std(mu, kappa), kappa)


async def prm_score(
    sample: RewardInput,
    model_dir: str | None = None,
    step_delimiter_ids: list[int] | None = None,
    aggregate: Literal["mean", "min", "last"] = "mean",
    eos_token_id: int | None = None,
    max_batch: int = 64,
    device: str = "cpu",
    url: str | None = None,
    timeout: float = 25.0,
    api_key: str | None = None,
    refused_score: float | None = None,
) -> dict[str, Any]:
    """The PRM's step means of one sample, aggregated; see the module docstring. A response the PRM
    refuses (an id outside its vocabulary, no step) scores `refused_score`, else 0: μ's worst."""
    if (model_dir is None) == (url is None):
        raise RewardModelError("give the process reward model's `model_dir` or the `url` it is served at (one of them)")
    if not step_delimiter_ids:
        raise RewardModelError("step_delimiter_ids: required, the ids that end a step")
    prompt, response = _ids(sample)
    try:
        if url is not None:
            batcher = remote_batcher(url, max_batch, timeout, api_key)
            beliefs = await served_step_beliefs(batcher, prompt, response, step_delimiter_ids, eos_token_id)
        else:
            assert model_dir is not None
            prm = _PRMS.get((model_dir, device, max_batch))
            if prm is None:
                prm = await asyncio.get_running_loop().run_in_executor(None, load_prm, model_dir, device, max_batch)
            beliefs = await step_beliefs(prm, prompt, response, step_delimiter_ids, eos_token_id)
    except Refused as err:
        worst = 0.0 if refused_score is None else float(refused_score)
        return {"reward": worst, "refused": str(err)[:300]}
    mu = beliefs.mean
    value = {"mean": mu.mean(), "min": mu.min(), "last": mu[-1]}[aggregate]
    return {"reward": float(value), "step_mean": mu.tolist(), "step_std": beliefs.std.tolist()}


def prm_steps(sample: RewardInput, step_delimiter_ids: list[int], eos_token_id: int | None = None) -> float:
    """The number of steps H of one sample's response (PROF-GRPO's step penalty reads it)."""
    return float(len(step_ends(_ids(sample)[1], step_delimiter_ids, eos_token_id)))


# ---------------------------------------------------------------------------------------------
# BetaPRM's adaptive compute allocation for best-of-N
# ---------------------------------------------------------------------------------------------


@dataclass
class BestOfN:
    best: int  # index into `candidates`
    candidates: list[list[int]]
    mean: torch.Tensor  # [C] the PRM's belief in each candidate (its last step's μ)
    std: torch.Tensor  # [C] its σ
    rounds: int
    stopped_early: bool  # the stopping rule fired before max_candidates
    # per candidate, the steps it shares with the prefix it was continued from (0: drawn from the prompt)
    continued: list[int] = field(default_factory=list)


def candidate_belief(beliefs: StepBeliefs) -> tuple[float, float]:
    """A candidate's (μ, σ): its last step's belief that the solution succeeds."""
    return float(beliefs.mean[-1]), float(beliefs.std[-1])


def adaptive_best_of_n(
    draw: Callable[[int], list[list[int]]],
    score: Callable[[list[list[int]]], list[tuple[float, float]]],
    batch_size: int = 4,
    max_candidates: int = 16,
    z: float = 1.0,
) -> BestOfN:
    """Draw `batch_size` candidates at a time (`draw(k)` -> k responses' ids), score them
    (`score(responses)` -> (μ, σ) each), stop when `adaptive_stop` fires over everything scored so
    far or `max_candidates` are drawn; the best is the highest μ."""
    if batch_size < 1 or max_candidates < 1:
        raise ValueError(f"batch_size and max_candidates must be >= 1, got {batch_size}, {max_candidates}")
    candidates: list[list[int]] = []
    beliefs: list[tuple[float, float]] = []
    rounds, stopped = 0, False
    while len(candidates) < max_candidates:
        new = draw(min(batch_size, max_candidates - len(candidates)))
        candidates += new
        beliefs += score(new)
        rounds += 1
        mean = torch.tensor([b[0] for b in beliefs], dtype=torch.float64)
        std = torch.tensor([b[1] for b in beliefs], dtype=torch.float64)
        if len(candidates) >= 2 and adaptive_stop(mean, std, z):
            stopped = len(candidates) < max_candidates
            break
    mean = torch.tensor([b[0] for b in beliefs], dtype=torch.float64)
    std = torch.tensor([b[1] for b in beliefs], dtype=torch.float64)
    return BestOfN(int(torch.argmax(mean)), candidates, mean, std, rounds, stopped)


class UncertainPrefixSearch:
    """One best-of-N with continuation from uncertain prefixes (see `uncertain_prefix_best_of_n`),
    driven a batch at a time — `request()`, `add(continuations)`, `scored(beliefs)` — so that a
    caller can batch many searches' draws in one engine call and their beliefs in one PRM forward."""

    def __init__(
        self,
        delimiter_ids: Sequence[int],
        eos_id: int | None = None,
        batch_size: int = 4,
        max_candidates: int = 16,
        z: float = 1.0,
    ) -> None:
        if batch_size < 1 or max_candidates < 1:
            raise ValueError(f"batch_size and max_candidates must be >= 1, got {batch_size}, {max_candidates}")
        self.delimiter_ids, self.eos_id = list(delimiter_ids), eos_id
        self.batch_size, self.max_candidates, self.z = batch_size, max_candidates, z
        self.candidates: list[list[int]] = []
        self.ends: list[list[int]] = []
        self.beliefs: list[StepBeliefs] = []
        self.continued: list[int] = []
        self.used: set[tuple[int, ...]] = set()
        self.prefix: list[int] = []
        self.shared, self.rounds, self.stopped, self.done = 0, 0, False, False
        self._pending: list[tuple[list[int], list[int]]] = []

    def request(self) -> tuple[list[int], int] | None:
        """(the prefix to continue, after the prompt; how many continuations), or None when done."""
        if self.done or len(self.candidates) >= self.max_candidates:
            return None
        return list(self.prefix), min(self.batch_size, self.max_candidates - len(self.candidates))

    def add(self, continuations: list[list[int]]) -> list[list[int]]:
        """The new candidates (prefix + each continuation) as the PRM reads them, to be scored."""
        self._pending = [steps_as_read(self.prefix + list(r), self.delimiter_ids, self.eos_id) for r in continuations]
        return [ids for ids, _ in self._pending]

    def scored(self, beliefs: list[StepBeliefs]) -> None:
        """Take the new candidates' beliefs; stop or choose the next prefix."""
        for (ids, at), b in zip(self._pending, beliefs, strict=True):
            if b.mean.numel() != len(at):
                raise ValueError(f"score gave {b.mean.numel()} step beliefs for a response of {len(at)} steps")
            self.candidates.append(ids)
            self.ends.append(at)
            self.beliefs.append(b)
            self.continued.append(self.shared)
        self._pending = []
        self.rounds += 1
        mean, std = self._last_step()
        if len(self.candidates) >= 2 and adaptive_stop(mean, std, self.z):
            self.stopped, self.done = len(self.candidates) < self.max_candidates, True
            return
        available = [
            torch.tensor([t < len(at) - 1 and tuple(c[: at[t] + 1]) not in self.used for t in range(len(at))])
            for c, at in zip(self.candidates, self.ends)
        ]
        pick = most_uncertain_step([b.std for b in self.beliefs], available)
        if pick is None:
            self.prefix, self.shared = [], 0
        else:
            c, t = pick
            self.prefix, self.shared = self.candidates[c][: self.ends[c][t] + 1], t + 1
            self.used.add(tuple(self.prefix))

    def _last_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = [float(b.mean[-1]) if b.mean.numel() else 0.0 for b in self.beliefs]  # no step: the worst
        std = [float(b.std[-1]) if b.std.numel() else 0.0 for b in self.beliefs]
        return torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)

    def result(self) -> BestOfN:
        mean, std = self._last_step()
        best = int(torch.argmax(mean))
        return BestOfN(best, self.candidates, mean, std, self.rounds, self.stopped, self.continued)


def uncertain_prefix_best_of_n(
    draw: Callable[[list[int], int], list[list[int]]],
    score: Callable[[list[list[int]]], list[StepBeliefs]],
    delimiter_ids: Sequence[int],
    eos_id: int | None = None,
    batch_size: int = 4,
    max_candidates: int = 16,
    z: float = 1.0,
) -> BestOfN:
    """BetaPRM's adaptive compute with continuation: the first batch is drawn from the prompt
    (`draw([], k)`); while `adaptive_stop` does not separate the candidates, the next batch continues
    from the step prefix the PRM is least sure of (`most_uncertain_step`: the largest σ_t over every
    candidate's steps before its last, each prefix used once) — `draw(prefix, k)` -> k continuations
    of `prompt + prefix` — instead of from the prompt; from the prompt again when no such prefix is
    left (one-step candidates). `score(responses)` -> each response's `StepBeliefs`, the responses
    as the PRM reads them (`steps_as_read`). The best is the highest last-step μ. One search at a
    time; `UncertainPrefixSearch` drives many in lockstep."""
    search = UncertainPrefixSearch(delimiter_ids, eos_id, batch_size, max_candidates, z)
    while (req := search.request()) is not None:
        search.scored(score(search.add(draw(*req))))
    return search.result()
