"""The typed config tree. Every recipe in configs/ is an instance of one of the roots below.

Field names follow megatron-core where a megatron-core concept exists, so that the mapping to
`TransformerConfig` stays obvious. Validation of values and cross-field rules lives in
`mcore_rl.config.validate` (the rules it shares with RL in `mcore_rl.config.rules`); loading and
overrides in `mcore_rl.config.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_rl.config.loader import config_from_dict, config_to_dict
from mcore_rl.config.observability import ObservabilityConfig
from mcore_rl.config.sections import Sectioned


# RoPE scaling (Llama 3.x, YaRN, linear) --------------------------------------------------------------
@dataclass
class RopeScalingConfig:
    """RoPE scaling as Hugging Face configs state it (`rope_parameters` / `rope_scaling`), with
    transformers' defaults; each type reads only its own fields (validated in config/rope_scaling.py)."""

    # none = plain RoPE; linear / llama3 (Llama 3.x) / yarn, each reading only its own fields
    type: Literal["none", "linear", "llama3", "yarn"] = "none"
    factor: float = 1.0  # linear, llama3, yarn: the context extension
    # llama3, yarn: the pre-training context; None = max_position_embeddings (as transformers)
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: ramp bounds in rotations
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn: with mscale_all_dim, the attention factor's numerator
    mscale_all_dim: float | None = None  # yarn: ... and denominator
    attention_factor: float | None = None  # yarn: scale of cos/sin; None = 0.1 ln(factor) + 1 (or mscales)
    truncate: bool = True  # yarn: round the ramp bounds to whole dimensions
    # The config.json key an export writes: the source's spelling ("rope_scaling" + top-level rope_theta
    # is what transformers 4.x reads; transformers 5 reads both)
    hf_key: Literal["rope_parameters", "rope_scaling"] = "rope_parameters"


# The archs that are no family's (a family's keys are its section, `config/model_keys/`).
DECODER_ARCHS: tuple[str, ...] = ("qwen3", "qwen3_moe")


@dataclass
class ModelConfig(Sectioned):
    """A Qwen3-style decoder: the keys every decoder shares. The keys a feature or family owns (MoE,
    LatentMoE, AttnRes, n-gram embeddings, DeepSeek-V3) are its section (`config/model_keys/`), written
    among these (`model.num_experts`, `model.ngram.orders`) and read typed, `section(MoEKeys)`."""

    # deepseek_v3 / glm4_moe / gpt_oss: MoE families (docs/model_families.md)
    arch: Literal["qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"] = "qwen3"
    vocab_size: int = 384  # true vocabulary size (padding for TP: make_vocab_size_divisible_by)
    hidden_size: int = 64  # model width d
    ffn_hidden_size: int = 256  # intermediate size of a dense MLP
    num_layers: int = 2  # transformer layers
    num_attention_heads: int = 4  # query heads
    num_query_groups: int = 2  # key/value heads (GQA)
    kv_channels: int | None = None  # head dim; None = hidden_size // num_attention_heads
    rotary_base: float = 10000.0  # RoPE theta
    max_position_embeddings: int = 2048  # longest position the model is configured for
    norm_epsilon: float = 1e-6  # RMSNorm epsilon
    qk_layernorm: bool = True  # RMSNorm on queries and keys per head (Qwen3); False for Llama / Qwen2 / Mistral
    tie_word_embeddings: bool = False  # the output layer shares the input embedding
    init_method_std: float = 0.02  # std of the normal weight init of a model built from scratch
    # Qwen2 / Mistral (docs/qwen2_mistral.md)
    add_qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2), none on the output projection
    sliding_window: int | None = None  # Mistral: a token attends to itself and the sliding_window - 1 before it
    # RoPE scaling: Llama 3.x, YaRN, linear; type none = plain RoPE
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # Vocabulary padding (models/vocab_padding.py): the megatron embedding and output layer have
    # vocab_size rounded up to a multiple of this x TP rows; vocab_size stays the true size. 1 pads
    # only what TP needs (a checkpoint's shapes stay those of TP=1); Megatron-LM's default is 128.
    make_vocab_size_divisible_by: int = 1
    # --- GLM-4.5 ---
    # Partial rotary (HF partial_rotary_factor, megatron-core's rotary_percent): RoPE turns the first
    # rotary_percent x head_dim channels of each head, the rest pass unrotated (GLM-4.5: 0.5)
    rotary_percent: float = 1.0

    @classmethod
    def of(cls, **keys: object) -> ModelConfig:
        """A model from its YAML keys, its sections' among them, each checked as a recipe's is:
        `ModelConfig.of(arch="qwen3_moe", num_experts=4)`, for tests and scripts that write one inline."""
        return config_from_dict(cls, keys, "model")

    def replace(self, **keys: object) -> ModelConfig:
        """A copy with these YAML keys changed, its sections' among them, checked as `of`'s are."""
        return config_from_dict(type(self), {**config_to_dict(self), **keys}, "model")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.arch in ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


@dataclass
class ParallelConfig:
    """Model-parallel sizes; data-parallel size is whatever the world size leaves."""

    tensor_model_parallel_size: int = 1  # TP: ranks that split each layer's matmuls
    pipeline_model_parallel_size: int = 1  # PP: ranks that split the layers into stages
    # VPP: model chunks per pipeline rank (interleaved 1F1B); None = off
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1  # EP: ranks that split the routed experts
    expert_tensor_parallel_size: int | None = None  # None = same as tensor_model_parallel_size
    context_parallel_size: int = 1  # CP: ranks that split the sequence in attention (needs transformer-engine)
    # SP: shard activations outside TP regions along the sequence (needed for MoE with TP)
    sequence_parallel: bool = False


@dataclass
class OptimizerConfig:
    # sgd = plain SGD, no momentum and no state (SGD-vs-Adam-RLVR): lr ~1e5 x AdamW's (e.g. 1e-1 vs
    # 1e-6); adam_* are unused and backend must be torch
    name: Literal["adamw", "sgd"] = "adamw"
    backend: Literal["torch", "deepspeed"] = "torch"  # deepspeed = DeepSpeedCPUAdam (CPU only)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 0.0  # floor of the linear / cosine / step decay
    weight_decay: float = 0.0  # decoupled weight decay (AdamW)
    adam_beta1: float = 0.9  # AdamW beta1
    adam_beta2: float = 0.95  # AdamW beta2
    adam_eps: float = 1e-8  # AdamW epsilon
    clip_grad: float = 1.0  # 0 disables clipping
    # step = MIPU's LR-decay baseline ("Beyond Precision", docs/papers.md): constant, then x lr_step_factor
    # at update lr_step_start_iter and every lr_step_period updates after it, floored at min_lr
    # (the paper's floor: min_lr = 0.1 * lr)
    lr_decay_style: Literal["constant", "linear", "cosine", "step"] = "cosine"
    lr_warmup_iters: int = 0  # linear warmup from 0 over this many optimizer steps
    lr_step_start_iter: int = 0  # step style: the first decayed update (0-based)
    lr_step_period: int = 0  # step style: updates between two decays (>= 1)
    lr_step_factor: float = 0.5  # step style: multiplier per decay, in (0, 1)
    # OPD-Sparsity's subnetwork retraining: a .pt {megatron name: bool mask} (`mcore-rl diagnose
    # update_sparsity --write-mask`); only True coordinates train, the rest stay bit-identical
    update_mask: str | None = None


@dataclass
class DataConfig:
    """Where SFT examples come from: a jsonl/text file, or a built-in synthetic task."""

    path: str | None = None  # .jsonl (prompt/response or text) or plain text; None = synthetic
    format: Literal["auto", "jsonl", "text"] = "auto"  # auto = by the file's suffix
    prompt_key: str = "prompt"  # jsonl: the prompt field (no loss on its tokens when mask_prompt)
    response_key: str = "response"  # jsonl: the response field
    text_key: str = "text"  # jsonl: the field of a plain-text example
    # a malformed line of data.path: stop there naming file:line, or skip it (logged)
    on_bad_line: Literal["skip", "error"] = "error"
    synthetic_task: str = "addition"  # a task registered in mcore_rl.data.tasks
    synthetic_num_examples: int = 4096  # examples drawn from the synthetic task
    synthetic_max_digits: int = 1  # addition operands have up to this many digits
    tokenizer_path: str | None = None  # None = the bundled byte-level tokenizer
    pack_sequences: bool = True  # pack several examples per row; False = pad each example
    mask_prompt: bool = True  # no loss on prompt tokens


@dataclass
class TrainConfig:
    seed: int = 1234  # seeds weights, data order, dropout and sampling
    seq_length: int = 64  # tokens per row
    micro_batch_size: int = 4  # rows per micro-batch on one data-parallel rank
    global_batch_size: int = 8  # rows per optimizer step over all data-parallel ranks
    train_iters: int = 100  # optimizer steps
    precision: Literal["fp32", "bf16"] = "fp32"  # parameter and compute dtype (bf16 keeps fp32 master weights)
    recompute: Literal["none", "full", "selective"] = "none"  # activation recomputation in the backward pass
    log_interval: int = 10  # optimizer steps between printed metrics lines
    eval_interval: int = 0  # 0 = no evaluation
    eval_iters: int = 2  # held-out batches per evaluation
    # MTP draft heads (model.mtp_num_layers > 0): their loss beside the policy's, Bebop's end-to-end
    # total variation "tv" or the soft cross-entropy "ce" to the detached policy (algos/mtp_draft.py)
    mtp_loss: Literal["tv", "ce"] = "tv"
    mtp_loss_coeff: float = 1.0  # weight of the heads' loss (per token, as the policy's)


@dataclass
class CheckpointConfig:
    save_dir: str | None = None  # where checkpoints go (None = no checkpoints)
    save_interval: int = 0  # 0 = only at the end (when save_dir is set)
    load_dir: str | None = None  # resume from here (latest iteration)
    # launch (pre-emption, docs/launch.md): these signals make `mcore-rl sft`/`train` finish the current
    # step, save a checkpoint to save_dir and exit with code 75 (mcore_rl/parallel/preemption.py); [] = off
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


@dataclass
class SFTConfig:
    """Root of `mcore-rl sft` recipes."""

    run_dir: str = "runs/sft"  # metrics.jsonl, logs and plots of the run
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # observability: metrics sinks, MFU's device peak, profiled steps (config/observability.py)
    logging: ObservabilityConfig = field(default_factory=ObservabilityConfig)
