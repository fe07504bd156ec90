"""The typed config tree of `mcore-rl train` (RL: rollouts -> rewards -> policy update -> weight sync).

`RLConfig` reuses the SFT sections for what they share (model, parallel layout, optimizer,
checkpoints) and adds the RL-only ones. Cross-field rules are in `mcore_rl.config.rl_validate`
(`validate_rl_config`, re-exported here), which also runs the shared layout rules (parallel sizes,
heads, MoE, ...) on the shared sections, so a recipe fails before any worker starts with a message
naming the dotted key. Algorithm, reward and task names are plain strings checked there against
their registries, so registering a new one needs no schema change.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.observability import ObservabilityConfig
from mcore_rl.config.sections import Sectioned
from mcore_rl.config.schema import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SFTConfig,
    TrainConfig,
)


@dataclass
class RLTrainConfig:
    """How long to train and how the learner batches its work."""

    seed: int = 1234  # seeds weights, prompt order, sampling and the held-out draw
    num_steps: int = 100  # rollout steps (each: one rollout batch, several optimizer steps)
    seq_length: int = 128  # row length: samples are packed into rows of this many tokens
    micro_batch_size: int = 4  # rows per micro-batch
    # parameter and compute dtype of the learner (bf16 keeps fp32 master weights)
    precision: Literal["fp32", "bf16"] = "fp32"
    recompute: Literal["none", "full", "selective"] = "none"  # activation recomputation in the backward pass
    logprob_chunk_size: int | None = None  # tokens per chunk of the vocab-parallel log-probs (None = auto)


@dataclass
class RewardHeadConfig:
    """One reward of a domain: a registered reward (or "package.module:function") called as
    `fn(sample, **options)`; its value is `Sample.reward_heads[name]`, and `Sample.reward` is the
    weighted sum over the domain's heads."""

    name: str = ""  # a registered reward or package.module:function
    weight: float = 1.0  # weight of this head in Sample.reward
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the call
    # the head's name in Sample.reward_heads (None: `name`), so a domain can hold one reward twice (two RMs)
    key: str | None = None


@dataclass
class DomainEvalConfig:
    """A domain's held-out set: a file, or the domain's task / reasoning-gym generator drawn with
    another seed. Never overlapping the domain's training prompts (those are removed from training;
    a file domain without an eval file holds out part of its own file)."""

    path: str | None = None  # .jsonl / .parquet of held-out prompts (same keys as the domain's file)
    num_prompts: int | None = None  # None = eval.num_prompts
    seed: int | None = None  # task / reasoning-gym seed of the held-out set (None = train.seed + an offset)
    # a completion counts as right when its reward is >= this (None = eval.correct_threshold); set it
    # for a domain scored on another scale (a reward model, a judge's 0-9, partial credit)
    correct_threshold: float | None = None


@dataclass
class SkillsConfig:
    """A skill library (`mcore_rl.envs.skills`; `tools/trace2skill.py` writes one) whose k skills for
    each episode's start state go before its first message (Trace2Skill) or, as `privileged/skills`,
    only into a self-teacher's context (SDAR: `teachers: [{kind: privileged, context: info,
    context_key: privileged/skills}]`)."""

    path: str = ""  # the library: one skill a line, {"section", "situation", "lesson", "support"}
    k: int = 3  # skills per episode (retrieval "full": all)
    into: Literal["prompt", "privileged"] = "prompt"  # where they go: the policy's prompt, or the teacher's context
    # similar: nearest situations; ucb: a bandit over the skills on the episodes' returns; random; full
    retrieval: Literal["similar", "ucb", "random", "full"] = "similar"
    ucb_c: float = 1.0  # retrieval ucb: the exploration weight c of mean + c * sqrt(ln N / n)


@dataclass
class AnalyzerConfig:
    """SEED's analyzer (`mcore_rl.agent.hindsight`): after each group, the engines that played it write
    one lesson per episode from its transcript, given to the episode's samples as
    `privileged/hindsight_skill` for a self-teacher (`teachers: [{kind: privileged, context: info,
    context_key: privileged/hindsight_skill}]`); its tokens are not trained."""

    max_new_tokens: int = 96  # the lesson's token budget
    temperature: float = 0.0  # the analysis's sampling temperature (0: greedy)
    instruction: str = ""  # what the analyzer is told before the transcript ("": agent.hindsight's default)
    max_transcript_chars: int = 4000  # a longer transcript keeps its head and tail


@dataclass
class EnvironmentConfig:
    """A domain's interactive environment (`mcore_rl.envs`, run by `mcore_rl.agent`): each prompt of
    the domain starts a group of episodes from one seeded state; the episode's return is the reward."""

    name: str = ""  # a registered environment (mcore_rl.envs: make_env); its prompts are the domain's
    options: dict[str, Any] = field(default_factory=dict)  # the environment's options (its options dataclass)
    tool_format: str = "none"  # "none" (plain text turns) or a tool-call format of the model's family ("hermes", ...)
    max_turns: int = 8  # model turns per episode
    max_tokens_per_turn: int = 64  # new tokens of one model turn (the episode's budget: the domain's max_new_tokens)
    max_invalid_calls: int = 3  # consecutive invalid turns (bad tool calls, invalid actions) that end the episode
    invalid_penalty: float = 0.0  # subtracted from the episode's return per invalid turn
    trajectory: Literal["conversation", "stepwise"] = "conversation"  # a sample per episode, or per model turn
    memory_k: int = 2  # stepwise: the previous steps each step's prompt shows
    template_policy: Literal["keep", "split"] = "keep"  # a chat template that is not append-only (Qwen3)
    step_timeout_s: float = 30.0  # one reset / step / close of the environment (then the episode is lost)
    max_observation_chars: int = 8192  # one step's messages together, cut from truncate_side
    truncate_side: Literal["left", "right", "middle"] = "right"  # which end of an over-long observation is cut
    skills: SkillsConfig | None = None  # a skill library retrieved into each episode (Trace2Skill, SDAR)
    analyzer: AnalyzerConfig | None = None  # the policy writes each episode's hindsight skill (SEED)
    # [open, close]: distillation acts only on the model's tokens inside these tags, e.g. StepOPSD's
    # ["<action>", "</action>"]; the rest of a reply keeps its RL advantage ([]: the whole reply)
    distill_span_tags: list[str] = field(default_factory=list)


@dataclass
class AgentConfig:
    """An unmodified agent program (`mcore_rl.agent.programs`): one child process per episode, given
    its episode's OpenAI base URL on the episode proxy and the task on stdin; its stdout is the final
    answer, scored by the domain's rewards (never by the agent)."""

    command: list[str] = field(default_factory=list)  # argv, e.g. [python, my_agent.py] (cwd: the run's)
    tool_format: str = "none"  # tool-call format the proxy renders and parses `tools` in ("hermes", ...)
    timeout_s: float = 120.0  # one episode; then its process group is killed and the episode lost
    max_completions: int = 16  # chat completions per episode (one more loses it)
    max_parallel: int = 16  # agent processes running at once (all domains' groups together)
    model_name: str = "policy"  # OPENAI_MODEL, and the name the proxy answers with
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables of the agent


@dataclass
class DomainConfig:
    """One dataset of a multi-domain run: a source (exactly one of path, task, reasoning_gym), how
    its prompts are rendered, how they are scored and sampled, and its share of the mixture."""

    name: str = ""  # the domain's name, in metrics (reward/<name>/mean) and Prompt.domain
    path: str | None = None  # .jsonl or .parquet on local disk (prompt_key, label_key; optional max_new_tokens)
    task: str | None = None  # a task registered in mcore_rl.data.tasks
    reasoning_gym: str | None = None  # a reasoning-gym dataset name (reasoning-gym==0.1.25)
    options: dict[str, Any] = field(default_factory=dict)  # the task's / reasoning-gym dataset's options
    num_prompts: int = 1000  # size of a task / reasoning-gym training pool
    prompt_key: str = "prompt"  # file domains: the prompt field
    label_key: str = "label"  # file domains: the answer field the reward sees
    template: str | None = None  # format string with {prompt} (the reward still sees the raw prompt)
    chat_template: bool = False  # render with the tokenizer's chat template (a Hugging Face tokenizer)
    system_prompt: str | None = None  # with chat_template: a system message first
    rewards: list[RewardHeadConfig] = field(default_factory=list)  # [] = the task's reward (files: reward.name)
    top_p: float | None = None  # None = rollout.top_p
    top_k: int | None = None  # None = rollout.top_k
    max_new_tokens: int | None = None  # None = rollout.max_new_tokens (its cap)
    group_size: int | None = None  # None = rollout.group_size
    weight: float = 1.0  # mixture weight (normalised over the domains)
    eval: DomainEvalConfig = field(default_factory=DomainEvalConfig)
    # multi-turn: the domain's prompts start episodes of this environment (its own prompts: no other source)
    environment: EnvironmentConfig | None = None
    # an unmodified agent program per episode (the domain's prompts and rewards are its task's)
    agent: AgentConfig | None = None


@dataclass
class MixtureStageConfig(Sectioned):
    """A stage of a staged schedule (sequential stages, rising temperatures, a refresh): from
    `start_step` on, these weights (and optionally a sampling temperature and response budget)."""

    start_step: int = 0  # the first rollout step of the stage
    weights: dict[str, float] = field(default_factory=dict)  # domain -> weight; {} = the domains' weights
    temperature: float | None = None  # the stage's sampling temperature (all domains); None = rollout.temperature
    max_new_tokens: int | None = None  # multi-stage response length (a cap on the domains' budgets)
    drop_solved_above: float | None = None  # entering the stage, drop prompts whose accuracy > this


@dataclass
class MixtureConfig:
    """How the domains share the prompts of a step: deterministic interleaving (each domain gets
    its share to within one prompt at every point of the stream) or seeded random draws."""

    # interleave: every domain within one prompt of its share; random: seeded draws
    sampling: Literal["interleave", "random"] = "interleave"
    stages: list[MixtureStageConfig] = field(default_factory=list)  # [] = the domains' fixed weights


@dataclass
class RLDataConfig:
    """Where prompts come from: a jsonl file (`prompt` + `label`), a registered synthetic task, or
    several domains (`domains`, mixed by `mixture`)."""

    path: str | None = None  # .jsonl with prompt_key / label_key; None = synthetic
    prompt_key: str = "prompt"  # data.path: the prompt field
    label_key: str = "label"  # data.path: the answer field the reward sees
    on_bad_line: Literal["skip", "error"] = "error"  # a bad line of data.path / eval.path: skip (logged) or stop
    synthetic_task: str = "addition"  # a task registered in mcore_rl.data.tasks
    synthetic_max_digits: int = 2  # addition operands have up to this many digits
    synthetic_num_prompts: int = 100_000  # size of the synthetic training pool
    tokenizer_path: str | None = None  # None = the bundled byte-level tokenizer
    add_bos: bool = True  # prompt ids start with the tokenizer's bos (as SFT rows do)
    domains: list[DomainConfig] = field(default_factory=list)  # [] = one domain: data.path or data.synthetic_task
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    # the online filter of solved prompts (one data source): entering each rollout.temperature_stages stage, drop the
    # prompts whose last observed accuracy is > this (0.9 itself kept); None = off
    drop_solved_above: float | None = None


@dataclass
class TemperatureStageConfig:
    """From training step `start_step` on, the rollouts sample at `temperature`."""

    start_step: int = 0  # the first training step at this temperature
    temperature: float = 1.0  # sampling temperature of the rollouts from then on


@dataclass
class EngineGroupConfig:
    """A group of inference engines: the one set of settings of engine teachers (`teachers[i]`),
    a recipe's engines (registered sections) and, under its own key names, the rollout engines
    (`RolloutConfig.engines`); one function validates them all (`rl_validate.check_engine_group`).

    The engines are the running SGLang / `mcore-rl serve` servers at `urls`, or `num_engines`
    `mcore-rl serve` processes the trainer starts on the HF checkpoint `model_path`; the `engine_*`,
    `quantization`, `context_length` and `max_running_requests` settings are those processes'.
    """

    urls: list[str] = field(default_factory=list)  # running SGLang / `mcore-rl serve` servers
    model_path: str | None = None  # or: start `mcore-rl serve` processes on this HF checkpoint
    num_engines: int = 1  # with model_path
    engine_cores: list[list[int]] = field(default_factory=list)  # CPU cores of each started engine ([] = all)
    engine_threads: int | None = None  # torch threads of each started engine (None = its default)
    quantization: Literal["fp8", "bf16", "none"] = "none"  # started engines
    context_length: int | None = None  # started engines; None = rollout.context_length
    max_running_requests: int = 64  # started engines: continuous-batching slots
    request_timeout_s: float = 600.0  # every request to these engines
    api_key: str | None = None  # sent as `Authorization: Bearer` (the servers' --api-key)


@dataclass
class JudgeConfig(EngineGroupConfig):
    """A group of judge servers, by name: a judge reward's option `judge: <name>` sends its calls to
    them (round-robin, the next one when one cannot be reached) instead of to one `url`. The servers
    at `urls`, or `num_engines` `mcore-rl serve` processes the trainer starts on the HF checkpoint
    `model_path` and stops with the run. Judges are asked with text (SGLang's `/generate`), so
    their tokenizer is their own."""

    name: str = ""  # what judge rewards' `judge` option names


@dataclass
class RolloutConfig(Sectioned):
    """Engines, sampling and batch shape of the rollouts."""

    engine_urls: list[str] = field(default_factory=list)  # SGLang / `mcore-rl serve` URLs; [] = embedded
    # the engines' server: "sglang" (SGLang's protocol: SGLang, `mcore-rl serve`, embedded) or "vllm"
    # (vLLM servers at engine_urls, else num_embedded_engines vLLM processes the trainer starts)
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    vllm_python: str | None = None  # engine_kind vllm: its venv's python (None: $MCORE_RL_VLLM_VENV, .vllm-venv)
    num_embedded_engines: int = 1  # with engine_urls empty: embedded engines (in-process, or started processes)
    quantization: Literal["fp8", "bf16", "none"] = "none"  # engine weights: FP8 blocks, bf16, or fp32
    group_size: int = 8  # G samples per prompt
    prompts_per_step: int = 16  # prompts per rollout step (each sampled group_size times)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = -1  # top-k sampling (-1 = off)
    max_new_tokens: int = 64  # response budget in tokens
    # ---- runtime: synchronous (generate, train, sync) or the asynchronous actor-learner
    runtime: Literal["sync", "async"] = "sync"
    max_staleness: int = 0  # versions a sample may lag behind the weights it is trained with (async)
    placement: Literal["disaggregated", "colocated"] = (
        "disaggregated"  # colocated: engines release memory while training
    )
    engine_processes: bool | None = None  # start `mcore-rl serve` processes (None: when async without engine_urls)
    engine_cores: list[list[int]] = field(default_factory=list)  # CPU cores of each started engine ([] = all)
    engine_devices: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES of each started engine
    engine_threads: int | None = None  # torch threads of each started engine (None = its default)
    restart_engines: bool = True  # restart a started engine that died (it gets the weights before serving)
    health_check_interval_s: float = 5.0  # how often dead engines are probed (and started ones restarted)
    engine_startup_timeout_s: float = 300.0  # a started engine must answer /health within this
    max_inflight_requests: int = 0  # async: requests in flight at once (0 = engines x max_running_requests)
    buffer_groups: int = (
        0  # async: finished + in-flight groups held at most (0 = (max_staleness + 1) x prompts_per_step)
    )
    # a group whose oldest token is > max_staleness versions old at batch time: drop, regenerate (at most
    # max_regenerations times, then drop), or keep (trust the submission gate, as AReaL does)
    stale_policy: Literal["drop", "regenerate", "keep"] = "drop"
    max_regenerations: int = 2  # stale_policy=regenerate: attempts before a group is dropped
    pause_mode: Literal["abort", "in_place", "retract"] = "abort"  # how engines pause for a weight sync
    partial_rollouts: bool = True  # continue requests a sync interrupted (else start them again)
    no_engine_timeout_s: float = 120.0  # async: stop with an error after this long without any engine
    max_running_requests: int = 256  # embedded engine: continuous-batching slots
    context_length: int = 1024  # embedded engine
    sync_transport: Literal["tensor", "disk", "distributed"] = "tensor"  # for engine_urls; vllm: disk, distributed
    sync_dir: str | None = None  # disk transport: a directory the engines can read
    sync_bucket_mb: int = 512  # weight-sync bucket size (tensors are packed into buckets of this many MB)
    request_timeout_s: float = 600.0  # a generation request to an engine
    control_timeout_s: float = 30.0  # pause, continue, health, versions, checksums: a frozen engine costs this
    weight_update_timeout_s: float = 120.0  # one weight-update request (a bucket, or a checkpoint from disk)
    api_key: str | None = None  # sent as `Authorization: Bearer` (the servers' --api-key)
    admin_api_key: str | None = None  # for weight/control endpoints (--admin-api-key); default api_key
    # ---- sampling-mask replay: the engine returns the kept token set of every sampled position
    # (SGLang's return_sampling_mask), μ is the log-prob under that renormalised distribution, and the
    # learner renormalises π_old, π_θ, π_ref and the entropy over the same set (needs top_p < 1 or top_k > 0)
    sampling_mask_replay: bool = False
    # ---- exact speculative decoding in the engines this trainer builds (embedded or started `mcore-rl
    # serve`; docs/speculative.md): the tokens, μ, masks and experts stay the policy's, only faster
    # prompt lookup, a draft model, or the policy's own MTP heads (model.mtp_num_layers), synced with it
    # (eagle, eagle3: SGLang engine nodes of a cluster launch only, config/speculative.py)
    speculative_algorithm: Literal["none", "ngram", "standalone", "nextn", "eagle", "eagle3"] = "none"
    speculative_num_steps: int = 4  # tokens drafted per verification
    speculative_eagle_topk: int = 1  # SGLang's draft tree: branches per step (1: a chain, the embedded engine's)
    speculative_num_draft_tokens: int | None = None  # SGLang: tokens per verification; None = num_steps + 1
    speculative_draft_model_path: str | None = None  # standalone: HF directory, the policy's tokenizer; fixed weights
    # how many drafts a pass verifies: all (fixed) or DSpark's per-request lengths from the drafts'
    # confidence and the measured pass time at the batch size (rollout/engine/spec_schedule.py)
    speculative_schedule: Literal["fixed", "dspark"] = "fixed"
    # dspark: DSpark's trained confidence head (a JSON of tools/train_confidence_head.py) in place of each
    # request's acceptance so far (rollout/engine/spec_confidence.py); None = the acceptance so far
    speculative_confidence_head: str | None = None
    # ---- a staged sampling temperature (one data source; data.mixture.stages with domains)
    temperature_stages: list[TemperatureStageConfig] = field(default_factory=list)  # [] = rollout.temperature
    # (the recipes' sections under rollout are registered by the recipes: config/sections.py)

    # the rollout's engine settings under their own key names (the keys of every recipe since the
    # first): EngineGroupConfig field -> rollout key. The rollout engines run the policy's weights,
    # so the group has no model_path.
    ENGINE_KEYS: ClassVar[dict[str, str]] = {
        "urls": "engine_urls",
        "num_engines": "num_embedded_engines",
        "engine_cores": "engine_cores",
        "engine_threads": "engine_threads",
        "quantization": "quantization",
        "context_length": "context_length",
        "max_running_requests": "max_running_requests",
        "request_timeout_s": "request_timeout_s",
        "api_key": "api_key",
    }

    @property
    def engines(self) -> EngineGroupConfig:
        """The rollout engines as an engine group (a copy: set the rollout's own keys)."""
        return EngineGroupConfig(**{f: copy.copy(getattr(self, k)) for f, k in self.ENGINE_KEYS.items()})


@dataclass
class MismatchCorrectionConfig(Sectioned):
    """Train-inference mismatch correction with the engine's log-probs μ (`mcore_rl.algos.mismatch`).

    name: a registered correction (`mcore_rl.algos.names("mismatch")`): none | tis | mis | icepop |
    seq_tis | seq_mis | seq_mask_tis | slime_mis | a recipe's.
    Unset (null) parameters keep the preset's defaults (TIS C=2, MIS/IcePop bounds [0.5, 5]).
    """

    name: str = "tis"  # registered in mcore_rl.algos as a "mismatch" correction
    # token, sequence or geometric ratio; None = the preset's
    level: Literal["token", "sequence", "geometric"] | None = None
    clip_low: float | None = None  # TIS lower truncation
    clip_high: float | None = None  # TIS truncation C (or the registered correction's w_max)
    mask_low: float | None = None  # MIS / IcePop / rejection bounds
    mask_high: float | None = None  # MIS / IcePop / rejection upper bound
    veto_threshold: float | None = None  # veto a sequence with any token ratio below this
    batch_normalize: bool | None = None  # normalise the weights to mean 1 over the batch; None = the preset's


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts."""

    enabled: bool = False  # drop constant-reward groups and draw more prompts (DAPO)
    max_rounds: int = 4  # sampling rounds per step at most
    max_oversample: float = 4.0  # prompts drawn per step at most, as a multiple of prompts_per_step
    std_tolerance: float = 1e-6  # a group whose reward std is <= this counts as constant (dropped)


@dataclass
class RewardShapingConfig:
    """One registered step of the advantage pipeline (`mcore_rl.algos.multi_reward`): its name, its
    keyword options, and the domains (`Prompt.domain`) whose samples it changes ([] = all). Used by
    `reward_shaping` (kind "reward_shaping": rewards -> rewards), `sample_filters` (kind
    "sample_filter": which samples the batch trains on) and `advantage_shaping` (kind
    "advantage_shaping": per-token advantages -> per-token advantages)."""

    name: str = ""  # a registered step of this kind
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the step
    domains: list[str] = field(default_factory=list)  # domains whose samples it changes ([] = all)


@dataclass
class AuxLossConfig:
    """One extra loss term (kind "aux_loss", e.g. VIMPO's value loss): added as coef x its sum to the
    policy loss of every micro-batch, with the same aggregation."""

    name: str = ""  # a registered aux_loss
    coef: float = 1.0  # weight of the term in the loss
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the term


@dataclass
class CriticConfig:
    """The value model of an advantage that reads a critic (`gae`, `steppo`; `train/critic.py`): the
    policy's decoder with a scalar value head in place of the output layer, its own AdamW, trained on
    every mini-batch the policy is, on the estimator's returns (PPO's clipped value loss)."""

    # a megatron checkpoint of a value model with one head (`mcore-rl rm-train`'s); null: the policy's
    # starting weights (after init.checkpoint and the warm start) under a fresh head
    init_checkpoint: str | None = None
    lr: float | None = None  # the critic's peak learning rate (the rest is optimizer.*'s); null: optimizer.lr
    value_clip: float | None = 0.2  # ε of the value clip around the values the advantages used; null: unclipped
    loss_coef: float = 0.5  # c in c·max((V − R)², (V_clip − R)²): scales the critic's gradient only
    warmup_steps: int = 0  # the first rollout steps train the critic alone (the policy does not step)


@dataclass
class AlgorithmConfig:
    advantage: str = "grpo"  # registered in mcore_rl.algos as an "advantage"
    advantage_std_normalize: bool = True  # grpo only
    advantage_options: dict[str, Any] = field(default_factory=dict)  # the estimator's options (golongrl: alpha, ...)
    # the advantage pipeline, in this order: sample_filters (drop samples from the batch and their
    # groups' statistics) -> reward_shaping -> advantage -> advantage_shaping (per token) -> mismatch
    sample_filters: list[RewardShapingConfig] = field(default_factory=list)
    reward_shaping: list[RewardShapingConfig] = field(default_factory=list)  # applied in order, before the advantage
    advantage_shaping: list[RewardShapingConfig] = field(default_factory=list)  # applied in order, after it
    aux_losses: list[AuxLossConfig] = field(default_factory=list)  # added to the policy loss
    # MTP draft heads (model.mtp_num_layers) co-trained on the rollout's tokens with this weight on their
    # loss (train/mtp_loss.py; the policy's gradient is unchanged); 0 = frozen where the warm start left them
    mtp_heads_coeff: float = 0.0
    mtp_heads_loss: Literal["tv", "ce"] = "tv"  # Bebop's total variation, or the soft cross-entropy
    domain_advantage_weights: dict[str, float] = field(default_factory=dict)  # CGPO's ρ per domain (unlisted: 1)
    policy_loss: str = "ppo_clip"  # registered in mcore_rl.algos as a "policy_loss"
    policy_loss_options: dict[str, Any] = field(default_factory=dict)  # the loss's keyword-only options
    clip_low: float = 0.2  # PPO ratio clip below 1: 1 - clip_low
    clip_high: float = 0.2  # > clip_low: DAPO clip-higher
    dual_clip: float | None = None  # dual-clip bound c for negative advantages (None = off)
    # how token losses become one number: over all tokens, or per sequence first
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    kl_coef: float = 0.0  # 0 = no reference model (unless reference_model: true)
    reference_model: bool | None = None  # keep π_ref (null: when kl_coef > 0); true for steps that read ref_logp
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # estimator of KL(π_θ || π_ref)
    kl_in_reward: bool = False  # True: r - β·KL (per sequence) instead of a loss term
    entropy_coef: float = 0.0  # entropy bonus weight (0 = off)
    num_minibatches: int = 1  # optimizer steps per rollout batch (per epoch)
    ppo_epochs: int = 1  # passes over each rollout batch
    drop_reward_errors: bool = True  # samples whose reward function failed get no loss and leave the group statistics
    mismatch: MismatchCorrectionConfig = field(default_factory=MismatchCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    # MoE routing replay (train/routing_replay.py): "r3" replays the engine's routed experts in the
    # π_old recompute and every training forward; "r2" records the π_old recompute's routing and
    # replays it in the training forwards of the same batch; "none" routes naturally everywhere
    routing_replay: Literal["none", "r3", "r2"] = "none"
    # the value model an advantage that reads a critic trains (`gae`, `steppo`); unused otherwise
    critic: CriticConfig = field(default_factory=CriticConfig)

    def uses_reference(self) -> bool:
        """Whether the learner keeps π_ref (a frozen copy of the starting weights)."""
        return self.kl_coef > 0 if self.reference_model is None else bool(self.reference_model)


@dataclass
class DistillLossConfig:
    """One distillation term: a function registered as kind "distill" (`mcore_rl.algos.names("distill")`)."""

    name: str = ""  # a registered distill term
    coef: float | None = None  # x token advantage / x loss; null: the term's own default (@default_coef, else 1)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the function


@dataclass
class DistillHorizonConfig:
    """Generate and distil only the first H response tokens (POPD: growing H, TOPD: fixed H)."""

    # none = whole responses; fixed = H tokens (TOPD); growing = H grows with the step (POPD)
    schedule: Literal["none", "fixed", "growing"] = "none"
    rho: float | None = None  # fixed: H = floor(rho x rollout.max_new_tokens) ...
    tokens: int | None = None  # ... or H in tokens
    h0: int = 0  # growing: H_k = min(rollout.max_new_tokens, h0 + delta_h x floor(k / delta_k))
    delta_h: int = 0  # growing: tokens added to H per growth
    delta_k: int = 1  # growing: rollout steps between growths
    domains: list[str] = field(default_factory=list)  # prompts of these domains only ([] = every prompt)


@dataclass
class DistillConfig(Sectioned):
    """On-policy distillation from the teacher scores on each sample (`Sample.teacher`).

    Each entry of `losses` is looked up in the registry; advantage-phase terms are added to the
    token advantages, loss-phase terms to the loss. `rl: false` trains on distillation alone (the
    RL advantage is zero and only distilled tokens count); `rl: true` adds it to the RL objective.
    Samples without teacher scores (or whose teacher failed) are not distilled."""

    # the distillation terms (kind distill), each with its coefficient and options
    losses: list[DistillLossConfig] = field(default_factory=list)
    rl: bool = True  # false: distillation alone (no RL advantage)
    top_k: int = 0  # teacher top-k entries read per position (0: none; the student's log-probs of those ids too)
    horizon: DistillHorizonConfig = field(default_factory=DistillHorizonConfig)


@dataclass
class RewardConfig:
    name: str = "addition"  # registered in mcore_rl.rewards ("addition", "math", ...) or "package.module:function"
    timeout_s: float = 30.0  # a call past this has its worker killed; the sample gets error_reward
    error_reward: float = 0.0  # reward of a sample whose reward call failed
    max_concurrency: int = 16  # reward worker processes


@dataclass
class EvalConfig:
    """Held-out evaluation through the engine (what the inference policy scores)."""

    interval: int = 10  # rollout steps; 0 = only before and after training
    num_prompts: int = 200  # held-out prompts per evaluation
    path: str | None = None  # jsonl of held-out prompts; None = synthetic, drawn with another seed
    k: int = 4  # samples per prompt for avg@k / pass@k (0 = greedy only)
    greedy: bool = True  # also score greedy decoding (greedy_pass@1)
    temperature: float | None = None  # sampled eval; None = rollout.temperature
    score: Literal["greedy", "avg@k"] = "greedy"  # which one is `eval/score`
    at_start: bool = True  # evaluate before the first step
    # pass@k / greedy_pass@1 count a completion as right when its reward is >= this (1 for 0/1 verifiers;
    # a domain can set its own: data.domains[i].eval.correct_threshold)
    correct_threshold: float = 1.0


@dataclass
class WarmStartConfig:
    """The SFT warm start's settings in `mcore-rl sft`'s own types; of these keys it reads those of
    `WARM_START_KEYS` and takes the rest from the RL run (`sft_view`), so they stay at their defaults."""

    # its own AdamW and schedule (the RL optimizer starts fresh after it): lr, min_lr, lr_warmup_iters,
    # lr_decay_style (clip_grad and backend are the RL optimizer's)
    optimizer: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(lr=3e-3, min_lr=3e-5, lr_warmup_iters=10, lr_decay_style="cosine")
    )
    # train_iters: SFT steps on the task's prompt/answer pairs (0 = no warm start); seq_length and
    # micro_batch_size: its rows (seed, precision and recompute are the run's train.*)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(train_iters=0, seq_length=64, micro_batch_size=8))
    # synthetic_num_examples: examples drawn from the task (the synthetic task, or every task domain)
    data: DataConfig = field(default_factory=lambda: DataConfig(synthetic_num_examples=8192))


# The older, flat spelling of the warm start's settings -> their key under `init.sft` (both read; a
# config that sets a setting both ways is refused). They are also every key the warm start reads there.
WARM_START_KEYS: dict[str, str] = {
    "sft_steps": "train.train_iters",
    "sft_lr": "optimizer.lr",
    "sft_min_lr": "optimizer.min_lr",
    "sft_warmup_steps": "optimizer.lr_warmup_iters",
    "sft_lr_decay_style": "optimizer.lr_decay_style",
    "sft_micro_batch_size": "train.micro_batch_size",
    "sft_seq_length": "train.seq_length",
    "sft_num_examples": "data.synthetic_num_examples",
}


@dataclass
class InitConfig:
    """Where the policy starts: a checkpoint (model weights only), then optionally SFT on the task."""

    checkpoint: str | None = None  # megatron dist-checkpoint (e.g. from `mcore-rl convert`)
    # the SFT warm start on the task's prompt/answer pairs (the synthetic task, or every task domain); it
    # reads train.train_iters, seq_length, micro_batch_size, optimizer.lr, min_lr, lr_warmup_iters,
    # lr_decay_style and data.synthetic_num_examples; every other key below is the run's or unused and
    # stays at its default
    sft: WarmStartConfig = field(default_factory=WarmStartConfig)
    sft_steps: int | None = None  # deprecated spelling of init.sft.train.train_iters
    sft_lr: float | None = None  # deprecated spelling of init.sft.optimizer.lr
    sft_min_lr: float | None = None  # deprecated spelling of init.sft.optimizer.min_lr
    sft_warmup_steps: int | None = None  # deprecated spelling of init.sft.optimizer.lr_warmup_iters
    # deprecated spelling of init.sft.optimizer.lr_decay_style
    sft_lr_decay_style: Literal["constant", "linear", "cosine"] | None = None
    sft_micro_batch_size: int | None = None  # deprecated spelling of init.sft.train.micro_batch_size
    sft_seq_length: int | None = None  # deprecated spelling of init.sft.train.seq_length
    sft_num_examples: int | None = None  # deprecated spelling of init.sft.data.synthetic_num_examples

    def __post_init__(self) -> None:
        """Moves each flat `sft_*` key that is set onto `sft` (remembering the spelling for messages,
        `key`); a setting written both ways is refused, naming both keys."""
        self._spelled: dict[str, str] = {}
        given = {flat: getattr(self, flat) for flat in WARM_START_KEYS if getattr(self, flat) is not None}
        if not given:
            return
        self.sft, defaults = copy.deepcopy(self.sft), WarmStartConfig()
        for flat, value in given.items():
            part, name = WARM_START_KEYS[flat].split(".")
            target = getattr(self.sft, part)
            if getattr(target, name) != getattr(getattr(defaults, part), name):
                raise ConfigError(
                    f"init.{flat} and init.sft.{part}.{name} both set the warm start's {name}; keep "
                    f"init.sft.{part}.{name} (init.{flat} is its older spelling)"
                )
            setattr(target, name, value)
            setattr(self, flat, None)
            self._spelled[f"{part}.{name}"] = f"init.{flat}"

    def key(self, path: str) -> str:
        """The dotted key this config wrote the warm start's setting `path` (`optimizer.lr`) with:
        `init.sft_lr` or `init.sft.optimizer.lr`, for messages."""
        return self._spelled.get(path, f"init.sft.{path}")


@dataclass
class LoggingConfig(ObservabilityConfig):  # observability: sinks, MFU peak, profiles (config/observability.py)
    tensorboard: bool = True  # run_dir/tensorboard (on by default for RL)
    progress_bar: bool = True  # one rank-0 progress bar per phase
    plot: bool = True  # curves.png in run_dir at the end
    print_interval: int = 0  # print a metrics line every N rollout steps (0 = progress bar only)


@dataclass
class TeacherConfig(EngineGroupConfig):
    """One teacher of on-policy distillation; it fills `Sample.teacher` of the samples routed to it.

    kind: "engine" (a separate engine scores the student's tokens through SGLang's prompt-scoring
    API: the servers of `urls`, or `num_engines` `mcore-rl serve` processes the trainer starts on
    the HF checkpoint `model_path`), "privileged" (the policy itself, the same weights, with
    privileged context put before the prompt: the correct answer, a peer's successful response,
    or a field of the sample's info such as a retrieved skill; with `refresh_interval` N, a copy of
    the policy taken every N rollout steps), "frozen" (an older copy of the
    student, like the KL's reference model: taken at the start, or from `checkpoint`, and taken
    again every `refresh_interval` rollout steps). Routing (UI-MOPD): a sample goes to the teacher
    whose `domains` list its domain, else to the one teacher with no `domains`, else to none.

    `reference` (engine teachers): the name of another engine teacher holding this teacher's
    starting point π_Tref (its weights before RL; Direct-OPD distils the shift log π_T - log π_Tref).
    For every sample this teacher scores, the reference scores the same tokens (`ref_logp`) and the
    log-probs of this teacher's top-k ids (`ref_topk_logp`, through SGLang's `token_ids_logprob`).
    A teacher named as a reference is only that: never routed to, no `domains`, no `top_k`.
    """

    name: str = ""  # in metrics and TeacherScores.source; "" = "<kind><index>"
    kind: Literal["engine", "privileged", "frozen"] = "engine"  # who scores: see the class docstring
    domains: list[str] = field(default_factory=list)  # [] = every domain no other teacher claims
    top_k: int = 0  # engine: also the teacher's k most likely tokens per position (0 = sampled token only)
    reference: str | None = None  # engine: name of the engine teacher that is this one's π_Tref (Direct-OPD)
    # ---- engine: the engine group's settings (urls or model_path, ...), and
    request_timeout_s: float = 120.0  # (the group's field, a shorter default: scoring is one forward)
    max_concurrency: int = 64  # scoring requests in flight to this teacher
    # ---- privileged
    # what the teacher sees that the student does not; peer_episode: a successful peer episode's turns (StepOPSD)
    context: Literal["answer", "peer", "peer_episode", "info"] = "answer"
    context_key: str = "skill"  # context=info: the key of Sample.info that holds it
    template: str = "Reference solution: {context}\n"  # put before the prompt (after a leading bos)
    peer_min_reward: float = 1.0  # context=peer / peer_episode: a peer of the group with at least this reward
    # ---- frozen and privileged: rollout steps between new copies of the student; frozen: 0 = one fixed copy;
    # privileged: 0 = the current policy, N = a copy taken every N steps (StepOPSD's stale teacher)
    refresh_interval: int = 0
    checkpoint: str | None = None  # frozen: a megatron checkpoint to take the (first) copy from


@dataclass
class RLConfig:
    """Root of `mcore-rl train` recipes."""

    run_dir: str = "runs/rl"  # metrics.jsonl, accounting.json, plots and logs of the run
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4, lr_decay_style="constant"))
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    init: InitConfig = field(default_factory=InitConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    teachers: list[TeacherConfig] = field(default_factory=list)  # on-policy distillation: who fills Sample.teacher
    judges: list[JudgeConfig] = field(default_factory=list)  # judge servers that judge rewards name (`judge: <name>`)

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.algorithm.num_minibatches * self.algorithm.ppo_epochs

    def sft_view(self, world_size: int) -> SFTConfig:
        """`init.sft` with what the warm start shares with the run, as an `SFTConfig` (validation does
        not use it): the RL optimizer's clipping and backend, the run's seed, precision, recompute,
        task and tokenizer, one micro-batch per data-parallel rank per step, no evaluation."""
        t, w = self.train, self.init.sft
        mp = (
            self.parallel.tensor_model_parallel_size
            * self.parallel.pipeline_model_parallel_size
            * self.parallel.context_parallel_size
        )
        dp = world_size // mp if mp > 0 and world_size % mp == 0 else 1
        return SFTConfig(
            run_dir=self.run_dir,
            model=self.model,
            parallel=self.parallel,
            optimizer=dataclasses.replace(
                w.optimizer,
                min_lr=min(w.optimizer.min_lr, w.optimizer.lr),
                clip_grad=self.optimizer.clip_grad,
                backend=self.optimizer.backend,
            ),
            data=dataclasses.replace(
                w.data,
                synthetic_task=self.data.synthetic_task,
                synthetic_max_digits=self.data.synthetic_max_digits,
                tokenizer_path=self.data.tokenizer_path,
            ),
            train=dataclasses.replace(
                w.train,
                seed=t.seed,
                global_batch_size=w.train.micro_batch_size * max(dp, 1),
                precision=t.precision,
                recompute=t.recompute,
                eval_interval=0,
            ),
        )
