"""Rules of `model.rope_scaling` (RoPE scaling: linear, Llama 3.x, YaRN).

The values are those transformers accepts, narrowed to what both models here compute without a
division by zero or a log of a non-positive number; megatron-core expresses YaRN's attention factor
through its concentration factor, which is 1 unless factor > 1 (models/rope_scaling.py).
"""

from __future__ import annotations

from typing import Any

from mcore_rl.config.schema import ModelConfig, RopeScalingConfig


def check_rope_scaling(
    s: RopeScalingConfig, max_position_embeddings: int, errors: Any, prefix: str = "model.rope_scaling"
) -> None:
    """Record one `prefix.<key>: problem` line per bad value on `errors` (a `rules.Errors`)."""
    if s.type == "none":
        return
    errors.need(s.factor >= 1.0, f"{prefix}.factor", f"must be >= 1 for rope type {s.type}, got {s.factor}")
    if s.type == "linear":
        return
    original = s.original_max_position_embeddings
    errors.need(
        original is None or original >= 1,
        f"{prefix}.original_max_position_embeddings",
        f"must be null (= max_position_embeddings {max_position_embeddings}) or >= 1, got {original}",
    )
    if s.type == "llama3":
        errors.need(s.low_freq_factor > 0, f"{prefix}.low_freq_factor", f"must be > 0, got {s.low_freq_factor}")
        errors.need(
            s.high_freq_factor > s.low_freq_factor,
            f"{prefix}.high_freq_factor",
            f"must be > low_freq_factor {s.low_freq_factor}, got {s.high_freq_factor}",
        )
        return
    errors.need(s.beta_slow > 0, f"{prefix}.beta_slow", f"must be > 0, got {s.beta_slow}")
    errors.need(  # equal bounds (Kimi-K2: 1 and 1) are a step, which both models compute alike
        s.beta_fast >= s.beta_slow, f"{prefix}.beta_fast", f"must be >= beta_slow {s.beta_slow}, got {s.beta_fast}"
    )
    if s.attention_factor is not None:
        errors.need(
            s.attention_factor > 0, f"{prefix}.attention_factor", f"must be null or > 0, got {s.attention_factor}"
        )
        errors.need(
            s.factor > 1.0 or s.attention_factor == 1.0,
            f"{prefix}.attention_factor",
            f"{s.attention_factor} needs factor > 1 (megatron-core scales attention only then), got factor {s.factor}",
        )


def check_model_rope_scaling(m: ModelConfig, errors: Any) -> None:
    check_rope_scaling(m.rope_scaling, m.max_position_embeddings, errors)
    check_rotary_percent(m, errors)


def check_rotary_percent(m: ModelConfig, errors: Any) -> None:
    """Partial rotary: a share of each head's channels that RoPE can rotate in pairs, on plain RoPE."""
    p = m.rotary_percent
    if not errors.need(0.0 < p <= 1.0, "model.rotary_percent", f"must be in (0, 1], got {p}"):
        return
    if p == 1.0:
        return
    rotated = int(m.head_dim * p)
    errors.need(
        rotated >= 2 and rotated % 2 == 0,
        "model.rotary_percent",
        f"{p} x head_dim {m.head_dim} = {rotated} rotated channels; RoPE needs an even number >= 2",
    )
    errors.need(
        m.rope_scaling.type == "none",
        "model.rope_scaling.type",
        f"{m.rope_scaling.type!r} with rotary_percent {p} < 1 is not built (partial rotary runs plain RoPE)",
    )
