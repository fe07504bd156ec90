"""Rules of an `mcore-rl rm-train` config: the SFT rules, and the reward model's own keys."""

from __future__ import annotations

import json
import os

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
    d = cfg.data
    errors.need(0 < d.rrm_threshold < 1, "data.rrm_threshold", f"must be in (0, 1), got {d.rrm_threshold}")
    if d.rrm_base_model is not None:
        errors.need(d.rrm, "data.rrm_base_model", "filters RRM's augmented pairs; set data.rrm=true")
        _check_base_model(d.rrm_base_model, cfg.model.vocab_size, errors)
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


def _check_base_model(path: str, vocab_size: int, errors: Errors) -> None:
    """RRM's base model: a HF sequence classifier whose vocabulary reads every id of the tokenizer."""
    config = os.path.join(path, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as err:
        errors.need(False, "data.rrm_base_model", f"{config} cannot be read: {type(err).__name__}: {err}")
        return
    arch = (hf.get("architectures") or ["?"])[0]
    errors.need(
        str(arch).endswith("ForSequenceClassification"),
        "data.rrm_base_model",
        f"{path} holds a {arch}, not a reward model (a *ForSequenceClassification: `mcore-rl convert mcore-to-hf`)",
    )
    vocab = hf.get("vocab_size")
    errors.need(
        isinstance(vocab, int) and vocab >= vocab_size,
        "data.rrm_base_model",
        f"the base model's vocabulary ({vocab}, {config}) is smaller than model.vocab_size = {vocab_size}",
    )
