"""The config tree of `mcore-rl rm-train`: an SFT recipe (model, layout, optimizer, train,
checkpoint, logging) whose data are preference pairs or labelled responses, plus the
`reward_model` section. Validated by `config/rm_validate.py`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mcore_rl.config.schema import DataConfig, SFTConfig


@dataclass
class RewardModelConfig:
    """What the value head learns and from which labels (`algos/reward_model.py`)."""

    # bradley_terry: pairs (chosen/rejected, optional margin and tie); binary: responses with a label in [0, 1];
    # beta_prm: a process reward model, BetaPRM's Beta head (num_heads 2: mean, concentration) read at each
    # step's delimiter, trained on Monte-Carlo continuation counts (data/process_rewards.py); score_distribution:
    # Z-Reward's student, one logit per score bin (num_heads bins) distilled to a teacher's distribution (KL)
    objective: Literal["bradley_terry", "binary", "beta_prm", "score_distribution"] = "bradley_terry"
    num_heads: int = 1  # scalars per sequence; a pair or response trains the head its `head` field names (0)
    regularizer_weight: float = 1.0  # beta_prm: weight of the reliability regulariser log(1 + κ)(μ − K/N)²


@dataclass
class PreferenceDataConfig(DataConfig):
    """`data.path`: a jsonl of pairs `{prompt, chosen, rejected[, margin, tie, head]}` or of labelled
    responses `{prompt, response, label[, head]}` (`data/preferences.py`); None = pairs made from
    `data.synthetic_task` (correct vs wrong answers, with `data.artifact` planted)."""

    chosen_key: str = "chosen"  # jsonl pairs: the preferred response
    rejected_key: str = "rejected"  # jsonl pairs: the other response
    margin_key: str = "margin"  # optional: preference strength >= 0
    tie_key: str = "tie"  # optional: true = neither response is preferred
    label_key: str = "label"  # binary objective: 1 = good, 0 = bad (soft labels in [0, 1] allowed)
    head_key: str = "head"  # optional: which value head the example trains (default 0)
    steps_key: str = "steps"  # beta_prm: a solution's steps (strings)
    successes_key: str = "successes"  # beta_prm: per step, K continuations of N that succeeded
    rollouts_key: str = "rollouts"  # one N for every step, or a list
    step_delimiter: str = "\n"  # ends every step; the PRM is read at its last token
    # synthetic pairs: a spurious feature of the correct answers in the training pairs (reversed in the
    # held-out ones), which a reward model can latch onto instead of correctness
    artifact: Literal["none", "length", "format"] = "none"
    # RRM's causal augmentation of the training pairs (data/preferences.py: rrm_augment), unfiltered
    # unless rrm_base_model is set
    rrm: bool = False
    # RRM's filter: an exported HF reward model (a *ForSequenceClassification dir, e.g. `mcore-rl convert
    # mcore-to-hf` of an RM trained without data.rrm) scores the augmented pairs; only those it gets wrong
    # by >= rrm_threshold are kept (|σ(r1 - r2) - target|, target 1 for a preference, 1/2 for a tie)
    rrm_base_model: str | None = None
    rrm_threshold: float = 0.2  # RRM's 0.2; in (0, 1)
    pack_sequences: bool = False  # one sequence per row: a reward model scores each at its last token


@dataclass
class RMInitConfig:
    """Where a reward model starts when `checkpoint.load_dir` holds no checkpoint to resume."""

    # a policy's megatron dist-checkpoint (`mcore-rl sft` / `train` / `convert hf-to-mcore`, any layout): its
    # embeddings, layers and final norm; the value head starts fresh (train.seed), the optimizer too. None =
    # the decoder starts from scratch
    checkpoint: str | None = None


@dataclass
class RMConfig(SFTConfig):
    """Root of `mcore-rl rm-train` recipes."""

    run_dir: str = "runs/rm"  # metrics.jsonl, logs and plots of the run
    init: RMInitConfig = field(default_factory=RMInitConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
