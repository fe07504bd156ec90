"""The typed config tree of `mcore-rl train` (RL: rollouts -> rewards -> policy update -> weight sync).

`RLConfig` reuses the SFT sections for what they share (model, parallel layout, optimizer,
checkpoints) and adds the RL-only ones. Cross-field rules are in `validate_rl_config`, which also
runs the SFT layout rules (parallel sizes, heads, MoE, ...) on the shared sections, so a recipe
fails before any worker starts with a message naming the dotted key.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional

from mcore_rl.config.errors import ConfigError
from mcore_rl.config.schema import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SFTConfig,
    TrainConfig,
)
from mcore_rl.config.validate import DerivedSizes, validate_sft_config


@dataclass
class RLTrainConfig:
    """How long to train and how the learner batches its work."""

    seed: int = 1234
    num_steps: int = 100  # rollout steps (each: one rollout batch, several optimizer steps)
    seq_length: int = 128  # row length: samples are packed into rows of this many tokens
    micro_batch_size: int = 4  # rows per micro-batch
    precision: Literal["fp32", "bf16"] = "fp32"
    recompute: Literal["none", "full", "selective"] = "none"
    logprob_chunk_size: Optional[int] = None  # tokens per chunk of the vocab-parallel log-probs (None = auto)


@dataclass
class RLDataConfig:
    """Where prompts come from: a jsonl file (`prompt` + `label`), or the synthetic addition task."""

    path: Optional[str] = None  # .jsonl with prompt_key / label_key; None = synthetic
    prompt_key: str = "prompt"
    label_key: str = "label"
    synthetic_task: Literal["addition"] = "addition"
    synthetic_max_digits: int = 2
    synthetic_num_prompts: int = 100_000  # size of the synthetic training pool
    tokenizer_path: Optional[str] = None  # None = the bundled byte-level tokenizer
    add_bos: bool = True  # prompt ids start with the tokenizer's bos (as SFT rows do)


@dataclass
class RolloutConfig:
    """Engines, sampling and batch shape of the rollouts."""

    engine_urls: list[str] = field(default_factory=list)  # SGLang / `mcore-rl serve` URLs; [] = embedded
    num_embedded_engines: int = 1  # with engine_urls empty: EngineCores in this process (rank 0)
    quantization: Literal["fp8", "bf16", "none"] = "none"  # engine weights: FP8 blocks, bf16, or fp32
    group_size: int = 8  # G samples per prompt
    prompts_per_step: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    max_staleness: int = 0  # policy versions a sample may lag behind the learner (only 0 so far)
    max_running_requests: int = 256  # embedded engine: continuous-batching slots
    context_length: int = 1024  # embedded engine
    sync_transport: Literal["tensor", "disk", "distributed"] = "tensor"  # for engine_urls
    sync_dir: Optional[str] = None  # disk transport: a directory the engines can read
    sync_bucket_mb: int = 512
    request_timeout_s: float = 600.0


@dataclass
class MismatchCorrectionConfig:
    """Train-inference mismatch correction with the engine's log-probs μ (`mcore_rl.algos.mismatch`).

    name: none | tis | mis | icepop | seq_tis | seq_mis | seq_mask_tis | slime_mis | mipu.
    Unset (null) parameters keep the preset's defaults (TIS C=2, MIS/IcePop bounds [0.5, 5]).
    """

    name: Literal["none", "tis", "mis", "icepop", "seq_tis", "seq_mis", "seq_mask_tis", "slime_mis", "mipu"] = "tis"
    level: Optional[Literal["token", "sequence", "geometric"]] = None
    clip_low: Optional[float] = None  # TIS lower truncation
    clip_high: Optional[float] = None  # TIS truncation C (MIPU: w_max)
    mask_low: Optional[float] = None  # MIS / IcePop / rejection bounds
    mask_high: Optional[float] = None
    veto_threshold: Optional[float] = None
    batch_normalize: Optional[bool] = None
    # MIPU Step 2 (accept/reject after each weight sync)
    mipu_validation_prompts: int = 8  # prompts of the validation batch (G samples each)
    mipu_c_start: float = 1e-3
    mipu_c_end: float = 0.0
    mipu_anneal_steps: int = 100
    mipu_count_rejected: bool = True


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts."""

    enabled: bool = False
    max_rounds: int = 4
    max_oversample: float = 4.0


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    advantage_std_normalize: bool = True  # grpo only
    policy_loss: Literal["ppo_clip", "gspo"] = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO clip-higher
    dual_clip: Optional[float] = None
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    kl_coef: float = 0.0  # 0 = no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False  # True: r - β·KL (per sequence) instead of a loss term
    entropy_coef: float = 0.0
    num_minibatches: int = 1  # optimizer steps per rollout batch (per epoch)
    ppo_epochs: int = 1
    drop_reward_errors: bool = True  # samples whose reward function failed get no loss
    mismatch: MismatchCorrectionConfig = field(default_factory=MismatchCorrectionConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class RewardConfig:
    name: str = "addition"  # "addition", "math", or "package.module:function"
    timeout_s: float = 30.0
    error_reward: float = 0.0
    max_concurrency: int = 16


@dataclass
class EvalConfig:
    """Held-out evaluation through the engine (what the inference policy scores)."""

    interval: int = 10  # rollout steps; 0 = only before and after training
    num_prompts: int = 200
    path: Optional[str] = None  # jsonl of held-out prompts; None = synthetic, drawn with another seed
    k: int = 4  # samples per prompt for avg@k / pass@k (0 = greedy only)
    greedy: bool = True
    temperature: Optional[float] = None  # sampled eval; None = rollout.temperature
    score: Literal["greedy", "avg@k"] = "greedy"  # which one is `eval/score`
    at_start: bool = True


@dataclass
class InitConfig:
    """Where the policy starts: a checkpoint (model weights only), then optionally SFT on the task."""

    checkpoint: Optional[str] = None  # megatron dist-checkpoint (e.g. from `mcore-rl convert`)
    sft_steps: int = 0  # SFT warm start on the task's prompt/answer pairs (synthetic task only)
    sft_lr: float = 3e-3
    sft_min_lr: float = 3e-5
    sft_warmup_steps: int = 10
    sft_lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    sft_micro_batch_size: int = 8
    sft_seq_length: int = 64
    sft_num_examples: int = 8192


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True
    plot: bool = True  # curves.png in run_dir at the end
    print_interval: int = 0  # print a metrics line every N rollout steps (0 = progress bar only)


@dataclass
class RLConfig:
    """Root of `mcore-rl train` recipes."""

    run_dir: str = "runs/rl"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-4, lr_decay_style="constant"))
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    data: RLDataConfig = field(default_factory=RLDataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    init: InitConfig = field(default_factory=InitConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def optimizer_steps_per_rollout(self) -> int:
        return self.algorithm.num_minibatches * self.algorithm.ppo_epochs

    def sft_view(self, world_size: int) -> SFTConfig:
        """The shared sections as an `SFTConfig`, for the layout rules and the SFT warm start."""
        t, i = self.train, self.init
        mp = (self.parallel.tensor_model_parallel_size * self.parallel.pipeline_model_parallel_size
              * self.parallel.context_parallel_size)
        dp = world_size // mp if mp > 0 and world_size % mp == 0 else 1
        return SFTConfig(
            run_dir=self.run_dir,
            model=self.model,
            parallel=self.parallel,
            optimizer=OptimizerConfig(
                lr=i.sft_lr, min_lr=min(i.sft_min_lr, i.sft_lr), lr_warmup_iters=i.sft_warmup_steps,
                lr_decay_style=i.sft_lr_decay_style, clip_grad=self.optimizer.clip_grad, backend=self.optimizer.backend,
            ),
            data=DataConfig(
                synthetic_task=self.data.synthetic_task, synthetic_max_digits=self.data.synthetic_max_digits,
                synthetic_num_examples=i.sft_num_examples, tokenizer_path=self.data.tokenizer_path,
            ),
            train=TrainConfig(
                seed=t.seed, seq_length=i.sft_seq_length, micro_batch_size=i.sft_micro_batch_size,
                global_batch_size=i.sft_micro_batch_size * max(dp, 1), train_iters=i.sft_steps,
                precision=t.precision, recompute=t.recompute, eval_interval=0,
            ),
        )


def validate_rl_config(cfg: RLConfig, world_size: int) -> DerivedSizes:
    """Raise `ConfigError` listing every impossible combination; else the derived sizes."""
    errors: list[str] = []

    def need(ok: bool, key: str, msg: str) -> bool:
        if not ok:
            errors.append(f"{key}: {msg}")
        return ok

    # The layout rules of the shared sections (names the same keys: model.*, parallel.*, optimizer.*).
    layout = cfg.sft_view(world_size)
    layout.train.seq_length = cfg.train.seq_length
    layout.train.micro_batch_size = cfg.train.micro_batch_size
    mp = (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
          * cfg.parallel.context_parallel_size)
    dp = world_size // mp if mp > 0 and world_size % mp == 0 else 1
    layout.train.global_batch_size = cfg.train.micro_batch_size * max(dp, 1)
    layout.optimizer = cfg.optimizer
    sizes = DerivedSizes(max(dp, 1), 0, 1)
    try:
        sizes = validate_sft_config(layout, world_size)
    except ConfigError as err:
        errors += [line.strip() for line in str(err).splitlines()[1:]]

    t, r, a, m, e, i, d = cfg.train, cfg.rollout, cfg.algorithm, cfg.algorithm.mismatch, cfg.eval, cfg.init, cfg.data
    need(t.num_steps >= 0, "train.num_steps", f"must be >= 0, got {t.num_steps}")
    need(t.logprob_chunk_size is None or t.logprob_chunk_size >= 1, "train.logprob_chunk_size",
         f"must be null or >= 1, got {t.logprob_chunk_size}")
    # --- rollouts ---
    need(r.group_size >= 1, "rollout.group_size", f"must be >= 1, got {r.group_size}")
    if r.group_size == 1 and a.advantage in ("grpo", "dr_grpo", "rloo"):
        need(False, "rollout.group_size", f"is 1, but the group-relative advantage {a.advantage!r} needs >= 2 samples per prompt")
    need(r.prompts_per_step >= 1, "rollout.prompts_per_step", f"must be >= 1, got {r.prompts_per_step}")
    need(r.temperature > 0, "rollout.temperature",
         f"must be > 0 (RL samples from the policy; greedy rollouts have no log-prob ratio), got {r.temperature}")
    need(0 < r.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    need(r.top_k == -1 or r.top_k >= 1, "rollout.top_k", f"must be -1 (off) or >= 1, got {r.top_k}")
    if r.top_p < 1 or r.top_k != -1:
        warnings.warn("rollout.top_p/top_k truncate the sampling distribution: the engine's log-probs μ are of the "
                      "untruncated one, so the mismatch correction sees only part of the difference", stacklevel=2)
    need(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {r.max_new_tokens}")
    need(r.max_staleness == 0, "rollout.max_staleness",
         f"only 0 (synchronous rollouts) is implemented so far, got {r.max_staleness}")
    need(r.num_embedded_engines >= 1, "rollout.num_embedded_engines", f"must be >= 1, got {r.num_embedded_engines}")
    need(r.max_running_requests >= 1, "rollout.max_running_requests", f"must be >= 1, got {r.max_running_requests}")
    need(r.context_length >= 2, "rollout.context_length", f"must be >= 2, got {r.context_length}")
    need(r.sync_bucket_mb >= 1, "rollout.sync_bucket_mb", f"must be >= 1, got {r.sync_bucket_mb}")
    for j, url in enumerate(r.engine_urls):
        need(url.startswith(("http://", "https://")), f"rollout.engine_urls[{j}]", f"must be an http(s) URL, got {url!r}")
    if r.engine_urls and r.sync_transport == "disk":
        need(bool(r.sync_dir), "rollout.sync_dir", "the disk weight transport needs a directory the engines can read")
    # the longest sample must fit in one packed row
    longest = (1 if d.add_bos else 0) + _longest_prompt_tokens(cfg) + r.max_new_tokens
    if _longest_prompt_tokens(cfg) > 0:
        need(longest <= t.seq_length, "train.seq_length",
             f"{t.seq_length} is shorter than the longest sample ({longest} tokens: prompt + "
             f"rollout.max_new_tokens={r.max_new_tokens}); raise it or lower rollout.max_new_tokens")
        if not r.engine_urls:
            need(longest <= r.context_length, "rollout.context_length",
                 f"{r.context_length} is shorter than the longest sample ({longest} tokens)")
    need(cfg.model.max_position_embeddings >= t.seq_length, "model.max_position_embeddings",
         f"{cfg.model.max_position_embeddings} < train.seq_length {t.seq_length}")
    # --- algorithm ---
    need(0 <= a.clip_low < 1, "algorithm.clip_low", f"must be in [0, 1), got {a.clip_low}")
    need(a.clip_high >= 0, "algorithm.clip_high", f"must be >= 0, got {a.clip_high}")
    need(a.dual_clip is None or a.dual_clip > 1, "algorithm.dual_clip", f"must be null or > 1, got {a.dual_clip}")
    need(a.kl_coef >= 0, "algorithm.kl_coef", f"must be >= 0, got {a.kl_coef}")
    need(a.entropy_coef >= 0, "algorithm.entropy_coef", f"must be >= 0, got {a.entropy_coef}")
    need(a.num_minibatches >= 1, "algorithm.num_minibatches", f"must be >= 1, got {a.num_minibatches}")
    need(a.ppo_epochs >= 1, "algorithm.ppo_epochs", f"must be >= 1, got {a.ppo_epochs}")
    need(a.num_minibatches <= r.prompts_per_step * r.group_size, "algorithm.num_minibatches",
         f"{a.num_minibatches} mini-batches need at least as many samples; a rollout batch has "
         f"rollout.prompts_per_step x rollout.group_size = {r.prompts_per_step * r.group_size}")
    if a.kl_in_reward and a.kl_coef > 0 and a.kl_estimator != "k1":
        warnings.warn("algorithm.kl_in_reward with a k2/k3 estimator: the InstructGPT penalty is k1", stacklevel=2)
    if a.dynamic_sampling.enabled:
        need(a.dynamic_sampling.max_rounds >= 1, "algorithm.dynamic_sampling.max_rounds",
             f"must be >= 1, got {a.dynamic_sampling.max_rounds}")
        need(a.dynamic_sampling.max_oversample >= 1, "algorithm.dynamic_sampling.max_oversample",
             f"must be >= 1, got {a.dynamic_sampling.max_oversample}")
    # --- mismatch correction ---
    for key in ("clip_low", "clip_high", "mask_low", "mask_high", "veto_threshold"):
        v = getattr(m, key)
        need(v is None or (v >= 0 and not math.isnan(v)), f"algorithm.mismatch.{key}", f"must be null or >= 0, got {v}")
    if m.clip_low is not None and m.clip_high is not None:
        need(m.clip_low <= m.clip_high, "algorithm.mismatch.clip_low",
             f"{m.clip_low} exceeds algorithm.mismatch.clip_high {m.clip_high}")
    if m.mask_low is not None and m.mask_high is not None:
        need(m.mask_low <= m.mask_high, "algorithm.mismatch.mask_low",
             f"{m.mask_low} exceeds algorithm.mismatch.mask_high {m.mask_high}")
    if m.name == "mipu":
        need(m.mipu_validation_prompts >= 1, "algorithm.mismatch.mipu_validation_prompts",
             f"must be >= 1, got {m.mipu_validation_prompts}")
        need(r.group_size >= 2, "rollout.group_size", "MIPU's validation advantages need >= 2 samples per prompt")
        need(m.level in (None, "token", "sequence"), "algorithm.mismatch.level",
             f"MIPU's weight is per token or per sequence, got {m.level!r}")
        need(a.policy_loss == "ppo_clip", "algorithm.policy_loss",
             f"MIPU Step 1 is a PPO clip on π_θ/π_k; it is not defined for {a.policy_loss!r}")
        for key in ("mask_low", "mask_high", "veto_threshold", "batch_normalize"):
            need(getattr(m, key) is None, f"algorithm.mismatch.{key}",
                 "is not used by MIPU (its only parameters are clip_high = w_max, level and mipu_*)")
    # --- rewards, eval, init, data ---
    need(cfg.reward.timeout_s > 0, "reward.timeout_s", f"must be > 0, got {cfg.reward.timeout_s}")
    need(cfg.reward.max_concurrency >= 1, "reward.max_concurrency", f"must be >= 1, got {cfg.reward.max_concurrency}")
    if ":" not in cfg.reward.name:
        need(cfg.reward.name in ("addition", "math"), "reward.name",
             f"unknown reward {cfg.reward.name!r}; built-in: addition, math (or 'package.module:function')")
    need(e.interval >= 0, "eval.interval", f"must be >= 0, got {e.interval}")
    need(e.num_prompts >= 1, "eval.num_prompts", f"must be >= 1, got {e.num_prompts}")
    need(e.k >= 0, "eval.k", f"must be >= 0, got {e.k}")
    need(e.greedy or e.k > 0, "eval.greedy", "is false and eval.k is 0: evaluation would measure nothing")
    need(e.score != "avg@k" or e.k > 0, "eval.score", "is 'avg@k' but eval.k is 0")
    need(e.score != "greedy" or e.greedy, "eval.score", "is 'greedy' but eval.greedy is false")
    need(e.temperature is None or e.temperature > 0, "eval.temperature", f"must be null or > 0, got {e.temperature}")
    need(i.sft_steps >= 0, "init.sft_steps", f"must be >= 0, got {i.sft_steps}")
    if i.sft_steps > 0:
        need(d.path is None, "init.sft_steps",
             "the SFT warm start trains on the synthetic task's answers; with data.path set, use init.checkpoint "
             "(e.g. from `mcore-rl sft`) instead")
        need(i.sft_micro_batch_size >= 1, "init.sft_micro_batch_size", f"must be >= 1, got {i.sft_micro_batch_size}")
        need(1 <= i.sft_seq_length <= cfg.model.max_position_embeddings, "init.sft_seq_length",
             f"must be in [1, model.max_position_embeddings={cfg.model.max_position_embeddings}], got {i.sft_seq_length}")
        need(i.sft_lr >= 0, "init.sft_lr", f"must be >= 0, got {i.sft_lr}")
    need(d.synthetic_max_digits >= 1, "data.synthetic_max_digits", f"must be >= 1, got {d.synthetic_max_digits}")
    need(d.synthetic_num_prompts >= r.prompts_per_step, "data.synthetic_num_prompts",
         f"{d.synthetic_num_prompts} is fewer than rollout.prompts_per_step {r.prompts_per_step}")
    if d.path is None and ":" not in cfg.reward.name:
        need(cfg.reward.name == "addition", "reward.name",
             f"the synthetic addition prompts are scored by 'addition', got {cfg.reward.name!r}")
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(dict.fromkeys(errors)))
    return sizes


def _longest_prompt_tokens(cfg: RLConfig) -> int:
    """Prompt length of the synthetic task ("12+34=" is 2·digits + 2 bytes); 0 = unknown (a file)."""
    if cfg.data.path is None and cfg.data.synthetic_task == "addition":
        return 2 * cfg.data.synthetic_max_digits + 2
    return 0
