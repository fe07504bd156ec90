"""The typed config tree. Every recipe in configs/ is an instance of one of the roots below.

Field names follow megatron-core where a megatron-core concept exists, so that the mapping to
`TransformerConfig` stays obvious. Validation of values and cross-field rules lives in
`mcore_rl.config.validate` (the rules it shares with RL in `mcore_rl.config.rules`); loading and
overrides in `mcore_rl.config.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class NgramEmbeddingConfig:
    """Over-Encoding (OverTok, seed_B.md): hashed n-gram input embeddings added to the 1-gram one."""

    orders: list[int] = field(default_factory=list)  # e.g. [2, 3]; empty = off
    table_size: int = 0  # rows m per order (hashed ids mod m); gcd(m, vocab) != 1 warns
    num_slices: int = 1  # k slices per order, each with its own projection to hidden_size
    shard_over_data_parallel: bool = False  # also split table rows across data-parallel ranks


@dataclass
class ModelConfig:
    """A Qwen3-style decoder; `num_experts > 0` makes the MLPs Qwen3-MoE-style."""

    arch: Literal["qwen3", "qwen3_moe"] = "qwen3"
    vocab_size: int = 384
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    kv_channels: Optional[int] = None  # head dim; None = hidden_size // num_attention_heads
    rotary_base: float = 10000.0
    max_position_embeddings: int = 2048
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    # MoE (used when arch == "qwen3_moe")
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # per-expert intermediate size; None = ffn_hidden_size
    moe_shared_expert_intermediate_size: Optional[int] = None  # None = no shared expert
    moe_aux_loss_coeff: float = 0.0
    moe_norm_topk_prob: bool = True  # renormalise the top-k probabilities (Qwen3-MoE default)
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    # LatentMoE (seed_C.md): routed experts work in a latent space of this size (W_down d->l,
    # experts in l, W_up l->d); None = ordinary MoE. Router and shared experts stay full width.
    moe_latent_size: Optional[int] = None
    # AttnRes (seed_C.md): attention over depth instead of residual sums.
    attn_res: Literal["none", "full", "block"] = "none"
    attn_res_num_blocks: int = 8  # N for the Block variant
    ngram: NgramEmbeddingConfig = field(default_factory=NgramEmbeddingConfig)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.arch == "qwen3_moe"


@dataclass
class ParallelConfig:
    """Model-parallel sizes; data-parallel size is whatever the world size leaves."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None  # None = same as tensor_model_parallel_size
    context_parallel_size: int = 1
    sequence_parallel: bool = False


@dataclass
class OptimizerConfig:
    # sgd = plain SGD, no momentum and no state (SGD-vs-Adam-RLVR): lr ~1e5 x AdamW's (e.g. 1e-1 vs
    # 1e-6); adam_* are unused and backend must be torch
    name: Literal["adamw", "sgd"] = "adamw"
    backend: Literal["torch", "deepspeed"] = "torch"  # deepspeed = DeepSpeedCPUAdam (CPU only)
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    # step = MIPU's LR-decay baseline ("Beyond Precision", seed_C): constant, then x lr_step_factor
    # at update lr_step_start_iter and every lr_step_period updates after it, floored at min_lr
    # (the paper's floor: min_lr = 0.1 * lr)
    lr_decay_style: Literal["constant", "linear", "cosine", "step"] = "cosine"
    lr_warmup_iters: int = 0
    lr_step_start_iter: int = 0  # step style: the first decayed update (0-based)
    lr_step_period: int = 0  # step style: updates between two decays (>= 1)
    lr_step_factor: float = 0.5  # step style: multiplier per decay, in (0, 1)
    # OPD-Sparsity's subnetwork retraining: a .pt {megatron name: bool mask} (`mcore-rl diagnose
    # update_sparsity --write-mask`); only True coordinates train, the rest stay bit-identical
    update_mask: Optional[str] = None


@dataclass
class DataConfig:
    """Where SFT examples come from: a jsonl/text file, or a built-in synthetic task."""

    path: Optional[str] = None  # .jsonl (prompt/response or text) or plain text; None = synthetic
    format: Literal["auto", "jsonl", "text"] = "auto"
    prompt_key: str = "prompt"
    response_key: str = "response"
    text_key: str = "text"
    on_bad_line: Literal["skip", "error"] = "error"
    synthetic_task: str = "addition"  # a task registered in mcore_rl.data.tasks
    synthetic_num_examples: int = 4096
    synthetic_max_digits: int = 1  # addition operands have up to this many digits
    tokenizer_path: Optional[str] = None  # None = the bundled byte-level tokenizer
    pack_sequences: bool = True  # pack several examples per row; False = pad each example
    mask_prompt: bool = True  # no loss on prompt tokens


@dataclass
class TrainConfig:
    seed: int = 1234
    seq_length: int = 64
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_iters: int = 100
    precision: Literal["fp32", "bf16"] = "fp32"
    recompute: Literal["none", "full", "selective"] = "none"
    log_interval: int = 10
    eval_interval: int = 0  # 0 = no evaluation
    eval_iters: int = 2


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None
    save_interval: int = 0  # 0 = only at the end (when save_dir is set)
    load_dir: Optional[str] = None  # resume from here (latest iteration)
    # launch (pre-emption, docs/launch.md): these signals make `mcore-rl sft`/`train` finish the current
    # step, save a checkpoint to save_dir and exit with code 75 (mcore_rl/parallel/preemption.py); [] = off
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


@dataclass
class SFTConfig:
    """Root of `mcore-rl sft` recipes."""

    run_dir: str = "runs/sft"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
