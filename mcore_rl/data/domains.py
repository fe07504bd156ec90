"""Domains: several datasets in one RL run, each with its own prompts, rewards, sampling and
evaluation set, mixed into one prompt stream by fixed or staged weights.

A domain (`data.domains[i]`) reads its prompts from a jsonl/parquet file, a registered task or a
reasoning-gym generator; renders them with a format string or the tokenizer's chat template (the
reward still sees the raw prompt); scores them with weighted reward heads; samples them with its
own top-p/top-k, response budget and group size. `MixtureSource` draws the training stream: at
every draw it picks a domain by the weights of the current stage, deterministically (interleaved,
each domain within one prompt of its share at every point) or by a seeded random draw, and its
state (the domains' stream positions, the interleaving credits, POLARIS's per-prompt accuracies
and dropped prompts) goes into the checkpoint, so a resumed run draws what an uninterrupted one
would. The single-source config (`data.path` / `data.synthetic_task`) is one domain and keeps its
`PromptSource` (and its checkpoint format).

Staged schedules: POLARIS raises the sampling temperature per stage, lengthens the response budget
per stage and, entering a stage, drops the prompts the policy already solves (accuracy > 0.9, 0.9
itself kept); Re-Math trains domains one after another (one-hot stage weights) and ends with a
short refresh on the domain that degraded. A stage starts at a training step; the synchronous loop
tells the source the step (`set_step`), the asynchronous runtime draws ahead of the learner, so
there a prompt's stage is that of its position in the stream (prompt k is for step
k // prompts_per_step, which is the step it is trained in unless groups were filtered or dropped).
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any
from collections.abc import Callable, Collection, Sequence

import numpy as np

from mcore_rl.config.rl_schema import DomainConfig, RLConfig
from mcore_rl.config.sections import validation_prompts_needed
from mcore_rl.data.files import BadLines, DataError
from mcore_rl.data.prompts import (
    HELD_OUT_SEED_OFFSET,
    VALIDATION_SEED_OFFSET,
    ExampleSource,
    PromptSets,
    PromptSource,
    distinct_draw,
    read_prompt_file,
)
from mcore_rl.data.samples import Prompt
from mcore_rl.data.tasks import get_task

logger = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # domain names become metric keys (reward/<name>/mean)
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
DOMAIN_SEED_STRIDE = 7_919  # domain i draws its task pools with seed + i * stride
STAGE_SEED_STRIDE = 104_729  # a pool filtered by POLARIS is permuted anew with seed + this


# ------------------------------------------------------------------------------------ config view


@dataclass
class RewardHead:
    name: str
    weight: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)
    key: str | None = None  # its name in Sample.reward_heads (None: `name`)

    @property
    def head_name(self) -> str:
        return self.key or self.name


@dataclass
class DomainSpec:
    """What the rollout side needs of a domain (from the config alone, no files read)."""

    name: str
    rewards: list[RewardHead]
    group_size: int
    top_p: float
    top_k: int
    max_new_tokens: int
    weight: float = 1.0


def domain_source(d: Any) -> tuple[str, str]:
    """("path" | "task" | "reasoning_gym" | "environment", value) of a `DomainConfig` (the first one
    set; an environment's name when the domain has no other source: its prompts are the environment's)."""
    for kind in ("path", "task", "reasoning_gym"):
        value = getattr(d, kind)
        if value is not None:
            return kind, value
    env = getattr(d, "environment", None)
    if env is not None:
        return "environment", env.name
    return "", ""


def default_reward(d: DomainConfig, cfg: RLConfig) -> str:
    """The reward of a domain that lists none: its task's, reasoning-gym's scorer, or reward.name."""
    kind, value = domain_source(d)
    if kind == "reasoning_gym":
        return "reasoning_gym"
    if kind == "task":
        return get_task(value, **d.options).reward
    return cfg.reward.name


def legacy_domain_name(cfg: RLConfig) -> str:
    d = cfg.data
    return d.synthetic_task if d.path is None else d.path


def domain_specs(cfg: RLConfig) -> dict[str, DomainSpec]:
    """Every domain of an `RLConfig` by name; the single-source config is one domain."""
    r = cfg.rollout
    if not cfg.data.domains:
        return {
            legacy_domain_name(cfg): DomainSpec(
                legacy_domain_name(cfg), [RewardHead(cfg.reward.name)], r.group_size, r.top_p, r.top_k, r.max_new_tokens
            )
        }
    out = {}
    for d in cfg.data.domains:
        heads = [RewardHead(h.name, h.weight, dict(h.options), h.key) for h in d.rewards] or [
            RewardHead(default_reward(d, cfg))
        ]
        out[d.name] = DomainSpec(
            d.name,
            heads,
            d.group_size if d.group_size is not None else r.group_size,
            d.top_p if d.top_p is not None else r.top_p,
            d.top_k if d.top_k is not None else r.top_k,
            min(d.max_new_tokens or r.max_new_tokens, r.max_new_tokens),
            d.weight,
        )
    return out


# ------------------------------------------------------------------------------------ files


def read_domain_file(path: str, prompt_key: str, label_key: str, on_bad_line: str, key: str) -> list[tuple]:
    """(prompt, label[, max_new_tokens]) of a jsonl or parquet file; a bad line or row is
    reported as `path:line: problem` (the row number of a parquet file, from 1)."""
    if not path.endswith(".parquet"):
        return read_prompt_file(path, prompt_key, label_key, on_bad_line, key)
    if not os.path.isfile(path):
        raise DataError(f"{key}: no such file: {path}")
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except ImportError as err:
        raise DataError(f"{key}: reading parquet needs pyarrow ({err})") from None
    except Exception as err:
        raise DataError(f"{path}: not a readable parquet file: {type(err).__name__}: {err}") from None
    bad = BadLines(path, on_bad_line)
    pool: list[tuple] = []
    for row_no, row in enumerate(rows, start=1):
        if not isinstance(row.get(prompt_key), str):
            bad.report(row_no, f"expected a row with a string column {prompt_key!r}")
            continue
        budget = row.get("max_new_tokens")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            bad.report(row_no, f"'max_new_tokens' must be a positive integer, got {budget!r}")
            continue
        pool.append((row[prompt_key], row.get(label_key)) + ((budget,) if budget is not None else ()))
    if not pool:
        raise DataError(f"{path}: no prompts" + (f" ({bad.count} bad row(s) skipped)" if bad.count else ""))
    return pool


def domain_key(i: int, d: Any, leaf: str) -> str:
    return f"data.domains[{i}].{leaf} (domain {d.name!r})"


def read_domain_files(cfg: RLConfig) -> dict[str, list[tuple]]:
    """The files the domains name, read and checked, keyed by their config key (`data.domains[i].path`,
    `data.domains[i].eval.path`); a problem raises `DataError` naming the domain and the key."""
    out = {}
    for i, d in enumerate(cfg.data.domains):
        for leaf, path in (("path", d.path), ("eval.path", d.eval.path)):
            if path is None:
                continue
            key = domain_key(i, d, leaf)
            try:
                out[f"data.domains[{i}].{leaf}"] = read_domain_file(
                    path, d.prompt_key, d.label_key, cfg.data.on_bad_line, key
                )
            except DataError as err:
                msg = str(err)
                raise DataError(msg if msg.startswith(key) else f"{key}: {msg}") from None
    return out


# ------------------------------------------------------------------------------------ pools


def task_examples(d: Any, n: int, seed: int, environment_examples: ExampleSource | None = None) -> list[tuple]:
    """(prompt, label) pairs of a task or reasoning-gym domain (the RL label: a task's
    `rl_examples` when it has them, e.g. reasoning-gym's whole entry for its scorer)."""

    kind, value = domain_source(d)
    if kind == "environment":
        if environment_examples is None:
            raise DataError(
                f"domain {d.name!r}: the prompts of environment {value!r} come from the environment; "
                "build the prompt sets with its examples (mcore_rl.agent.groups.environment_examples)"
            )
        return environment_examples(d, n, seed)
    task = (
        get_task("reasoning_gym", dataset=value, **d.options)
        if kind == "reasoning_gym"
        else get_task(value, **d.options)
    )
    make = getattr(task, "rl_examples", task.examples)
    return make(n, seed)


def warm_start_source(d: DomainConfig, has_player: Callable[[str], bool] | None = None) -> bool:
    """Can domain `d` feed the SFT warm start: a task or reasoning-gym source (they know their answers),
    or an environment with a scripted player (`has_player(name)`; none when not given: `data` cannot
    import the environments)."""
    kind = domain_source(d)[0]
    if kind == "environment" and d.environment is not None:
        return has_player is not None and has_player(d.environment.name)
    return kind in ("task", "reasoning_gym")


def warm_start_share(cfg: RLConfig, d: DomainConfig, n: int, has_player: Callable[[str], bool] | None) -> int:
    """Domain `d`'s part of the warm start's `n` examples, by the mixture weights of the domains
    that feed it (`warm_start_source`); at least one."""
    feeding = [x for x in cfg.data.domains if warm_start_source(x, has_player)]
    total = sum(x.weight for x in feeding)
    return max(1, round(n * d.weight / total)) if total > 0 else max(1, n // max(1, len(feeding)))


def sft_examples(
    cfg: RLConfig,
    tokenizer: Any,
    n: int,
    seed: int,
    exclude: Collection[str] = (),
    has_player: Callable[[str], bool] | None = None,
) -> list[Any]:
    """The SFT warm start's (rendered prompt, reference answer) pairs of a multi-domain run: about
    `n` in all, shared by the mixture weights of every domain that can feed the warm start (an
    environment's share is played by its scripted player: `agent/demonstrations.py`), from every
    domain whose source is a task or a reasoning-gym generator (a file's label need not be one). Drawn
    from each domain's training seed with its held-out prompts (`exclude`, raw texts) left out, so
    the warm start never sees a prompt that evaluation scores."""
    from mcore_rl.data.sft import SFTExample  # lazy: torch

    domains = [(i, d) for i, d in enumerate(cfg.data.domains) if domain_source(d)[0] in ("task", "reasoning_gym")]
    drop = set(exclude)
    out = []
    for i, d in domains:
        kind, value = domain_source(d)
        task = (
            get_task("reasoning_gym", dataset=value, **d.options)
            if kind == "reasoning_gym"
            else get_task(value, **d.options)
        )
        render = renderer(d, tokenizer) or (lambda text: text)
        k = warm_start_share(cfg, d, n, has_player)
        for j, (prompt, answer) in enumerate(task.examples(k, seed + i * DOMAIN_SEED_STRIDE)):
            if prompt not in drop:
                out.append(SFTExample(render(prompt), str(answer), f"{d.name}:{j}"))
    np.random.default_rng(seed).shuffle(out)  # domains interleaved in the packed rows
    return out


def training_pool(cfg: RLConfig, i: int, environment_examples: ExampleSource | None = None) -> list[tuple]:
    """Domain i's training pool as the run draws it (its held-out prompts already removed): what a
    warm start may learn from without ever seeing a prompt that evaluation scores."""
    files = read_domain_files(cfg)
    return domain_pools(cfg, i, files, HELD_OUT_SEED_OFFSET, VALIDATION_SEED_OFFSET, environment_examples).train


def hold_out(pool: list[tuple], n: int, seed: int) -> tuple[list[tuple], list[tuple]]:
    """(training, held-out): `n` distinct prompt texts (at most half the file's) held out of a
    file that has no eval file, every line with such a text leaving the training pool."""
    texts = sorted({x[0] for x in pool})
    k = min(n, len(texts) // 2)
    if k < 1:
        raise DataError(f"{len(texts)} distinct prompt(s): too few to hold out an evaluation set (give eval.path)")
    chosen = {texts[i] for i in np.random.default_rng(seed).permutation(len(texts))[:k]}
    held: dict[str, tuple] = {}
    for x in pool:
        if x[0] in chosen:
            held.setdefault(x[0], x)
    return [x for x in pool if x[0] not in chosen], list(held.values())


@dataclass
class DomainPools:
    train: list[tuple]
    eval: list[tuple]
    validation: list[tuple]


def domain_pools(
    cfg: RLConfig,
    i: int,
    files: dict[str, list[tuple]],
    held_out_offset: int,
    validation_offset: int,
    environment_examples: ExampleSource | None = None,
) -> DomainPools:
    """The training, held-out and validation pools of domain i, the held-out texts removed from the
    other two (so evaluation never measures a prompt the run trained on)."""
    d, seed = cfg.data.domains[i], cfg.train.seed
    n_eval = d.eval.num_prompts or cfg.eval.num_prompts
    eval_seed = d.eval.seed if d.eval.seed is not None else seed + held_out_offset + i * DOMAIN_SEED_STRIDE
    if d.path is not None:
        train = files[f"data.domains[{i}].path"]
        if d.eval.path is not None:
            held = files[f"data.domains[{i}].eval.path"]
        else:
            try:
                train, held = hold_out(train, n_eval, eval_seed)
            except DataError as err:
                raise DataError(f"{domain_key(i, d, 'path')}: {err}") from None
        validation = train
    else:
        own = seed + i * DOMAIN_SEED_STRIDE
        examples = environment_examples
        train = task_examples(d, d.num_prompts, own, examples)
        if d.eval.path:
            held = files[f"data.domains[{i}].eval.path"]
        elif domain_source(d)[0] == "environment":  # its states, not its prompt texts, tell episodes apart
            held = task_examples(d, n_eval, eval_seed, examples)
        else:
            held = distinct_draw(lambda m: task_examples(d, m, eval_seed, examples), n_eval, f"domain {d.name!r}")
        n_val = max(64, validation_prompts_needed(cfg))
        validation = task_examples(d, n_val, own + validation_offset, examples)
    held = held[:n_eval]
    if domain_source(d)[0] == "environment":
        return environment_pools(d, train, held, validation)
    held_texts = {x[0] for x in held}
    train = [x for x in train if x[0] not in held_texts]
    validation = [x for x in validation if x[0] not in held_texts] or train
    if not train:
        raise DataError(f"{domain_key(i, d, 'eval')}: every training prompt is also in the evaluation set")
    logger.info(
        "domain %s: %d training prompts (%d distinct), %d held-out (%d distinct)",
        d.name,
        len(train),
        len({x[0] for x in train}),
        len(held),
        len(held_texts),
    )
    return DomainPools(train, held, validation)


def environment_pools(d: Any, train: list[tuple], held: list[tuple], validation: list[tuple]) -> DomainPools:
    """An environment's pools: its prompts share one text (the state is in the label: a secret, a
    seed), so the held-out (text, label) pairs leave the training pool; an environment whose states
    are fewer than the held-out set (guess-the-number's 16 secrets) cannot hold any out, and says so."""
    held_keys = {_state_key(x) for x in held}
    kept = [x for x in train if _state_key(x) not in held_keys]
    if not kept:
        logger.warning(
            "domain %r: the environment has no state outside the %d held-out prompts; "
            "evaluation measures states the run also trains on",
            d.name,
            len(held),
        )
        return DomainPools(train, held, validation)
    return DomainPools(kept, held, [x for x in validation if _state_key(x) not in held_keys] or kept)


def _state_key(example: tuple) -> tuple[str, str]:
    return example[0], repr(example[1])


def renderer(d: Any, tokenizer: Any) -> Callable[[str], str] | None:
    """The text the model sees for a raw prompt: the format string, or the chat template."""
    if d.chat_template:
        if not callable(getattr(tokenizer, "apply_chat_template", None)) or not getattr(
            tokenizer, "has_chat_template", False
        ):
            raise DataError(
                f"data.domains (domain {d.name!r}).chat_template: the tokenizer has no chat template "
                "(set data.tokenizer_path to a Hugging Face tokenizer that has one)"
            )
        system = [{"role": "system", "content": d.system_prompt}] if d.system_prompt else []
        return lambda text: tokenizer.apply_chat_template(
            system + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    if d.template is not None:
        template = d.template
        return lambda text: template.format(prompt=text)
    return None


def longest_prompt_check(
    name: str, pool: Sequence[tuple], encode: Callable[[str], list[int]], budget: int, seq_length: int
) -> None:
    """Every sample (prompt + response budget) of the domain must fit a packed row."""
    longest = max(len(encode(x[0])) for x in pool)
    if longest + budget > seq_length:
        raise DataError(
            f"domain {name!r}: its longest prompt has {longest} tokens; with max_new_tokens={budget} "
            f"it does not fit train.seq_length={seq_length}"
        )


# ------------------------------------------------------------------------------------ schedule


@dataclass
class Stage:
    start_step: int
    weights: dict[str, float]  # normalised, over every domain (0 for a domain left out)
    temperature: float | None = None
    max_new_tokens: int | None = None
    drop_solved_above: float | None = None


class MixtureSchedule:
    """Domain weights (and stage temperature / response budget) as a function of the step."""

    def __init__(self, domain_weights: dict[str, float], stages: Sequence[Any] = ()) -> None:
        self.domains = list(domain_weights)
        base = _normalised(domain_weights)
        self.stages = [Stage(0, base)]
        for st in stages:
            weights = _normalised({d: float(st.weights.get(d, 0.0)) for d in self.domains}) if st.weights else base
            stage = Stage(st.start_step, weights, st.temperature, st.max_new_tokens, st.drop_solved_above)
            if st.start_step == 0:
                self.stages[0] = stage
            else:
                self.stages.append(stage)

    def stage_index(self, step: int) -> int:
        k = 0
        for i, st in enumerate(self.stages):
            if st.start_step <= step:
                k = i
        return k

    def stage(self, step: int) -> Stage:
        return self.stages[self.stage_index(step)]

    def weights(self, step: int) -> dict[str, float]:
        return self.stage(step).weights


def stage_temperature(cfg: RLConfig, step: int) -> float:
    """The sampling temperature of training step `step` (its stage's, else rollout.temperature):
    the learner computes π_old and π_θ at it."""
    t = None
    for st in cfg.rollout.temperature_stages:  # POLARIS on one data source
        if st.start_step <= step:
            t = st.temperature
    if cfg.data.domains:
        for stage in cfg.data.mixture.stages:
            if stage.start_step <= step and stage.temperature is not None:
                t = stage.temperature
            elif stage.start_step <= step:
                t = None
    return t if t is not None else cfg.rollout.temperature


def single_source_stages(cfg: RLConfig) -> list[Any]:
    """`rollout.temperature_stages` (POLARIS on one data source) as the stages of a one-domain
    `MixtureSchedule`: each its temperature, each after the first dropping the prompts solved above
    `data.drop_solved_above`."""
    above = cfg.data.drop_solved_above
    return [
        SimpleNamespace(
            start_step=st.start_step,
            weights={},
            temperature=st.temperature,
            max_new_tokens=None,
            drop_solved_above=above if st.start_step > 0 else None,
        )
        for st in cfg.rollout.temperature_stages
    ]


def _normalised(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    if not (total > 0 and math.isfinite(total)):
        raise ValueError(f"mixture weights must sum to a positive number, got {weights}")
    return {d: w / total for d, w in weights.items()}


# ------------------------------------------------------------------------------------ POLARIS filters


def solved_prompts(accuracy: dict[str, float], above: float) -> set[str]:
    """POLARIS's stage filter: the prompts whose accuracy is strictly above `above` (0.9 itself stays)."""
    return {text for text, acc in accuracy.items() if acc > above}


def pass_rate_filter(pass_rates: dict[str, float], drop_at_or_above: float = 1.0) -> set[str]:
    """POLARIS's offline filter: the prompts to keep (those the model does not solve every time,
    8/8); the unsolved ones (0/8) are kept too."""
    return {text for text, rate in pass_rates.items() if rate < drop_at_or_above}


def diversity_score(rollouts: Sequence[Sequence[Any]], n: int = 4) -> float:
    """POLARIS's distinct n-gram ratio over a group of rollouts: #unique n-grams / #n-grams, in (0, 1]
    (the temperature is set where this stays high); NaN with no n-gram at all."""
    grams = [tuple(r[i : i + n]) for r in rollouts for i in range(len(r) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan


# ------------------------------------------------------------------------------------ the stream


class MixtureSource:
    """The training (or validation) stream of a multi-domain run: `PromptSource`s of the domains,
    mixed by a `MixtureSchedule`; the same interface as `PromptSource` (`take`, `state_dict`,
    `load_state_dict`) plus `set_step`, `observe` and the stage's `temperature`."""

    def __init__(
        self,
        sources: dict[str, Any],
        schedule: MixtureSchedule,
        seed: int,
        prompts_per_step: int,
        sampling: str = "interleave",
        budgets: dict[str, int] | None = None,
    ) -> None:
        self.sources, self.schedule, self.seed = dict(sources), schedule, seed
        self.base_pools = {d: list(s.pool) for d, s in self.sources.items()}
        self.prompts_per_step, self.sampling = prompts_per_step, sampling
        self.budgets = budgets or {}
        self.drawn = 0
        self.step: int | None = None  # set by the synchronous loop; else the stream position decides
        self.stage = 0
        self.credits = {d: 0.0 for d in self.sources}
        self.counts = {d: 0 for d in self.sources}
        self.accuracy: dict[str, dict[str, float]] = {d: {} for d in self.sources}
        self.dropped: dict[str, list[str]] = {d: [] for d in self.sources}

    # ---------------------------------------------------------------- where the stream is

    def current_step(self) -> int:
        return self.step if self.step is not None else self.drawn // self.prompts_per_step

    def set_step(self, step: int) -> None:
        self.step = step

    @property
    def temperature(self) -> float | None:
        """The stage's sampling temperature (None: rollout.temperature)."""
        return self.schedule.stage(self.current_step()).temperature

    def _enter(self, stage: int) -> None:
        """Move to `stage`: fresh interleaving credits; POLARIS's filter drops the solved prompts."""
        self.stage = stage
        self.credits = {d: 0.0 for d in self.sources}
        above = self.schedule.stages[stage].drop_solved_above
        if above is None:
            return
        for d in self.sources:
            newly = solved_prompts(self.accuracy[d], above) - set(self.dropped[d])
            if newly:
                self.dropped[d] = sorted(set(self.dropped[d]) | newly)
                self._refilter(d, self.sources[d].seed + STAGE_SEED_STRIDE)
                logger.info("domain %s: dropped %d solved prompt(s) entering stage %d", d, len(newly), stage)

    def _refilter(self, d: str, seed: int) -> None:
        """Rebuild domain d's stream over its pool less the dropped prompts (all dropped: unchanged),
        a new permutation (`seed`) from the start of an epoch."""
        gone = set(self.dropped[d])
        pool = [x for x in self.base_pools[d] if x[0] not in gone]
        if not pool:
            logger.warning("domain %s: every prompt is solved; keeping its pool", d)
            pool = self.base_pools[d]
        old = self.sources[d]
        new = PromptSource(pool, old.tokenizer, seed, old.add_bos, d, old.render)
        new.drawn = old.drawn
        self.sources[d] = new

    def _pick(self, weights: dict[str, float]) -> str:
        if self.sampling == "random":
            rng = np.random.default_rng([self.seed, self.drawn])
            names = list(weights)
            return names[int(rng.choice(len(names), p=[weights[d] for d in names]))]
        for d, w in weights.items():
            self.credits[d] += w
        best = max(weights, key=lambda d: (self.credits[d], -self.schedule.domains.index(d)))
        self.credits[best] -= 1.0
        return best

    # ---------------------------------------------------------------- drawing

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            k = self.schedule.stage_index(self.current_step())
            if k != self.stage:
                self._enter(k)
            stage = self.schedule.stages[k]
            d = self._pick({d: w for d, w in stage.weights.items() if w > 0})
            p = self.sources[d].take(1)[0]
            caps = [x for x in (p.max_new_tokens, self.budgets.get(d), stage.max_new_tokens) if x is not None]
            budget = min(caps) if caps else None
            out.append(replace(p, index=self.drawn, domain=d, max_new_tokens=budget))
            self.counts[d] += 1
            self.drawn += 1
        return out

    def observe(self, groups: Sequence[Sequence[Any]]) -> None:
        """Record each scored group's accuracy (mean reward of its valid samples) for its prompt."""
        for g in groups:
            ok = [s.reward for s in g if s.reward_error is None]
            if g and ok and g[0].prompt.domain in self.accuracy:
                self.accuracy[g[0].prompt.domain][g[0].prompt.text] = float(np.mean(ok))

    # ---------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "mixture": True,
            "drawn": self.drawn,
            "step": self.step,
            "stage": self.stage,
            "seed": self.seed,
            "credits": dict(self.credits),
            "counts": dict(self.counts),
            "domains": {d: s.state_dict() for d, s in self.sources.items()},
            "accuracy": {d: dict(a) for d, a in self.accuracy.items()},
            "dropped": {d: list(x) for d, x in self.dropped.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("mixture") or set(state["domains"]) != set(self.sources):
            raise ValueError(
                f"data state is for domains {sorted(state.get('domains', {})) or 'of a single source'}, "
                f"but this run has {sorted(self.sources)}; the domains changed since the checkpoint"
            )
        self.drawn, self.step, self.stage = int(state["drawn"]), state["step"], int(state["stage"])
        self.credits = {d: float(v) for d, v in state["credits"].items()}
        self.counts = {d: int(v) for d, v in state["counts"].items()}
        self.accuracy = {d: dict(a) for d, a in state["accuracy"].items()}
        self.dropped = {d: list(x) for d, x in state["dropped"].items()}
        for d in self.sources:
            if self.dropped[d]:
                self._refilter(d, int(state["domains"][d]["seed"]))
            self.sources[d].load_state_dict(state["domains"][d])


# ------------------------------------------------------------------------------------ the run's sets


def build_domain_sets(cfg: RLConfig, tokenizer: Any, environment_examples: ExampleSource | None = None) -> PromptSets:
    """The training and validation streams (mixtures over the domains) and the held-out set (every
    domain's, in domain order) of a multi-domain `RLConfig`."""
    d, seed = cfg.data, cfg.train.seed
    specs = domain_specs(cfg)
    files = read_domain_files(cfg)
    train, val = {}, {}
    eval_prompts: list[Prompt] = []
    for i, dom in enumerate(d.domains):
        pools = domain_pools(cfg, i, files, HELD_OUT_SEED_OFFSET, VALIDATION_SEED_OFFSET, environment_examples)
        render = renderer(dom, tokenizer)
        src = PromptSource(pools.train, tokenizer, seed + i * DOMAIN_SEED_STRIDE, d.add_bos, dom.name, render)
        longest_prompt_check(
            dom.name, pools.train + pools.eval, src.encode, specs[dom.name].max_new_tokens, cfg.train.seq_length
        )
        train[dom.name] = src
        val[dom.name] = PromptSource(
            pools.validation,
            tokenizer,
            seed + VALIDATION_SEED_OFFSET + i * DOMAIN_SEED_STRIDE,
            d.add_bos,
            dom.name,
            render,
        )
        held = PromptSource(pools.eval, tokenizer, seed + HELD_OUT_SEED_OFFSET, d.add_bos, dom.name, render)
        for p in held.take(len(pools.eval)):
            eval_prompts.append(
                replace(
                    p, index=len(eval_prompts), max_new_tokens=_cap(p.max_new_tokens, specs[dom.name].max_new_tokens)
                )
            )
    weights = {dom.name: dom.weight for dom in d.domains}
    budgets = {name: s.max_new_tokens for name, s in specs.items()}
    pps = cfg.rollout.prompts_per_step
    schedule = MixtureSchedule(weights, d.mixture.stages)
    return PromptSets(
        train=MixtureSource(train, schedule, seed, pps, d.mixture.sampling, budgets),  # type: ignore[arg-type]  # a MixtureSource serves as a PromptSource (same take/state methods)
        validation=MixtureSource(
            val, MixtureSchedule(weights), seed + VALIDATION_SEED_OFFSET, pps, d.mixture.sampling, budgets
        ),  # type: ignore[arg-type]  # a MixtureSource serves as a PromptSource (same take/state methods)
        eval_prompts=eval_prompts,
    )


def _cap(a: int | None, b: int) -> int:
    return min(a, b) if a is not None else b
