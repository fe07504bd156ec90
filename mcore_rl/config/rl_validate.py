"""Cross-field rules of an RL config (`mcore-rl train`), so a recipe fails before any worker starts.

`validate_rl_config` runs the shared model / parallel-layout / optimizer rules of
`mcore_rl.config.rules` on the RL config's own sections, then one `check_*` per RL section. Names
of algorithms, mismatch corrections, rewards and tasks are checked against their registries
(imported lazily: `mcore_rl.algos`, `mcore_rl.rewards` and `mcore_rl.data` import this package).
Each registered recipe checks its own keys (`Recipe.check`, `mcore_rl/hooks.py`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from mcore_rl.config.confidence_head import read_confidence_head
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.model_keys.mtp import MTPKeys
from mcore_rl import hooks
from mcore_rl.config.observability import check_observability
from mcore_rl.config.preemption import check_preempt_signals
from mcore_rl.config.rl_domains import check_domains
from mcore_rl.config.rl_environment import check_privileged_teachers
from mcore_rl.config.rl_recipes import check_stages
from mcore_rl.config.rl_vllm import check_vllm_engines
from mcore_rl.config.speculative import SGLANG_ONLY, speculative_shape_errors
from mcore_rl.config.rules import (
    Errors,
    build_task,
    check_layout,
    check_model_sizes,
    check_optimizer,
    check_parallel_sizes,
    check_task_name,
    need_registered,
    need_positive,
)
from mcore_rl.config.rl_schema import WARM_START_KEYS, CriticConfig, WarmStartConfig
from mcore_rl.config.schema import ModelConfig, ParallelConfig
from mcore_rl.config.validate import DerivedSizes

if TYPE_CHECKING:
    from mcore_rl.config.rl_schema import (
        AlgorithmConfig,
        DistillConfig,
        EngineGroupConfig,
        EvalConfig,
        InitConfig,
        JudgeConfig,
        RewardConfig,
        RLConfig,
        RLDataConfig,
        RLTrainConfig,
        RolloutConfig,
        TeacherConfig,
    )
    from mcore_rl.data.tasks import Task

# Advantages computed from the other samples of a prompt's group (one sample has none to compare with).
GROUP_RELATIVE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "golongrl", "dvao", "papo", "gigpo", "hgpo", "gagpo")


def validate_rl_config(cfg: RLConfig, world_size: int) -> DerivedSizes:
    """Raise `ConfigError` listing every impossible combination; else the derived sizes."""
    errors = Errors()
    sizes_ok = check_parallel_sizes(cfg.parallel, world_size, errors)
    sizes_ok &= check_model_sizes(cfg.model, errors)
    sizes_ok &= check_rl_train(cfg.train, errors)
    dp = edp = 0
    if sizes_ok:  # the layout rules divide by these sizes
        dp, edp = check_layout(cfg.model, cfg.parallel, cfg.train.seq_length, world_size, errors)
        check_rl_pipeline(cfg.parallel, errors)
    check_optimizer(cfg.optimizer, errors)
    task = synthetic_task(cfg.data, errors) if not cfg.data.domains else None  # domains: checked per domain
    check_data(cfg.data, cfg.rollout, errors)
    check_rollout(cfg.rollout, cfg.algorithm, errors)
    check_sample_fits(cfg.train, cfg.rollout, cfg.data, cfg.model, task, errors)
    check_algorithm(cfg.algorithm, cfg.rollout, errors)
    check_mismatch(cfg.algorithm, cfg.rollout, errors)
    check_routing_replay(cfg, errors)
    check_step_credit(cfg, errors)
    check_critic(cfg, errors)
    check_distill(cfg.distill, cfg.rollout, errors, cfg.teachers, cfg.algorithm)
    check_reward(cfg.reward, cfg.data, task, errors)
    check_domains(cfg, errors)
    check_eval(cfg.eval, errors)
    check_init(cfg.init, cfg.data, cfg.model, errors)
    check_mtp_heads(cfg, errors)
    check_teachers(cfg.teachers, cfg.rollout, errors, cfg.model.vocab_size)
    check_privileged_teachers(cfg, errors)
    check_judges(cfg.judges, errors)
    check_sampling_mask_replay(cfg, errors)
    check_vllm_engines(cfg, errors)
    check_stages(cfg, errors)
    hooks.check_all(cfg, errors)  # every registered recipe's keys (mcore_rl/recipes/)
    check_observability(cfg.logging, errors)  # observability
    check_preempt_signals(cfg.checkpoint, errors)  # launch: pre-emption signals
    errors.raise_if_any()
    return DerivedSizes(dp, edp, 1)  # the learner's micro-batch count varies with the rollout


def check_rl_train(t: RLTrainConfig, errors: Errors) -> bool:
    """Rows and micro-batches must be positive before the layout rules divide them."""
    ok = need_positive(errors, [("train.seq_length", t.seq_length), ("train.micro_batch_size", t.micro_batch_size)])
    errors.need(t.num_steps >= 0, "train.num_steps", f"must be >= 0, got {t.num_steps}")
    errors.need(
        t.logprob_chunk_size is None or t.logprob_chunk_size >= 1,
        "train.logprob_chunk_size",
        f"must be null or >= 1, got {t.logprob_chunk_size}",
    )
    return ok


def check_rl_pipeline(p: ParallelConfig, errors: Errors) -> None:
    """The interleaved schedule needs a multiple of pp micro-batches; RL steps have no fixed count."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size
    if vpp is not None and pp > 1:
        errors.need(
            False,
            "parallel.virtual_pipeline_model_parallel_size",
            f"is {vpp}, but the interleaved pipeline schedule needs a multiple of "
            f"pipeline_model_parallel_size {pp} micro-batches per step, and an RL step has as many as its "
            "samples fill (the SFT warm start: 1); leave it null",
        )


def synthetic_task(d: RLDataConfig, errors: Errors) -> Task | None:
    """The task the prompts come from when there is no `data.path` (None: a file, or an unknown name)."""
    return build_task(d.synthetic_task, d.synthetic_max_digits, errors) if d.path is None else None


def check_data(d: RLDataConfig, r: RolloutConfig, errors: Errors) -> None:
    """A registered task, and a synthetic pool large enough for one step's prompts."""
    check_task_name(d.synthetic_task, errors)
    errors.need(d.synthetic_max_digits >= 1, "data.synthetic_max_digits", f"must be >= 1, got {d.synthetic_max_digits}")
    errors.need(
        d.synthetic_num_prompts >= r.prompts_per_step,
        "data.synthetic_num_prompts",
        f"{d.synthetic_num_prompts} is fewer than rollout.prompts_per_step {r.prompts_per_step}",
    )


def check_rollout(r: RolloutConfig, a: AlgorithmConfig, errors: Errors) -> None:
    """Sampling must be stochastic and the engines reachable; groups must suit the advantage."""
    errors.need(r.group_size >= 1, "rollout.group_size", f"must be >= 1, got {r.group_size}")
    errors.need(
        r.group_size != 1 or a.advantage not in GROUP_RELATIVE_ADVANTAGES,
        "rollout.group_size",
        f"is 1, but the group-relative advantage {a.advantage!r} needs >= 2 samples per prompt",
    )
    errors.need(r.prompts_per_step >= 1, "rollout.prompts_per_step", f"must be >= 1, got {r.prompts_per_step}")
    errors.need(
        r.temperature > 0,
        "rollout.temperature",
        f"must be > 0 (RL samples from the policy; greedy rollouts have no log-prob ratio), got {r.temperature}",
    )
    errors.need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    errors.need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    if (r.top_p < 1 or r.top_k != -1) and not r.sampling_mask_replay:
        warnings.warn(
            "rollout.top_p/top_k truncate the sampling distribution: the engine's log-probs μ are of the "
            "untruncated one, so the mismatch correction sees only part of the difference (set "
            "rollout.sampling_mask_replay: true to renormalise π over the engine's kept tokens)",
            stacklevel=3,
        )
    errors.need(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    check_engine_group(r.engines, "rollout", started_engines(r), errors, r.ENGINE_KEYS)
    check_speculative(r, errors)
    errors.need(r.sync_bucket_mb >= 1, "rollout.sync_bucket_mb", f"must be >= 1, got {r.sync_bucket_mb}")
    if (r.engine_urls or r.engine_kind == "vllm") and r.sync_transport == "disk":
        errors.need(
            bool(r.sync_dir), "rollout.sync_dir", "the disk weight transport needs a directory the engines can read"
        )
    check_runtime(r, a, errors)


def check_mtp_heads(cfg: RLConfig, errors: Errors) -> None:
    """Co-training and NEXTN drafting need the policy's MTP heads (`model.mtp_num_layers`)."""
    heads = cfg.model.section(MTPKeys).mtp_num_layers
    coeff = cfg.algorithm.mtp_heads_coeff
    errors.need(coeff >= 0, "algorithm.mtp_heads_coeff", f"must be >= 0, got {coeff}")
    errors.need(
        coeff == 0 or heads > 0, "algorithm.mtp_heads_coeff", "co-trains MTP heads: set model.mtp_num_layers > 0"
    )
    errors.need(
        cfg.rollout.speculative_algorithm != "nextn" or heads > 0,
        "rollout.speculative_algorithm",
        "nextn drafts with the policy's MTP heads: set model.mtp_num_layers > 0",
    )


def check_confidence_head(r: RolloutConfig, errors: Errors) -> None:
    """DSpark's trained head: read by the dspark schedule only, and loaded here so a bad file fails
    before any engine starts."""
    path = r.speculative_confidence_head
    if path is None:
        return
    if not errors.need(
        r.speculative_schedule == "dspark",
        "rollout.speculative_confidence_head",
        f"is set but rollout.speculative_schedule is {r.speculative_schedule} (only dspark reads it)",
    ):
        return
    try:
        read_confidence_head(path)
    except (OSError, ValueError) as e:
        errors.need(False, "rollout.speculative_confidence_head", f"cannot be loaded: {e}")


def check_speculative(r: RolloutConfig, errors: Errors) -> None:
    """`rollout.speculative_*` configure the engines the trainer builds; servers at `engine_urls` take
    their own `--speculative-*` flags."""
    if r.speculative_algorithm == "none":
        errors.need(
            r.speculative_schedule == "fixed",
            "rollout.speculative_schedule",
            "is dspark but rollout.speculative_algorithm is none (nothing to schedule)",
        )
        errors.need(
            r.speculative_draft_model_path is None,
            "rollout.speculative_draft_model_path",
            "is set but rollout.speculative_algorithm is none (set it to standalone)",
        )
        errors.need(
            r.speculative_confidence_head is None,
            "rollout.speculative_confidence_head",
            "is set but rollout.speculative_algorithm is none (nothing to schedule)",
        )
        return
    check_confidence_head(r, errors)
    errors.need(
        not r.engine_urls,
        "rollout.speculative_algorithm",
        "configures the engines the trainer builds; give the servers at rollout.engine_urls their own "
        "--speculative-* flags instead",
    )
    errors.need(
        r.speculative_num_steps >= 1, "rollout.speculative_num_steps", f"must be >= 1, got {r.speculative_num_steps}"
    )
    errors.need(
        r.speculative_algorithm not in SGLANG_ONLY,
        "rollout.speculative_algorithm",
        f"{r.speculative_algorithm} drafts only on SGLang engine nodes (mcore-rl launch --engine-nodes, "
        "launch/engines.sh): the embedded engine and mcore-rl serve have no EAGLE drafts",
    )
    errors.need(
        r.speculative_eagle_topk == 1,
        "rollout.speculative_eagle_topk",
        f"the embedded engine drafts a chain (1); draft trees are SGLang's, got {r.speculative_eagle_topk}",
    )
    for key, message in speculative_shape_errors(r):
        errors.need(False, key, message)
    if r.speculative_algorithm == "standalone":
        path = r.speculative_draft_model_path
        errors.need(
            bool(path) and os.path.isfile(os.path.join(path or "", "config.json")),
            "rollout.speculative_draft_model_path",
            f"standalone needs an HF model directory with config.json, got {path!r}",
        )


def check_sampling_mask_replay(cfg: RLConfig, errors: Errors) -> None:
    """`rollout.sampling_mask_replay` needs a truncated, stochastic sampler on every training stream
    (else there is no mask to replay, and SGLang refuses `return_sampling_mask` for an unbounded
    support) and does not combine with the distillation top-k ids."""
    r = cfg.rollout
    if not r.sampling_mask_replay:
        return
    key = "rollout.sampling_mask_replay"
    errors.need(r.temperature > 0, key, f"needs rollout.temperature > 0 (greedy has no mask), got {r.temperature}")
    streams = [("rollout", r.top_p, r.top_k)]
    for i, dom in enumerate(cfg.data.domains):
        streams.append(
            (
                f"data.domains[{i}] ({dom.name})",
                dom.top_p if dom.top_p is not None else r.top_p,
                dom.top_k if dom.top_k is not None else r.top_k,
            )
        )
    for where, top_p, top_k in streams:
        errors.need(
            top_p < 1 or top_k != -1,
            key,
            f"{where} samples with top_p == 1 and top_k == -1: nothing to replay (the support is the whole "
            "vocabulary); set top_p < 1 or top_k >= 1 there, or turn sampling_mask_replay off",
        )
    errors.need(
        cfg.distill.top_k == 0,
        key,
        f"does not combine with distill.top_k={cfg.distill.top_k} (the student's log-probs at the teacher's "
        "top-k ids would need their own mask); set distill.top_k: 0 or turn sampling_mask_replay off",
    )


def started_engines(r: RolloutConfig) -> bool:
    """Does the trainer start engine processes itself (`mcore-rl serve`, or vLLM servers, which
    are never embedded)?"""
    if r.engine_urls:
        return False
    if r.engine_kind == "vllm":
        return True
    return r.runtime == "async" if r.engine_processes is None else r.engine_processes


def check_runtime(r: RolloutConfig, a: AlgorithmConfig, errors: Errors) -> None:
    """The asynchronous runtime's settings: staleness, in-flight bound, buffer, engine processes."""
    errors.need(r.max_staleness >= 0, "rollout.max_staleness", f"must be >= 0, got {r.max_staleness}")
    errors.need(
        r.runtime == "async" or r.max_staleness == 0,
        "rollout.max_staleness",
        f"{r.max_staleness} needs rollout.runtime=async (the synchronous loop trains on fresh samples only)",
    )
    errors.need(
        not (r.placement == "colocated" and r.engine_urls),
        "rollout.placement",
        "colocated (engines time-share the trainer's devices) needs engines this trainer starts; it cannot "
        "release the memory of remote servers in rollout.engine_urls",
    )
    errors.need(
        not (r.placement == "colocated" and r.engine_processes is False),
        "rollout.placement",
        "colocated needs engine processes (rollout.engine_processes must not be false)",
    )
    errors.need(
        r.runtime == "async" or r.placement == "disaggregated",
        "rollout.placement",
        "colocated needs rollout.runtime=async (it is how the async runtime time-shares devices)",
    )
    errors.need(r.no_engine_timeout_s > 0, "rollout.no_engine_timeout_s", f"must be > 0, got {r.no_engine_timeout_s}")
    for key in ("control_timeout_s", "weight_update_timeout_s"):
        errors.need(getattr(r, key) > 0, f"rollout.{key}", f"must be > 0, got {getattr(r, key)}")
    errors.need(
        r.health_check_interval_s > 0,
        "rollout.health_check_interval_s",
        f"must be > 0, got {r.health_check_interval_s}",
    )
    errors.need(
        r.engine_startup_timeout_s > 0,
        "rollout.engine_startup_timeout_s",
        f"must be > 0, got {r.engine_startup_timeout_s}",
    )
    errors.need(
        r.max_inflight_requests >= 0,
        "rollout.max_inflight_requests",
        f"must be >= 0 (0 = what the engines accept), got {r.max_inflight_requests}",
    )
    errors.need(r.max_regenerations >= 0, "rollout.max_regenerations", f"must be >= 0, got {r.max_regenerations}")
    errors.need(r.buffer_groups >= 0, "rollout.buffer_groups", f"must be >= 0 (0 = automatic), got {r.buffer_groups}")
    check_engine_processes(r, errors)
    if r.runtime != "async":
        return
    if r.max_inflight_requests:
        errors.need(
            r.max_inflight_requests >= r.group_size,
            "rollout.max_inflight_requests",
            f"{r.max_inflight_requests} is fewer than one group (rollout.group_size={r.group_size})",
        )
        if started_engines(r):
            accept = r.num_embedded_engines * r.max_running_requests
            errors.need(
                r.max_inflight_requests <= accept,
                "rollout.max_inflight_requests",
                f"{r.max_inflight_requests} is more than the started engines accept "
                f"(rollout.num_embedded_engines x rollout.max_running_requests = {accept})",
            )
    if r.buffer_groups:
        errors.need(
            r.buffer_groups >= r.prompts_per_step,
            "rollout.buffer_groups",
            f"{r.buffer_groups} cannot hold one batch (rollout.prompts_per_step={r.prompts_per_step})",
        )


def check_engine_processes(r: RolloutConfig, errors: Errors) -> None:
    """Placement of the engine processes the trainer starts (cores, devices, threads)."""
    if not started_engines(r):  # engine_cores, threads: check_engine_group
        errors.need(
            not r.engine_devices,
            "rollout.engine_devices",
            "only applies to engines the trainer starts "
            "(rollout.engine_urls is set or rollout.engine_processes is false)",
        )
        return
    n = r.num_embedded_engines
    errors.need(
        not r.engine_devices or len(r.engine_devices) == n,
        "rollout.engine_devices",
        f"needs one entry per engine (rollout.num_embedded_engines={n}), got {len(r.engine_devices)}",
    )


def check_sample_fits(
    t: RLTrainConfig, r: RolloutConfig, d: RLDataConfig, m: ModelConfig, task: Task | None, errors: Errors
) -> None:
    """The longest sample (bos + prompt + response) must fit in one packed row and the engine's context."""
    prompt = task.max_prompt_tokens() if task is not None else 0  # 0: a file, length unknown
    if prompt > 0:
        longest = (1 if d.add_bos else 0) + prompt + r.max_new_tokens
        errors.need(
            longest <= t.seq_length,
            "train.seq_length",
            f"{t.seq_length} is shorter than the longest sample ({longest} tokens: prompt + "
            f"rollout.max_new_tokens={r.max_new_tokens}); raise it or lower rollout.max_new_tokens",
        )
        if not r.engine_urls:
            errors.need(
                longest <= r.context_length,
                "rollout.context_length",
                f"{r.context_length} is shorter than the longest sample ({longest} tokens)",
            )
    errors.need(
        m.max_position_embeddings >= t.seq_length,
        "model.max_position_embeddings",
        f"{m.max_position_embeddings} < train.seq_length {t.seq_length}",
    )


def check_algorithm(a: AlgorithmConfig, r: RolloutConfig, errors: Errors) -> None:
    """Registered advantage and policy loss, PPO clip ranges, loss weights, mini-batching."""
    from mcore_rl.algos import registry  # lazy: registries, read at validation

    need_registered(errors, "algorithm.advantage", "advantage", a.advantage, registry.names("advantage"))
    need_registered(errors, "algorithm.policy_loss", "policy loss", a.policy_loss, registry.names("policy_loss"))
    errors.need(0 <= a.clip_low < 1, "algorithm.clip_low", f"must be in [0, 1), got {a.clip_low}")
    errors.need(a.clip_high >= 0, "algorithm.clip_high", f"must be >= 0, got {a.clip_high}")
    errors.need(
        a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", f"must be null or > 1, got {a.dual_clip}"
    )
    errors.need(a.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {a.kl_coef}")
    errors.need(a.entropy_coef >= 0, "algorithm.entropy_coef", f"must be >= 0, got {a.entropy_coef}")
    need_positive(errors, [("algorithm.num_minibatches", a.num_minibatches), ("algorithm.ppo_epochs", a.ppo_epochs)])
    errors.need(
        a.num_minibatches <= r.prompts_per_step * r.group_size,
        "algorithm.num_minibatches",
        f"{a.num_minibatches} mini-batches need at least as many samples; a rollout batch has "
        f"rollout.prompts_per_step x rollout.group_size = {r.prompts_per_step * r.group_size}",
    )
    if a.kl_in_reward and a.kl_coef > 0 and a.kl_estimator != "k1":
        warnings.warn("algorithm.kl_in_reward with a k2/k3 estimator: the InstructGPT penalty is k1", stacklevel=3)
    check_multi_reward(a, errors)
    ds = a.dynamic_sampling
    if ds.enabled:
        errors.need(ds.max_rounds >= 1, "algorithm.dynamic_sampling.max_rounds", f"must be >= 1, got {ds.max_rounds}")
        errors.need(
            ds.max_oversample >= 1,
            "algorithm.dynamic_sampling.max_oversample",
            f"must be >= 1, got {ds.max_oversample}",
        )
        errors.need(
            math.isfinite(ds.std_tolerance) and ds.std_tolerance >= 0,
            "algorithm.dynamic_sampling.std_tolerance",
            f"must be a finite number >= 0, got {ds.std_tolerance}",
        )


def check_step_credit(cfg: RLConfig, errors: Errors) -> None:
    """A step-level estimator (GiGPO, HGPO, GAGPO) compares the steps of episodes: every domain of the
    run must give one sample per step (an environment with `trajectory: stepwise`)."""
    from mcore_rl.algos import registry  # lazy: registries, read at validation
    from mcore_rl.algos.step_credit import takes_steps  # lazy: registries, read at validation

    name = cfg.algorithm.advantage
    if name not in registry.names("advantage") or not takes_steps(registry.get("advantage", name)):
        return
    what = f"{name!r} is a step-level estimator and needs one sample per step of an episode"
    if not cfg.data.domains:
        errors.need(False, "algorithm.advantage", f"{what}, but the run's prompts are single-turn (no data.domains)")
    for i, d in enumerate(cfg.data.domains):
        if d.environment is None:
            errors.need(
                False,
                "algorithm.advantage",
                f"{what}, but domain {d.name!r} (data.domains[{i}]) is single-turn (no environment)",
            )
        else:
            errors.need(
                d.environment.trajectory == "stepwise",
                f"data.domains[{i}].environment.trajectory",
                f"is {d.environment.trajectory!r}, but algorithm.advantage {what}: use stepwise",
            )


def check_critic(cfg: RLConfig, errors: Errors) -> None:
    """`algorithm.critic`: its keys, and only for an advantage that reads a critic (`gae`, `steppo`);
    a single-turn one (`gae`) refuses step-wise episodes, where each step would be its own episode."""
    from mcore_rl.algos import registry  # lazy: registries, read at validation
    from mcore_rl.algos.critic import takes_values  # lazy: registries, read at validation
    from mcore_rl.algos.step_credit import takes_steps  # lazy: registries, read at validation

    a, c = cfg.algorithm, cfg.algorithm.critic
    if a.advantage not in registry.names("advantage"):
        return
    fn = registry.get("advantage", a.advantage)
    if not takes_values(fn):
        errors.need(
            c == CriticConfig(),
            "algorithm.critic",
            f"is set, but algorithm.advantage {a.advantage!r} reads no critic (gae and steppo do)",
        )
        return
    errors.need(c.lr is None or c.lr > 0, "algorithm.critic.lr", f"must be null or > 0, got {c.lr}")
    errors.need(
        c.value_clip is None or c.value_clip > 0,
        "algorithm.critic.value_clip",
        f"must be null or > 0, got {c.value_clip}",
    )
    errors.need(c.loss_coef > 0, "algorithm.critic.loss_coef", f"must be > 0, got {c.loss_coef}")
    errors.need(
        0 <= c.warmup_steps < max(cfg.train.num_steps, 1),
        "algorithm.critic.warmup_steps",
        f"must be in [0, train.num_steps={cfg.train.num_steps}), got {c.warmup_steps}",
    )
    errors.need(
        c.init_checkpoint is None or os.path.isdir(c.init_checkpoint),
        "algorithm.critic.init_checkpoint",
        f"{c.init_checkpoint!r} is not a directory",
    )
    errors.need(
        cfg.model.section(MTPKeys).mtp_num_layers == 0,
        "model.mtp_num_layers",
        f"is {cfg.model.section(MTPKeys).mtp_num_layers}, but the critic of algorithm.advantage {a.advantage!r} "
        "is built without MTP heads only: set it to 0",
    )
    if takes_steps(fn):
        return
    for i, d in enumerate(cfg.data.domains):
        errors.need(
            d.environment is None or d.environment.trajectory != "stepwise",
            f"data.domains[{i}].environment.trajectory",
            f"is 'stepwise', but algorithm.advantage {a.advantage!r} is token-level GAE over one sample: "
            "each step would be an episode of its own (steppo is the step-level estimator)",
        )


def check_routing_replay(cfg: RLConfig, errors: Errors) -> None:
    """MoE routing replay needs routers to replay in, and a forward that runs once per micro-batch."""
    mode = cfg.algorithm.routing_replay
    if mode == "none":
        return
    errors.need(
        cfg.model.is_moe and cfg.model.section(MoEKeys).num_experts > 0,
        "algorithm.routing_replay",
        f"{mode!r} replays MoE routing, but the model is dense (model.arch={cfg.model.arch!r}, "
        f"model.num_experts={cfg.model.section(MoEKeys).num_experts})",
    )
    errors.need(
        cfg.train.recompute != "full",
        "algorithm.routing_replay",
        f"{mode!r} with train.recompute=full: the recomputed forward in backward would route "
        "another micro-batch's experts; use train.recompute none or selective",
    )


def check_multi_reward(a: AlgorithmConfig, errors: Errors) -> None:
    """The advantage's options, the reward-shaping list (registered names, their options, the
    domains they apply to) and the per-domain advantage weights, each error under its dotted key."""
    from mcore_rl.algos import registry  # lazy: registries, read at validation
    from mcore_rl.algos.multi_reward import option_problems  # lazy: registries, read at validation

    def report(prefix: str, problems: list[tuple[str, str]]) -> None:
        for option, message in problems:
            errors.need(False, f"{prefix}.{option}" if option else prefix, message)

    if a.advantage in registry.names("advantage"):
        report("algorithm.advantage_options", option_problems("advantage", a.advantage, a.advantage_options))
    if a.policy_loss in registry.names("policy_loss"):
        report("algorithm.policy_loss_options", option_problems("policy_loss", a.policy_loss, a.policy_loss_options))
    for i, shaping in enumerate(a.reward_shaping):
        key = f"algorithm.reward_shaping[{i}]"
        if need_registered(errors, f"{key}.name", "reward shaping", shaping.name, registry.names("reward_shaping")):
            report(f"{key}.options", option_problems("reward_shaping", shaping.name, shaping.options))
        for j, domain in enumerate(shaping.domains):
            errors.need(
                isinstance(domain, str) and bool(domain),
                f"{key}.domains[{j}]",
                f"must be a domain name, got {domain!r}",
            )
        errors.need(
            len(set(shaping.domains)) == len(shaping.domains),
            f"{key}.domains",
            f"lists a domain twice: {shaping.domains}",
        )
    for field_name, kind in (("sample_filters", "sample_filter"), ("advantage_shaping", "advantage_shaping")):
        for i, step in enumerate(getattr(a, field_name)):
            key = f"algorithm.{field_name}[{i}]"
            if need_registered(errors, f"{key}.name", kind.replace("_", " "), step.name, registry.names(kind)):
                report(f"{key}.options", option_problems(kind, step.name, step.options))
            errors.need(
                all(isinstance(d, str) and d for d in step.domains),
                f"{key}.domains",
                f"must list domain names, got {step.domains!r}",
            )
    for i, term in enumerate(a.aux_losses):
        key = f"algorithm.aux_losses[{i}]"
        if need_registered(errors, f"{key}.name", "aux loss", term.name, registry.names("aux_loss")):
            report(f"{key}.options", option_problems("aux_loss", term.name, term.options))
        errors.need(math.isfinite(term.coef), f"{key}.coef", f"must be a finite number, got {term.coef!r}")
    if not a.uses_reference():  # steps that read π_ref's log-probs (`needs_reference`, e.g. VIMPO's)
        for field_name, kind in (("advantage_shaping", "advantage_shaping"), ("aux_losses", "aux_loss")):
            for i, step in enumerate(getattr(a, field_name)):
                fn = registry.get(kind, step.name) if step.name in registry.names(kind) else None
                if getattr(fn, "needs_reference", False):
                    errors.need(
                        False,
                        "algorithm.reference_model",
                        f"algorithm.{field_name}[{i}] {step.name!r} reads π_ref's log-probs; set "
                        "algorithm.reference_model: true (or algorithm.kl_coef > 0)",
                    )
    for domain, rho in a.domain_advantage_weights.items():
        ok = isinstance(rho, (int, float)) and not isinstance(rho, bool) and math.isfinite(rho) and rho >= 0
        errors.need(ok, f"algorithm.domain_advantage_weights.{domain}", f"must be a number >= 0, got {rho!r}")


def check_mismatch(a: AlgorithmConfig, r: RolloutConfig, errors: Errors) -> None:
    """A registered correction with non-negative, ordered bounds (a recipe built around one checks
    its own rules)."""
    from mcore_rl.algos import registry  # lazy: registries, read at validation

    m = a.mismatch
    need_registered(errors, "algorithm.mismatch.name", "mismatch correction", m.name, registry.names("mismatch"))
    for key in ("clip_low", "clip_high", "mask_low", "mask_high", "veto_threshold"):
        v = getattr(m, key)
        errors.need(
            v is None or (v >= 0 and not math.isnan(v)), f"algorithm.mismatch.{key}", f"must be null or >= 0, got {v}"
        )
    if m.clip_low is not None and m.clip_high is not None:
        errors.need(
            m.clip_low <= m.clip_high,
            "algorithm.mismatch.clip_low",
            f"{m.clip_low} exceeds algorithm.mismatch.clip_high {m.clip_high}",
        )
    if m.mask_low is not None and m.mask_high is not None:
        errors.need(
            m.mask_low <= m.mask_high,
            "algorithm.mismatch.mask_low",
            f"{m.mask_low} exceeds algorithm.mismatch.mask_high {m.mask_high}",
        )


def check_distill(
    d: DistillConfig,
    r: RolloutConfig,
    errors: Errors,
    teachers: Sequence[Any] = (),
    algorithm: AlgorithmConfig | None = None,
) -> None:
    """Registered distillation functions with a phase and options they accept, and the teacher
    signals they need (`@needs`: a teacher at all, its top-k, a reference teacher); a horizon that cuts."""
    import inspect

    from mcore_rl.algos import registry  # lazy: registries, read at validation
    from mcore_rl.algos.distill.base import (  # lazy: registries, read at validation
        POLICY_REFERENCE_FIELDS,
        REFERENCE_FIELDS,
        TOPK_FIELDS,
        UNFILLED_FIELDS,
        make_state,
    )

    errors.need(
        not d.losses or bool(teachers),
        "distill.losses",
        "no teacher fills Sample.teacher: add a `teachers:` entry (engine, privileged or frozen)",
    )

    registered = registry.names("distill")
    seen: set[str] = set()
    for i, loss in enumerate(d.losses):
        key = f"distill.losses[{i}]"
        if not need_registered(errors, f"{key}.name", "distill function", loss.name, registered):
            continue
        errors.need(loss.name not in seen, f"{key}.name", f"{loss.name!r} is listed twice (its metrics share a name)")
        seen.add(loss.name)
        fn = registry.get("distill", loss.name)
        errors.need(
            getattr(fn, "phase", None) in ("advantage", "loss"),
            f"{key}.name",
            f"{loss.name!r} has no phase (mark it with @phase('advantage') or @phase('loss'))",
        )
        errors.need(
            loss.coef is None or (math.isfinite(loss.coef) and loss.coef >= 0),
            f"{key}.coef",
            f"must be >= 0 or null (the term's default), got {loss.coef}",
        )
        wanted = getattr(fn, "needs", ())
        references = reference_teachers(teachers)
        if any(f in TOPK_FIELDS or f == "teacher_ref_topk_logp" for f in wanted):
            errors.need(d.top_k > 0, "distill.top_k", f"is 0, but {loss.name!r} needs the teacher's top-k")
            for j, t in enumerate(teachers):
                errors.need(
                    j in references or t.top_k >= d.top_k,
                    f"teachers[{j}].top_k",
                    f"is {t.top_k}, but {loss.name!r} reads the top {d.top_k} (distill.top_k) of every teacher",
                )
        ref = [f for f in wanted if f in REFERENCE_FIELDS]
        for j, t in enumerate(teachers):  # every teacher a distilled sample can be routed to
            errors.need(
                not ref or j in references or bool(t.reference),
                f"teachers[{j}].reference",
                f"is not set, but {loss.name!r} needs a reference teacher (π_Tref: {', '.join(ref)}) for the "
                f"samples routed to {teacher_name(t, j)!r}: name an engine teacher serving its starting "
                "weights (engine teachers only)",
            )
        for f in wanted:
            errors.need(
                f not in UNFILLED_FIELDS,
                f"{key}.name",
                f"{loss.name!r} needs DistillBatch.{f}, which no "
                "rollout of this trainer fills yet (see docs/distillation.md): it would train nothing",
            )
            errors.need(
                f not in POLICY_REFERENCE_FIELDS or algorithm is None or algorithm.uses_reference(),
                "algorithm.reference_model",
                f"is off, but {key} {loss.name!r} reads the student's reference model (π_ref, the starting "
                "weights): set algorithm.reference_model: true",
            )
        kl_coef = 0.0 if algorithm is None else algorithm.kl_coef
        errors.need(
            not getattr(fn, "own_kl", False) or kl_coef == 0,
            "algorithm.kl_coef",
            f"is {kl_coef}, but {key} {loss.name!r} carries its own adaptive KL to π_ref (options.alpha); "
            "set algorithm.kl_coef: 0 so the KL is not counted twice",
        )
        try:  # a stateful term's options are checked by building its state
            make_state(fn, loss.options)
        except (ValueError, TypeError) as e:
            errors.need(False, f"{key}.options", str(e))
        params = [
            p
            for p in list(inspect.signature(fn).parameters.values())[1:]  # after the batch
            if not (p.name == "state" and hasattr(fn, "make_state"))
        ]  # the learner passes it
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            accepted = [p.name for p in params]
            for opt in loss.options:
                errors.need(
                    opt in accepted,
                    f"{key}.options.{opt}",
                    f"is not an option of {loss.name!r}; its options: {', '.join(accepted) or '(none)'}",
                )
        for opt, problem in registry.literal_problems(fn, loss.options):
            errors.need(False, f"{key}.options.{opt}", problem)
    errors.need(d.top_k >= 0, "distill.top_k", f"must be >= 0 (0 = no top-k), got {d.top_k}")
    errors.need(
        d.rl or bool(d.losses),
        "distill.rl",
        "is false (distillation alone) but distill.losses is empty: nothing would be trained",
    )
    h = d.horizon
    if h.schedule == "none":
        return
    errors.need(
        bool(d.losses),
        "distill.horizon.schedule",
        f"is {h.schedule!r} but distill.losses is empty: the horizon cuts generation for distillation",
    )
    if h.schedule == "fixed":
        errors.need(
            (h.rho is None) != (h.tokens is None),
            "distill.horizon.rho",
            "a fixed horizon needs exactly one of distill.horizon.rho and distill.horizon.tokens",
        )
        errors.need(h.rho is None or 0 < h.rho <= 1, "distill.horizon.rho", f"must be in (0, 1], got {h.rho}")
        errors.need(
            h.tokens is None or 1 <= h.tokens <= r.max_new_tokens,
            "distill.horizon.tokens",
            f"must be in [1, rollout.max_new_tokens={r.max_new_tokens}], got {h.tokens}",
        )
    else:
        errors.need(h.h0 >= 1, "distill.horizon.h0", f"the growing horizon starts at h0 >= 1 tokens, got {h.h0}")
        errors.need(h.delta_h >= 0, "distill.horizon.delta_h", f"must be >= 0, got {h.delta_h}")
        errors.need(h.delta_k >= 1, "distill.horizon.delta_k", f"must be >= 1 (steps), got {h.delta_k}")


def check_reward(rw: RewardConfig, d: RLDataConfig, task: Task | None, errors: Errors) -> None:
    """A registered reward (or an import path) that loads now, not after the warm start, and for a
    synthetic task the one that scores it."""
    import mcore_rl.data.tasks  # noqa: F401  (registers the tasks' rewards, which reward_names() then lists)
    from mcore_rl.rewards import get_reward_fn, is_import_path, reward_names  # lazy: registries, read at validation

    errors.need(rw.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {rw.timeout_s}")
    errors.need(rw.max_concurrency >= 1, "reward.max_concurrency", f"must be >= 1, got {rw.max_concurrency}")
    path = is_import_path(rw.name)
    if not path and not need_registered(
        errors, "reward.name", "reward", rw.name, reward_names(), " (or 'package.module:function')"
    ):
        return
    try:  # imports the module, as the reward workers will
        get_reward_fn(rw.name)
    except Exception as exc:
        errors.need(False, "reward.name", f"{rw.name!r} cannot be loaded: {type(exc).__name__}: {exc}")
        return
    if not path and task is not None:
        errors.need(
            rw.name == task.reward,
            "reward.name",
            f"the synthetic task {task.name!r} is scored by {task.reward!r}, got {rw.name!r}",
        )


def check_eval(e: EvalConfig, errors: Errors) -> None:
    """Evaluation must measure something, and `eval.score` must be one of the measured numbers."""
    errors.need(e.interval >= 0, "eval.interval", f"must be >= 0, got {e.interval}")
    errors.need(e.num_prompts >= 1, "eval.num_prompts", f"must be >= 1, got {e.num_prompts}")
    errors.need(e.k >= 0, "eval.k", f"must be >= 0, got {e.k}")
    errors.need(e.greedy or e.k > 0, "eval.greedy", "is false and eval.k is 0: evaluation would measure nothing")
    errors.need(e.score != "avg@k" or e.k > 0, "eval.score", "is 'avg@k' but eval.k is 0")
    errors.need(e.score != "greedy" or e.greedy, "eval.score", "is 'greedy' but eval.greedy is false")
    errors.need(
        e.temperature is None or e.temperature > 0, "eval.temperature", f"must be null or > 0, got {e.temperature}"
    )


# Keys of `init.sft` whose setting the warm start takes from the RL run (the same key at the top level).
WARM_START_FROM_RUN = (
    "optimizer.clip_grad",
    "optimizer.backend",
    "train.seed",
    "train.precision",
    "train.recompute",
    "data.synthetic_task",
    "data.synthetic_max_digits",
    "data.tokenizer_path",
)


# the MTP draft heads' loss beside the warm start's (train/mtp_loss.py; no older flat spelling)
WARM_START_MTP_KEYS = ("train.mtp_loss", "train.mtp_loss_coeff")


def check_init(i: InitConfig, d: RLDataConfig, m: ModelConfig, errors: Errors) -> None:
    """The SFT warm start trains on the synthetic task's answers, with its own batch shape and LR; of
    `init.sft` it reads `WARM_START_KEYS`, the rest must stay at its defaults (messages name the key
    the config wrote, `init.sft_lr` or `init.sft.optimizer.lr`)."""
    w, steps = i.sft, i.key("train.train_iters")
    defaults = WarmStartConfig()
    own = set(WARM_START_KEYS.values())
    for part, section, default in (
        ("optimizer", w.optimizer, defaults.optimizer),
        ("train", w.train, defaults.train),
        ("data", w.data, defaults.data),
    ):
        for f in dataclasses.fields(section):
            path = f"{part}.{f.name}"
            if path in own or path in WARM_START_MTP_KEYS:
                continue
            errors.need(
                getattr(section, f.name) == getattr(default, f.name),
                f"init.sft.{path}",
                f"is the RL run's setting for the warm start too: set {path} instead"
                if path in WARM_START_FROM_RUN
                else "is not used by the warm start (packed, prompt-masked rows of the task's answers, one "
                "micro-batch per data-parallel rank per step, no evaluation); leave it at its default",
            )
    errors.need(w.train.train_iters >= 0, steps, f"must be >= 0, got {w.train.train_iters}")
    if w.train.train_iters <= 0:
        return
    errors.need(
        d.path is None,
        steps,
        "the SFT warm start trains on the synthetic task's answers; with data.path set, use init.checkpoint "
        "(e.g. from `mcore-rl sft`) instead",
    )
    mbs, seq = w.train.micro_batch_size, w.train.seq_length
    errors.need(mbs >= 1, i.key("train.micro_batch_size"), f"must be >= 1, got {mbs}")
    errors.need(
        1 <= seq <= m.max_position_embeddings,
        i.key("train.seq_length"),
        f"must be in [1, model.max_position_embeddings={m.max_position_embeddings}], got {seq}",
    )
    errors.need(w.optimizer.lr >= 0, i.key("optimizer.lr"), f"must be >= 0, got {w.optimizer.lr}")
    errors.need(
        w.optimizer.lr_decay_style != "step",
        i.key("optimizer.lr_decay_style"),
        "'step' is not a schedule of the warm start (constant, linear or cosine)",
    )


def teacher_name(t: TeacherConfig, i: int) -> str:
    """A teacher's name in metrics and `TeacherScores.source`."""
    return t.name or f"{t.kind}{i}"


def reference_teachers(teachers: Sequence[TeacherConfig]) -> set[int]:
    """Indices of the teachers some other teacher names as its `reference` (never routed to)."""
    named = {t.reference for t in teachers} - {None}
    return {i for i, t in enumerate(teachers) if teacher_name(t, i) in named}


def check_teachers(teachers: list[TeacherConfig], r: RolloutConfig, errors: Errors, vocab_size: int) -> None:
    """Each teacher's own settings, and routing without ambiguity: no domain claimed by two
    teachers, at most one default teacher (no `domains`); a `reference` names another engine
    teacher that is only a reference. Reachability and the tokenizer of an engine teacher are
    checked when the trainer connects to it, before training."""
    names: dict[str, int] = {}
    claimed: dict[str, int] = {}
    defaults: list[int] = []
    references = reference_teachers(teachers)
    all_names = {teacher_name(t, i): i for i, t in enumerate(teachers)}
    for i, t in enumerate(teachers):
        key = f"teachers[{i}]"
        name = teacher_name(t, i)
        errors.need(name not in names, f"{key}.name", f"{name!r} is also the name of teachers[{names.get(name)}]")
        names.setdefault(name, i)
        if t.reference is not None:
            j = all_names.get(t.reference)
            errors.need(
                t.kind == "engine",
                f"{key}.reference",
                f"only engine teachers have a reference (its engine scores their top-k ids); this one is {t.kind!r}",
            )
            errors.need(
                j is not None and j != i,
                f"{key}.reference",
                f"{t.reference!r} is not the name of another teacher (names: {', '.join(all_names)})",
            )
            if j is not None and j != i:
                ref = teachers[j]
                errors.need(
                    ref.kind == "engine",
                    f"{key}.reference",
                    f"{t.reference!r} is a {ref.kind!r} teacher; a reference is an engine teacher",
                )
                errors.need(
                    ref.reference is None,
                    f"teachers[{j}].reference",
                    f"{t.reference!r} is the reference of {name!r} and cannot have a reference itself",
                )
        if i in references:
            errors.need(
                not t.domains,
                f"{key}.domains",
                f"{name!r} is a reference teacher (named by `reference`): "
                "it scores the samples of the teacher naming it and is never routed to",
            )
            errors.need(
                t.top_k == 0,
                f"{key}.top_k",
                f"{name!r} is a reference teacher: it scores the top-k ids of "
                "the teacher naming it, its own top_k is not used",
            )
        elif not t.domains:
            defaults.append(i)
        for d in t.domains:
            errors.need(bool(d), f"{key}.domains", "holds an empty domain name")
            errors.need(
                d not in claimed,
                f"{key}.domains",
                f"domain {d!r} is also routed to teachers[{claimed.get(d)}]; a sample has one teacher",
            )
            claimed.setdefault(d, i)
        errors.need(
            0 <= t.top_k <= vocab_size, f"{key}.top_k", f"must be in [0, model.vocab_size={vocab_size}], got {t.top_k}"
        )
        if t.kind == "engine":
            check_engine_teacher(t, key, r, errors)
        else:
            for field_name, value in (("urls", t.urls), ("model_path", t.model_path)):
                errors.need(not value, f"{key}.{field_name}", f"only applies to kind 'engine' (this one is {t.kind!r})")
        if t.kind == "privileged":
            errors.need("{context}" in t.template, f"{key}.template", "must contain '{context}'")
            errors.need(
                t.context != "info" or bool(t.context_key),
                f"{key}.context_key",
                "context 'info' needs the key of Sample.info that holds the context",
            )
        if t.kind in ("frozen", "privileged"):
            zero = "a fixed copy" if t.kind == "frozen" else "the current policy"
            errors.need(
                t.refresh_interval >= 0,
                f"{key}.refresh_interval",
                f"must be >= 0 (0 = {zero}), got {t.refresh_interval}",
            )
        else:
            errors.need(
                t.refresh_interval == 0,
                f"{key}.refresh_interval",
                f"only applies to kinds 'frozen' and 'privileged' (this one is {t.kind!r})",
            )
        if t.kind == "frozen":
            errors.need(
                t.checkpoint is None or os.path.exists(t.checkpoint),
                f"{key}.checkpoint",
                f"{t.checkpoint!r} does not exist",
            )
        else:
            errors.need(
                t.checkpoint is None, f"{key}.checkpoint", f"only applies to kind 'frozen' (this one is {t.kind!r})"
            )
    errors.need(
        len(defaults) <= 1,
        "teachers",
        f"teachers {defaults} all have no domains (each would be the default); give all but one of them `domains`",
    )


def check_engine_group(
    g: EngineGroupConfig, key: str, starts: bool, errors: Errors, keys: dict[str, str] | None = None
) -> None:
    """Every group of engines (rollout, engine teachers, a recipe's engines): http(s) URLs, an HF checkpoint
    directory, and for the `mcore-rl serve` processes the trainer starts (`starts`) their count, one
    list of existing cores per engine, threads, context and slots. `keys` maps a field to its name
    under `key` (the rollout's own: `RolloutConfig.ENGINE_KEYS`)."""

    def name(f: str) -> str:
        return f"{key}.{(keys or {}).get(f, f)}"

    for j, url in enumerate(g.urls):
        errors.need(
            url.startswith(("http://", "https://")), f"{name('urls')}[{j}]", f"must be an http(s) URL, got {url!r}"
        )
    if g.model_path:
        errors.need(
            os.path.isfile(os.path.join(g.model_path, "config.json")),
            name("model_path"),
            f"{g.model_path!r} is not an HF checkpoint directory (no config.json)",
        )
    if starts or not g.urls:
        errors.need(g.num_engines >= 1, name("num_engines"), f"must be >= 1, got {g.num_engines}")
    if not starts:
        errors.need(
            not g.engine_cores,
            name("engine_cores"),
            "only applies to engines the trainer starts, not to "
            + (f"the servers of {name('urls')}" if g.urls else f"{key}'s (no engine processes)"),
        )
    else:
        errors.need(
            not g.engine_cores or len(g.engine_cores) == g.num_engines,
            name("engine_cores"),
            f"needs one entry per engine ({name('num_engines')}={g.num_engines}), got {len(g.engine_cores)}",
        )
    count = os.cpu_count() or 1
    for i, cores in enumerate(g.engine_cores if starts else []):
        errors.need(bool(cores), f"{name('engine_cores')}[{i}]", "must list at least one core")
        missing = sorted(c for c in cores if not 0 <= c < count)
        errors.need(
            not missing,
            f"{name('engine_cores')}[{i}]",
            f"cores {missing} do not exist (this machine has cores 0-{count - 1})",
        )
    errors.need(
        g.engine_threads is None or g.engine_threads >= 1,
        name("engine_threads"),
        f"must be null or >= 1, got {g.engine_threads}",
    )
    errors.need(
        g.context_length is None or g.context_length >= 2,
        name("context_length"),
        f"must be >= 2, got {g.context_length}",
    )  # None: rollout.context_length
    errors.need(
        g.max_running_requests >= 1, name("max_running_requests"), f"must be >= 1, got {g.max_running_requests}"
    )
    errors.need(g.request_timeout_s > 0, name("request_timeout_s"), f"must be > 0, got {g.request_timeout_s}")


def check_judges(judges: Sequence[JudgeConfig], errors: Errors) -> None:
    """Each judge group named once, running servers or a checkpoint to start (not both), checked as
    every engine group is. (Which rewards name them: `rl_domains.check_rewards`.)"""
    seen: dict[str, int] = {}
    for i, g in enumerate(judges):
        key = f"judges[{i}]"
        errors.need(bool(g.name), f"{key}.name", "a judge group needs a name (judge rewards name it: `judge: <name>`)")
        errors.need(g.name not in seen, f"{key}.name", f"{g.name!r} is also the name of judges[{seen.get(g.name)}]")
        seen.setdefault(g.name, i)
        errors.need(
            bool(g.urls) != bool(g.model_path),
            f"{key}.urls",
            "a judge group needs either urls (running servers) or model_path (engines the trainer starts), "
            f"got {'both' if g.urls else 'neither'}",
        )
        check_engine_group(g, key, bool(g.model_path), errors)


def check_engine_teacher(t: TeacherConfig, key: str, r: RolloutConfig, errors: Errors) -> None:
    """URLs of running servers, or a checkpoint to start engines on (not both)."""
    errors.need(
        bool(t.urls) != bool(t.model_path),
        f"{key}.urls",
        "an engine teacher needs either urls (running servers) or model_path (engines the trainer starts), "
        f"got {'both' if t.urls else 'neither'}",
    )
    check_engine_group(t, key, bool(t.model_path), errors)
    errors.need(t.max_concurrency >= 1, f"{key}.max_concurrency", f"must be >= 1, got {t.max_concurrency}")
