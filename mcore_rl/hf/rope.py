"""RoPE scaling of the reference model: transformers' `linear`, `llama3` and `yarn` rope types.

A scaled RoPE is described by one dict, the one a `config.json` holds: `rope_parameters` in
transformers 5, `rope_scaling` (with `rope_theta` beside it) in 4.x; `rope_type` plus that type's
parameters. `rope_inv_freq` turns it into the inverse frequencies and the attention factor (YaRN's
scale of cos and sin) with the formulas of `transformers.modeling_rope_utils`, so the reference
model computes what the stock classes compute. Pure torch and stdlib: it is exported as remote code.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The two spellings of a config.json: transformers 5 writes the first, 4.x reads only the second.
ROPE_KEYS = ("rope_parameters", "rope_scaling")
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}


def rope_type_of(params: dict | None) -> str:
    """`rope_type` of a scaling dict (4.x files may say `type`); "default" for None or {}."""
    if not params:
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def rope_scaling_of(config: Any) -> dict[str, Any] | None:
    """The scaling dict of an HF config (either spelling), None for plain RoPE.

    Like transformers' `standardize_rope_params`, llama3 and yarn get `original_max_position_embeddings`
    = `max_position_embeddings` when the file does not say.
    """
    for key in ROPE_KEYS:
        params = getattr(config, key, None)
        if isinstance(params, dict) and rope_type_of(params) != "default":
            out = {**params, "rope_type": rope_type_of(params)}
            out.pop("type", None)
            if out["rope_type"] in ("llama3", "yarn"):
                out.setdefault("original_max_position_embeddings", config.max_position_embeddings)
            return out
    return None


def partial_rotary_factor_of(config: Any) -> float:
    """The share of each head's channels RoPE rotates: `partial_rotary_factor` at the top of the config
    (ours, transformers 4.x) or inside its RoPE dict (transformers 5 moves it there); 1.0 if unset."""
    for key in ROPE_KEYS:
        params = getattr(config, key, None)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    return float(getattr(config, "partial_rotary_factor", None) or 1.0)


def rotary_dim(config: Any) -> int:
    """The channels of a head RoPE rotates (the first ones; the rest pass): head_dim x the factor."""
    return int(config.head_dim * partial_rotary_factor_of(config))


def rope_key_in_file(path: str) -> str:
    """Which key a checkpoint's `config.json` (a file or its directory) spells RoPE with: 'rope_scaling'
    for a transformers 4.x file (`rope_scaling` or a top-level `rope_theta`), else 'rope_parameters'."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return ROPE_KEYS[0]
    if "rope_parameters" not in data and ("rope_scaling" in data or "rope_theta" in data):
        return "rope_scaling"
    return "rope_parameters"


def respell_rope(config: dict[str, Any], key: str) -> dict[str, Any]:
    """A config dict as written by transformers 5 (`rope_parameters` with `rope_theta` inside) in the
    spelling `key`: for 'rope_scaling', `rope_theta` at the top and the scaling (or null) beside it."""
    if key != "rope_scaling" or "rope_parameters" not in config:
        return config
    out = dict(config)
    params = dict(out.pop("rope_parameters") or {})
    if "rope_theta" in params:
        out["rope_theta"] = params.pop("rope_theta")
    out["rope_scaling"] = params if rope_type_of(params) != "default" else None
    return out


def respell_rope_in_file(path: str, key: str) -> None:
    """Rewrite a written `config.json` in the RoPE spelling `key` (`respell_rope`); a no-op for
    'rope_parameters' (what transformers 5 writes)."""
    if key == "rope_parameters":
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(respell_rope(config, key), f, indent=2, sort_keys=True)
        f.write("\n")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's m(s, x) = 0.1 x ln s + 1 (1 when s <= 1): the attention temperature of a scale s."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict[str, Any]) -> float:
    """YaRN's scale of cos and sin: `attention_factor`, else from factor (and mscale / mscale_all_dim)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, mscale, mscale_all_dim = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (> low_freq_wavelen) are divided by factor, short ones kept, between them smoothed
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(head_dim: int, theta: float, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    beta_fast = params.get("beta_fast") or YARN_DEFAULTS["beta_fast"]
    beta_slow = params.get("beta_slow") or YARN_DEFAULTS["beta_slow"]
    original = params["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1 - ramp  # 1 = keep the original frequency (high frequencies), 0 = interpolate
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in fp32, attention factor) of plain or scaled RoPE."""
    kind = rope_type_of(scaling)
    if kind == "yarn":
        assert scaling is not None  # rope_type_of(None) is "default"
        return _yarn_inv_freq(head_dim, theta, scaling), yarn_attention_factor(scaling)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if kind == "default":
        return inv_freq, 1.0
    assert scaling is not None  # rope_type_of(None) is "default"
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    raise ValueError(f"rope_type={kind!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}")


# ModelConfig.rope_scaling (a `RopeScalingConfig`, read by attribute) <-> the HF dict --------------
_TYPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}
# Written only when they differ from transformers' default, so a stock file comes back as it was.
_OPTIONAL = {
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": None,
    "mscale_all_dim": None,
    "attention_factor": None,
    "truncate": True,
}
_CAST = {"original_max_position_embeddings": int, "truncate": bool}  # the others are floats


def hf_rope_dict(scaling: Any, max_position_embeddings: int) -> dict[str, Any] | None:
    """The HF scaling dict (without `rope_theta`) of a `RopeScalingConfig`; None for type none."""
    if scaling.type == "none":
        return None
    out: dict[str, Any] = {"rope_type": scaling.type}
    for name in _TYPE_FIELDS[scaling.type]:
        value = getattr(scaling, name)
        if name == "original_max_position_embeddings" and value is None:
            value = max_position_embeddings
        if name in _OPTIONAL and value == _OPTIONAL[name]:
            continue
        out[name] = value
    return out


def rope_scaling_fields(config: Any, hf_key: str | None = None) -> dict[str, Any]:
    """The `RopeScalingConfig` fields of an HF config (either spelling); `hf_key` is the spelling of
    its file (`rope_key_in_file`), kept for export."""
    fields: dict[str, Any] = {"hf_key": hf_key} if hf_key else {}
    params = rope_scaling_of(config)
    if params is None:
        return fields
    kind = params["rope_type"]
    if kind not in _TYPE_FIELDS:
        raise ValueError(f"rope_type={kind!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}")
    fields["type"] = kind
    if kind == "yarn" and params.get("factor") is None:  # DeepSeek-style: the ratio of the two lengths
        params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    for name in _TYPE_FIELDS[kind]:
        value = params.get(name)
        if value is None and name in ("beta_fast", "beta_slow"):  # transformers: `or` default
            value = _OPTIONAL[name]
        if value is not None:
            fields[name] = _CAST.get(name, float)(value)
    return fields
