"""Rules of an `mcore-rl rm-train` config: the SFT rules, and the reward model's own keys."""

from __future__ import annotations

import json
import os
import pickle

from mcore_rl.config.loader import config_to_dict
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
    if cfg.init.checkpoint is not None:
        _check_init_checkpoint(cfg.init.checkpoint, cfg, errors)
    return validate_sft_config(cfg, world_size, errors)  # raises with every line, ours first


# A policy checkpoint's `model` config must equal `model.*` here on every key but these, which do not
# shape the decoder's weights: RoPE, the norm epsilon, the initialisation's scale, the MoE aux loss, tied
# embeddings (the value head replaces the output layer either way), and MTP heads (`mtp_*`: not loaded).
# kv_channels is compared as the head dim it gives. Family and feature keys are compared as they are
# stored, without naming them: a checkpoint of another architecture differs somewhere.
MAY_DIFFER = (
    "rope_scaling",
    "rotary_base",
    "rotary_percent",
    "max_position_embeddings",
    "norm_epsilon",
    "init_method_std",
    "moe_aux_loss_coeff",
    "tie_word_embeddings",
    "kv_channels",
)


def _checkpoint_path(path: str) -> str | None:
    """The newest complete megatron checkpoint under `path` (or `path` itself), as
    `train.checkpoint.latest_checkpoint` finds it; None if there is none."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    marker = os.path.join(path, "latest")
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        found = os.path.join(path, f.read().strip())
    return found if os.path.isfile(os.path.join(found, "metadata.json")) else None


def _shape_keys(model: dict) -> dict:
    out = {k: v for k, v in model.items() if k not in MAY_DIFFER and not k.startswith("mtp_")}
    if "hidden_size" in model and model.get("num_attention_heads"):
        out["head_dim"] = model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"]
    return out


def _check_init_checkpoint(path: str, cfg: RMConfig, errors: Errors) -> None:
    """`init.checkpoint`: a policy's checkpoint (not a reward model's) whose decoder has `model.*`'s shapes.
    Its common state is read as megatron-core writes it (`common.pt`), without importing megatron."""
    key = "init.checkpoint"
    if not os.path.isdir(path):
        errors.need(False, key, f"{path!r} does not exist")
        return
    found = _checkpoint_path(path)
    if found is None:
        errors.need(False, key, f"{path!r} holds no checkpoint (no metadata.json, no 'latest' file)")
        return
    import torch  # lazy: the common state is a torch file

    try:
        common = torch.load(os.path.join(found, "common.pt"), map_location="cpu")["common"]
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as err:
        errors.need(False, key, f"{found}: its common state cannot be read: {type(err).__name__}: {err}")
        return
    if "reward_model" in common:
        errors.need(
            False,
            key,
            f"{found} is a reward model's checkpoint, not a policy's; go on training it with checkpoint.load_dir "
            "(init.checkpoint would drop its value head)",
        )
        return
    stored = common.get("model")
    if not isinstance(stored, dict):
        return  # a checkpoint without its model config: megatron-core's load checks the shapes
    theirs, ours = _shape_keys(stored), _shape_keys(config_to_dict(cfg.model))
    differ = [k for k in theirs if k in ours and theirs[k] != ours[k]]
    errors.need(
        not differ,
        key,
        f"{found} holds a model with "
        + ", ".join(f"{k} {theirs[k]}" for k in differ)
        + "; model.* here has "
        + ", ".join(f"{k} {ours[k]}" for k in differ)
        + " (set model.* to the policy's)",
    )


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
