"""Rules of an `mcore-rl rm-train` config: the SFT rules, and the reward model's own keys."""

from __future__ import annotations

from mcore_rl.config.rm_schema import RMConfig
from mcore_rl.config.rules import Errors
from mcore_rl.config.validate import DerivedSizes, validate_sft_config


def validate_rm_config(cfg: RMConfig, world_size: int) -> DerivedSizes:
    """`validate_sft_config`'s rules and these, every violation at once (`ConfigError`)."""
    errors = Errors()
    rm = cfg.reward_model
    errors.need(rm.num_heads >= 1, "reward_model.num_heads", f"must be >= 1, got {rm.num_heads}")
    errors.need(
        not cfg.data.rrm or rm.objective == "bradley_terry",
        "data.rrm",
        "RRM's augmentation makes preference pairs; reward_model.objective is binary",
    )
    errors.need(
        not cfg.model.tie_word_embeddings,
        "model.tie_word_embeddings",
        "must be false for a reward model: its value head replaces the output layer",
    )
    errors.need(
        not cfg.data.pack_sequences,
        "data.pack_sequences",
        "must be false for a reward model: one sequence per row, scored at its last token",
    )
    errors.need(
        cfg.data.path is not None or rm.objective == "bradley_terry",
        "reward_model.objective",
        f"{rm.objective} needs its examples in data.path; the synthetic task makes pairs",
    )
    if rm.objective == "beta_prm":
        errors.need(
            rm.num_heads == 2,
            "reward_model.num_heads",
            f"must be 2 for beta_prm (BetaPRM's mean and concentration), got {rm.num_heads}",
        )
        errors.need(bool(cfg.data.step_delimiter), "data.step_delimiter", "must not be empty: it ends every step")
    errors.need(
        rm.objective != "score_distribution" or rm.num_heads >= 2,
        "reward_model.num_heads",
        f"must be >= 2 for score_distribution (one logit per score bin), got {rm.num_heads}",
    )
    errors.need(
        rm.regularizer_weight >= 0, "reward_model.regularizer_weight", f"must be >= 0, got {rm.regularizer_weight}"
    )
    return validate_sft_config(cfg, world_size, errors)  # raises with every line, ours first
