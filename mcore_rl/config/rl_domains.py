"""Rules of `data.domains` and `data.mixture` (a multi-domain RL run), checked with the rest of the
RL config before any worker starts: every message names the domain and the dotted key.

The files a domain names are read and checked by the CLI's preflight (`mcore_rl.data.prompts:
read_prompt_files`), before distributed initialisation, with `file:line` for a bad line. Task,
reasoning-gym and reward names are checked against their registries (imported lazily, as in
`rl_validate`).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import warnings
from typing import TYPE_CHECKING, Any

from mcore_rl.config.rl_agent import check_agent
from mcore_rl.config.rl_environment import check_environment
from mcore_rl.config.rules import Errors, check_stage_starts, need_registered

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import DomainConfig, RLConfig

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# what a judge reward's `url` is checked with where a judge group is named (its servers: known at run time)
JUDGE_GROUP_URL = "http://judge-group.invalid"
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo")


def check_domains(cfg: RLConfig, errors: Errors) -> None:
    """Names, sources, templates, rewards, sampling, eval sets and mixture weights of the domains."""
    d = cfg.data
    if not d.domains:
        errors.need(not d.mixture.stages, "data.mixture.stages", "needs data.domains (the domains it mixes)")
        return
    errors.need(d.path is None, "data.path", "set data.domains or data.path, not both (a file is a domain's path)")
    errors.need(
        cfg.init.sft.train.train_iters <= 0 or any(_feeds_warm_start(dom) for dom in d.domains),
        cfg.init.key("train.train_iters"),
        "the SFT warm start trains on the answers of task or reasoning-gym domains and on the turns of "
        "an environment's scripted player, and no domain has either; start from init.checkpoint instead",
    )
    names = [dom.name for dom in d.domains]
    for i, dom in enumerate(d.domains):
        check_domain(cfg, i, dom, errors)
        errors.need(
            names.count(dom.name) == 1 or names.index(dom.name) == i,
            f"data.domains[{i}].name",
            f"domain {dom.name!r} is defined twice",
        )
    weights = [dom.weight for dom in d.domains]
    errors.need(
        sum(w for w in weights if math.isfinite(w) and w >= 0) > 0,
        "data.domains",
        f"the mixture weights (data.domains[*].weight = {weights}) must sum to a positive number",
    )
    check_mixture(cfg, names, errors)


def _feeds_warm_start(dom: DomainConfig) -> bool:
    """`data.domains.warm_start_source`, with the environments' registry (an unknown one feeds none)."""
    from mcore_rl.data.domains import warm_start_source  # lazy: import cycle
    from mcore_rl.envs import env_has_player, env_names  # lazy: every environment module

    return warm_start_source(dom, lambda name: name in env_names() and env_has_player(name))


def _where(i: int, dom: DomainConfig) -> tuple[str, str]:
    return f"data.domains[{i}]", f"domain {dom.name!r}: "


def check_domain(cfg: RLConfig, i: int, dom: DomainConfig, errors: Errors) -> None:
    from mcore_rl.data.domains import NAME  # lazy: import cycle

    key, who = _where(i, dom)
    errors.need(
        bool(NAME.match(dom.name)),
        f"{key}.name",
        f"{dom.name!r} must be a non-empty name of letters, digits, '_', '.', '-' (it becomes a metric key)",
    )
    sources = [k for k in ("path", "task", "reasoning_gym") if getattr(dom, k) is not None]
    if dom.environment is not None:  # a multi-turn domain: the environment's own prompts
        errors.need(not sources, key, f"{who}an environment domain draws its environment's prompts; drop {sources}")
        errors.need(not dom.options, f"{key}.options", f"{who}an environment's options go in environment.options")
        check_environment(cfg, i, dom, errors)
        task = None
    elif not errors.need(
        len(sources) == 1, key, f"{who}needs exactly one source (path, task or reasoning_gym), got {sources or 'none'}"
    ):
        return
    else:
        task = check_source(i, dom, errors)
    check_agent(cfg, i, dom, errors)
    errors.need(dom.num_prompts >= 1, f"{key}.num_prompts", f"{who}must be >= 1, got {dom.num_prompts}")
    errors.need(
        math.isfinite(dom.weight) and dom.weight >= 0,
        f"{key}.weight",
        f"{who}must be a finite number >= 0, got {dom.weight}",
    )
    check_template(cfg, i, dom, errors)
    check_sampling(cfg, i, dom, task, errors)
    check_rewards(cfg, i, dom, task, errors)
    e = dom.eval
    errors.need(
        e.num_prompts is None or e.num_prompts >= 1,
        f"{key}.eval.num_prompts",
        f"{who}must be null or >= 1, got {e.num_prompts}",
    )
    if e.path is not None:
        errors.need(
            e.path.endswith(FILE_SUFFIXES), f"{key}.eval.path", f"{who}{e.path!r} is neither .jsonl nor .parquet"
        )
    if dom.path is not None:
        errors.need(
            e.seed is None,
            f"{key}.eval.seed",
            f"{who}a file domain's held-out set is a file (eval.path) or "
            "held out of its own file; a seed draws task and reasoning-gym prompts",
        )


def check_source(i: int, dom: DomainConfig, errors: Errors) -> Any:
    """The task the domain draws from (None for a file, or a source that does not build)."""
    from mcore_rl.data.tasks import get_task, task_names  # lazy: registries, read at validation

    key, who = _where(i, dom)
    if dom.path is not None:
        errors.need(
            dom.path.endswith(FILE_SUFFIXES), f"{key}.path", f"{who}{dom.path!r} is neither .jsonl nor .parquet"
        )
        errors.need(not dom.options, f"{key}.options", f"{who}options are for a task or reasoning-gym generator")
        return None
    if dom.task is not None:
        if not need_registered(errors, f"{key}.task", "task", dom.task, task_names(), f" ({who.rstrip(': ')})"):
            return None
        build = functools.partial(get_task, dom.task, **dom.options)
        leaf = "task"
    else:
        from mcore_rl.data.tasks.reasoning_gym import dataset_names  # lazy: registries, read at validation

        names = dataset_names()
        if not errors.need(
            dom.reasoning_gym in names,
            f"{key}.reasoning_gym",
            f"{who}unknown reasoning-gym task {dom.reasoning_gym!r}; available: {', '.join(names)}",
        ):
            return None
        build = functools.partial(get_task, "reasoning_gym", dataset=dom.reasoning_gym, **dom.options)
        leaf = "reasoning_gym"
    try:
        return build()
    except (TypeError, ValueError) as err:
        errors.need(False, f"{key}.options", f"{who}the {leaf} refuses its options {dom.options}: {err}")
        return None


def check_template(cfg: RLConfig, i: int, dom: DomainConfig, errors: Errors) -> None:
    key, who = _where(i, dom)
    if dom.template is not None:
        errors.need(not dom.chat_template, f"{key}.template", f"{who}set template or chat_template, not both")
        try:
            dom.template.format(prompt="x")
            ok, why = "{prompt}" in dom.template, "has no {prompt} field"
        except (KeyError, IndexError, ValueError) as err:
            ok, why = False, f"is not a format string with only {{prompt}}: {type(err).__name__}: {err}"
        errors.need(ok, f"{key}.template", f"{who}{dom.template!r} {why}")
    if dom.chat_template:
        errors.need(
            cfg.data.tokenizer_path is not None,
            f"{key}.chat_template",
            f"{who}needs a Hugging Face tokenizer with a chat template (data.tokenizer_path); the bundled "
            "byte tokenizer has none",
        )
    errors.need(
        dom.system_prompt is None or dom.chat_template,
        f"{key}.system_prompt",
        f"{who}is a chat-template message; set chat_template: true (or put it in the template)",
    )


def check_sampling(cfg: RLConfig, i: int, dom: DomainConfig, task: Any, errors: Errors) -> None:
    key, who = _where(i, dom)
    r = cfg.rollout
    errors.need(dom.top_p is None or 0 < dom.top_p <= 1, f"{key}.top_p", f"{who}must be in (0, 1], got {dom.top_p}")
    errors.need(
        dom.top_k is None or dom.top_k == -1 or dom.top_k >= 1,
        f"{key}.top_k",
        f"{who}must be -1 (off) or >= 1, got {dom.top_k}",
    )
    truncated = (dom.top_p is not None and dom.top_p < 1) or (dom.top_k is not None and dom.top_k != -1)
    if truncated and not r.sampling_mask_replay:
        warnings.warn(
            f"data.domains[{i}].top_p/top_k truncate domain {dom.name!r}'s sampling distribution: the "
            "engine's log-probs μ are of the untruncated one, so the mismatch correction sees only part of "
            "the difference (set rollout.sampling_mask_replay: true to renormalise π over the engine's kept tokens)",
            stacklevel=4,
        )
    if dom.max_new_tokens is not None:
        errors.need(
            1 <= dom.max_new_tokens <= r.max_new_tokens,
            f"{key}.max_new_tokens",
            f"{who}must be in [1, rollout.max_new_tokens={r.max_new_tokens}] (the engines' and learner's "
            f"cap), got {dom.max_new_tokens}",
        )
    if dom.group_size is not None:
        errors.need(dom.group_size >= 1, f"{key}.group_size", f"{who}must be >= 1, got {dom.group_size}")
        errors.need(
            dom.group_size != 1 or cfg.algorithm.advantage not in GROUP_RELATIVE,
            f"{key}.group_size",
            f"{who}is 1, but the group-relative advantage {cfg.algorithm.advantage!r} needs >= 2 samples",
        )
    prompt = task.max_prompt_tokens() if task is not None else 0
    if prompt > 0:
        budget = dom.max_new_tokens or r.max_new_tokens
        longest = (1 if cfg.data.add_bos else 0) + prompt + budget
        errors.need(
            longest <= cfg.train.seq_length,
            "train.seq_length",
            f"{cfg.train.seq_length} is shorter than the longest sample of domain {dom.name!r} ({longest} "
            "tokens: prompt + max_new_tokens)",
        )


def check_rewards(cfg: RLConfig, i: int, dom: DomainConfig, task: Any, errors: Errors) -> None:
    """Each head a registered reward (or an import path that loads) that accepts its options (a
    domain without heads is scored by its task's reward, or by reward.name for a file)."""
    import mcore_rl.data.tasks  # noqa: F401  (registers the tasks' rewards)
    from mcore_rl.rewards import (
        RewardInput,
        get_reward_fn,
        is_import_path,
        reward_names,
    )  # lazy: registries, read at validation
    from mcore_rl.rewards.judge import JUDGE_REWARDS, check_options as check_judge_options  # lazy: aiohttp

    key, who = _where(i, dom)
    heads = [h.key or h.name for h in dom.rewards]
    for j, h in enumerate(dom.rewards):
        hk = f"{key}.rewards[{j}]"
        errors.need(
            heads.count(h.key or h.name) == 1,
            f"{hk}.key" if h.key else f"{hk}.name",
            f"{who}reward head {h.key or h.name!r} is listed twice (each head is one entry of Sample.reward_heads; "
            "give a second one its own `key`)",
        )
        errors.need(math.isfinite(h.weight), f"{hk}.weight", f"{who}must be a finite number, got {h.weight}")
        if not is_import_path(h.name) and not need_registered(
            errors,
            f"{hk}.name",
            "reward",
            h.name,
            reward_names(),
            f" (or 'package.module:function'; {who.rstrip(': ')})",
        ):
            continue
        try:
            fn = get_reward_fn(h.name)
        except Exception as exc:
            errors.need(False, f"{hk}.name", f"{who}{h.name!r} cannot be loaded: {type(exc).__name__}: {exc}")
            continue
        options = dict(h.options)
        if "judge" in options:  # a judge group by name: its servers become the reward's `url`
            groups = [g.name for g in cfg.judges]
            errors.need(
                options["judge"] in groups,
                f"{hk}.options.judge",
                f"{who}{options['judge']!r} is not the name of a judge group (judges: {', '.join(groups) or 'none'})",
            )
            errors.need(
                "url" not in options, f"{hk}.options.url", f"{who}give the judge's `url` or a `judge` group, not both"
            )
            options["url"] = JUDGE_GROUP_URL
            del options["judge"]
        if h.name == "generative_rm":  # Z-Reward's teacher: every option, named (its score tokens at run start)
            from mcore_rl.rewards.generative_rm import check_options as check_generative_options  # lazy: aiohttp

            try:
                check_generative_options(options)
            except ValueError as err:
                option, _, why = str(err).partition(": ")
                errors.need(False, f"{hk}.options.{option}", f"{who}{why}")
                continue
        if h.name in JUDGE_REWARDS:  # every option and server setting, not just the signature (it takes **server)
            try:
                check_judge_options(h.name, options)
            except ValueError as err:
                errors.need(False, f"{hk}.options", f"{who}{err}")
                continue
        if options:
            try:
                inspect.signature(fn).bind(RewardInput("", ""), **options)
            except TypeError as err:
                errors.need(False, f"{hk}.options", f"{who}{h.name!r} does not take the options {h.options}: {err}")
                continue
            except ValueError:  # no signature (a builtin): found out at the first call
                continue
            from mcore_rl.algos.registry import literal_problems  # lazy: the algos package imports torch

            for name, problem in literal_problems(fn, options):
                errors.need(False, f"{hk}.options.{name}", f"{who}{problem}")
        if h.name in ("reward_model", "prm"):
            errors.need(
                ("model_dir" in options) != ("url" in options),
                f"{hk}.options",
                f"{who}give the reward model's `model_dir` or the `url` it is served at (one of them)",
            )
            refused = options.get("refused_score")
            errors.need(
                refused is None
                or (isinstance(refused, (int, float)) and not isinstance(refused, bool) and math.isfinite(refused)),
                f"{hk}.options.refused_score",
                f"{who}must be a finite number (the score of a sample the model refuses), got {refused!r}",
            )
        if h.name == "prm":
            delimiter = options.get("step_delimiter_ids")
            errors.need(
                isinstance(delimiter, list)
                and bool(delimiter)
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in delimiter),
                f"{hk}.options.step_delimiter_ids",
                f"{who}must be a non-empty list of token ids (the ids that end a step), got {delimiter!r}",
            )
        if h.name in ("reward_model", "prm") and isinstance(options.get("model_dir"), str):
            key = f"{hk}.options.model_dir"
            check_reward_model_vocab(options["model_dir"], cfg.model.vocab_size, key, who, errors)
            check_reward_model_tokenizer(options["model_dir"], cfg.data.tokenizer_path, key, who, errors)


def check_reward_model_vocab(model_dir: str, policy_vocab: int, key: str, who: str, errors: Errors) -> None:
    """A reward model must read every id the policy can write: an id past its vocabulary would make
    that sample a reward error, left out of the loss, so a policy could escape a low score by
    writing one. Read from the model's config.json, before any worker starts."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            vocab = json.load(f).get("vocab_size")
    except (OSError, ValueError) as err:
        errors.need(False, key, f"{who}{path} cannot be read: {type(err).__name__}: {err}")
        return
    errors.need(
        isinstance(vocab, int) and vocab >= policy_vocab,
        key,
        f"{who}the reward model's vocabulary ({vocab}, {path}) is smaller than the policy's "
        f"(model.vocab_size = {policy_vocab}): ids it cannot read would escape its score",
    )


def check_reward_model_tokenizer(
    model_dir: str, policy_tokenizer: str | None, key: str, who: str, errors: Errors
) -> None:
    """A reward model whose directory holds a tokenizer must tokenize like the policy
    (`data/tokenizer_match.py`): one trained with another tokenizer of the same vocabulary size
    would read the policy's ids as other text. Checked before any worker starts, as a served model
    is checked over `/tokenize` when the run starts; a directory with no tokenizer is checked by
    its vocabulary and end-of-text id only."""
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.data.tokenizer_match import has_tokenizer, tokenizer_difference

    if not os.path.isdir(model_dir) or not has_tokenizer(model_dir):
        return
    try:
        policy, other = load_tokenizer(policy_tokenizer), load_tokenizer(model_dir)
    except (OSError, ValueError) as err:
        errors.need(False, key, f"{who}the tokenizers cannot be compared: {type(err).__name__}: {err}"[:400])
        return
    problem = tokenizer_difference(policy, other)
    errors.need(
        problem is None,
        key,
        f"{who}the reward model's tokenizer ({model_dir}) is not the policy's "
        f"(data.tokenizer_path = {policy_tokenizer}): {problem}"[:500],
    )


def check_mixture(cfg: RLConfig, names: list[str], errors: Errors) -> None:
    """Stages in order from their start steps, weights over known domains summing to > 0."""
    m, r = cfg.data.mixture, cfg.rollout
    check_stage_starts(m.stages, "data.mixture.stages", errors)
    for k, st in enumerate(m.stages):
        key = f"data.mixture.stages[{k}]"
        unknown = sorted(set(st.weights) - set(names))
        errors.need(not unknown, f"{key}.weights", f"unknown domain(s) {unknown}; the domains are {names}")
        vals = [v for v in st.weights.values()]
        numeric = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in vals
        )
        errors.need(numeric, f"{key}.weights", f"must be finite numbers >= 0, got {st.weights}")
        if st.weights and numeric:
            errors.need(
                sum(st.weights.get(n, 0.0) for n in names) > 0,
                f"{key}.weights",
                f"must sum to a positive number, got {st.weights}",
            )
        if st.temperature is not None:
            errors.need(st.temperature > 0, f"{key}.temperature", f"must be > 0, got {st.temperature}")
            errors.need(
                r.runtime == "sync",
                f"{key}.temperature",
                "a staged temperature needs rollout.runtime=sync: the asynchronous runtime draws ahead of the "
                "learner, so one batch can hold groups of two stages, and the learner computes π at one "
                "temperature per batch",
            )
        if st.max_new_tokens is not None:
            errors.need(
                1 <= st.max_new_tokens <= r.max_new_tokens,
                f"{key}.max_new_tokens",
                f"must be in [1, rollout.max_new_tokens={r.max_new_tokens}], got {st.max_new_tokens}",
            )
        if st.drop_solved_above is not None:
            errors.need(
                0 <= st.drop_solved_above <= 1,
                f"{key}.drop_solved_above",
                f"must be in [0, 1] (an accuracy), got {st.drop_solved_above}",
            )
            errors.need(
                st.start_step > 0,
                f"{key}.drop_solved_above",
                "drops prompts solved in earlier stages; the first stage has none",
            )
