"""Hugging Face config of the reference model (every family here), and conversions.

`McoreRLConfig` (model_type `mcore_rl`) describes every architecture the trainer builds: the GQA
decoder (Qwen3 / Qwen3-MoE; Llama 3, Qwen2 / Qwen2-MoE and Mistral as fields of it), LatentMoE,
AttnRes and n-gram embeddings here, and the families of `families.py` through their own fields. It uses the field names of stock `Qwen3Config` / `Qwen3MoeConfig`, so a
`config.json` written from it reads like a stock one; the only additions are the shared expert
(`shared_expert_intermediate_size`, which stock Qwen3-MoE lacks) and `num_experts == 0` meaning dense;
Qwen2 / Qwen2-MoE / Mistral add `qkv_bias` and `sliding_window` (the stock names) and `shared_expert_gate`
(implied by stock Qwen2-MoE).
It is written with an explicit `__init__` (the "custom model" style) rather than as a transformers-5
dataclass, so that remote-code loading also works under transformers 4.x.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from .rope import (
    ROPE_KEYS,
    SUPPORTED_ROPE_TYPES,
    hf_rope_dict,
    partial_rotary_factor_of,
    rope_scaling_fields,
    rope_scaling_of,
    rope_type_of,
)
from .families import FAMILIES, family_named, family_of, stock_decoder

if TYPE_CHECKING:  # imported lazily so this file also works alone, as remote code
    try:  # in a try block: transformers' remote-code import check skips it (no mcore_rl needed)
        from mcore_rl.config.model_keys.attn_res import AttnResKeys
        from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
        from mcore_rl.config.model_keys.moe import MoEKeys
        from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
        from mcore_rl.config.schema import ModelConfig
    except ImportError:
        pass


# Our model_type, and the one exports written before the reference classes got neutral names carry
# (`legacy_names.py` registers it, so those checkpoints still load).
OWN_MODEL_TYPES = ("mcore_rl", "mcore_rl_qwen3")


class McoreRLConfig(PretrainedConfig):
    """Dense (`num_experts == 0`) or MoE (`num_experts > 0`) decoder, HF field names.

    `use_qk_norm=False` drops the per-head QK RMSNorm (Llama-style attention).
    """

    model_type = "mcore_rl"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 384,
        hidden_size: int = 64,
        intermediate_size: int = 256,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        attention_bias: bool = False,
        num_experts: int = 0,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int | None = None,
        norm_topk_prob: bool = True,
        shared_expert_intermediate_size: int | None = 0,
        router_aux_loss_coef: float = 0.0,
        use_qk_norm: bool = True,
        moe_latent_size: int | None = None,
        attn_res: str = "none",
        attn_res_num_blocks: int = 8,
        ngram_orders: list[int] | None = None,
        ngram_table_size: int = 0,
        ngram_num_slices: int = 1,
        qkv_bias: bool = False,
        shared_expert_gate: bool = False,
        sliding_window: int | None = None,
        partial_rotary_factor: float = 1.0,
        use_cache: bool = True,
        rope_parameters: dict | None = None,
        rope_scaling: dict | None = None,
        # mixed dense/MoE layers (transformers' Qwen3-MoE rule)
        mlp_only_layers: list[int] | None = None,
        decoder_sparse_step: int = 1,
        # "qwen3" (the GQA decoder) or a family of families.py, whose fields come through kwargs
        family: str = "qwen3",
        **kwargs: Any,
    ) -> None:
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r}: only 'silu' (SwiGLU) is supported")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        # RoPE scaling (rope.py): either spelling; transformers 5 keeps rope_theta inside rope_parameters
        rope_parameters = dict(rope_parameters or rope_scaling or {}) or None
        self.rope_theta = (rope_parameters or {}).get("rope_theta", rope_theta)
        self.rope_parameters = rope_parameters
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.attention_bias = attention_bias
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size or intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.shared_expert_intermediate_size = shared_expert_intermediate_size or 0
        self.router_aux_loss_coef = router_aux_loss_coef
        self.use_qk_norm = use_qk_norm
        # LatentMoE (latent_moe.py): routed experts in this latent size; None = ordinary MoE.
        self.moe_latent_size = (moe_latent_size or None) if num_experts else None
        # AttnRes (attn_res.py): "none" | "full" | "block" (N = attn_res_num_blocks over 2 x layers sublayers)
        if attn_res not in ("none", "full", "block"):
            raise ValueError(f"attn_res={attn_res!r}: expected 'none', 'full' or 'block'")
        if attn_res == "block" and not 1 <= attn_res_num_blocks <= 2 * num_hidden_layers:
            raise ValueError(f"attn_res_num_blocks={attn_res_num_blocks}: must be in [1, 2 x num_hidden_layers]")
        self.attn_res = attn_res
        self.attn_res_num_blocks = attn_res_num_blocks
        # Over-Encoding (ngram.py): hashed n-gram input embeddings of these orders; [] = off.
        self.ngram_orders = [int(n) for n in (ngram_orders or [])]
        if self.ngram_orders and (
            min(self.ngram_orders) < 2 or not 1 <= ngram_table_size < 2**31 or ngram_num_slices < 1
        ):
            raise ValueError(
                f"ngram_orders={self.ngram_orders} need orders >= 2, 1 <= ngram_table_size "
                f"< 2^31 (got {ngram_table_size}) and ngram_num_slices >= 1 (got {ngram_num_slices})"
            )
        self.ngram_table_size = ngram_table_size
        self.ngram_num_slices = ngram_num_slices
        # Qwen2 / Qwen2-MoE / Mistral: biases on q/k/v only (attention_bias also biases o_proj), the
        # shared expert scaled by sigmoid(shared_expert_gate(x)), attention to the last sliding_window tokens.
        self.qkv_bias = qkv_bias
        self.shared_expert_gate = bool(shared_expert_gate and num_experts and self.shared_expert_intermediate_size)
        self.sliding_window = sliding_window or None
        # Partial rotary (GLM-4.5): RoPE turns the first head_dim x partial_rotary_factor channels of a
        # head (`rope.rotary_dim`). Set only below 1: transformers 5 copies a config's factor into its
        # rope_parameters, which would add it to every scaled-RoPE export.
        if partial_rotary_factor != 1.0:
            self.partial_rotary_factor = float(partial_rotary_factor)
        self.use_cache = use_cache
        # Mixed dense/MoE layers: layer i is MoE iff i not in mlp_only_layers and (i+1) % decoder_sparse_step == 0.
        self.mlp_only_layers = [int(i) for i in (mlp_only_layers or [])]
        self.decoder_sparse_step = int(decoder_sparse_step or 1)
        own = family_named(family)
        if family != "qwen3" and own is None:
            raise ValueError(f"family={family!r}: expected one of {', '.join(['qwen3', *(f.name for f in FAMILIES)])}")
        self.family = family
        # Every family's fields on every config (their defaults where unused), so config.json has one key set.
        for each in FAMILIES:
            for key, default in each.config_fields.items():
                setattr(self, key, kwargs.pop(key, default))
        if own:
            own.configure(self)
        # Passed through kwargs: transformers 4.x resets tie_word_embeddings in its own __init__.
        kwargs["tie_word_embeddings"] = tie_word_embeddings
        super().__init__(**kwargs)

    # transformers 5 turns every config subclass into a dataclass whose generated __eq__ compares
    # only the base-class fields; compare everything, like PretrainedConfig itself does.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, PretrainedConfig) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # __eq__ compares mutable state, so instances are unhashable, as PretrainedConfig's

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _sections(mc: ModelConfig) -> tuple[MoEKeys, LatentMoEKeys, AttnResKeys, NgramEmbeddingConfig]:
    """The sections of a `ModelConfig` this file reads (MoE, LatentMoE, AttnRes, n-gram)."""
    try:  # here, in a try block: remote code loads without mcore_rl and must not import it
        from mcore_rl.config.model_keys.attn_res import AttnResKeys
        from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
        from mcore_rl.config.model_keys.moe import MoEKeys
        from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
    except ImportError as err:
        raise ImportError("reading a ModelConfig needs the mcore_rl package") from err
    return mc.section(MoEKeys), mc.section(LatentMoEKeys), mc.section(AttnResKeys), mc.section(NgramEmbeddingConfig)


def hf_config_from_model_config(mc: ModelConfig) -> McoreRLConfig:
    """The HF config of the trainer's `ModelConfig` (megatron-style names -> HF names)."""
    moe, (experts, latent, attn_res, ngram) = mc.is_moe, _sections(mc)
    return McoreRLConfig(
        vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.ffn_hidden_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_query_groups,
        head_dim=mc.head_dim,
        rms_norm_eps=mc.norm_epsilon,
        rope_theta=mc.rotary_base,
        max_position_embeddings=mc.max_position_embeddings,
        initializer_range=mc.init_method_std,
        tie_word_embeddings=mc.tie_word_embeddings,
        num_experts=experts.num_experts if moe else 0,
        num_experts_per_tok=experts.moe_router_topk,
        moe_intermediate_size=(experts.moe_ffn_hidden_size or mc.ffn_hidden_size),
        norm_topk_prob=experts.moe_norm_topk_prob,
        shared_expert_intermediate_size=(experts.moe_shared_expert_intermediate_size or 0) if moe else 0,
        router_aux_loss_coef=experts.moe_aux_loss_coeff if moe else 0.0,
        use_qk_norm=mc.qk_layernorm,
        moe_latent_size=latent.moe_latent_size if moe else None,
        attn_res=attn_res.attn_res,
        attn_res_num_blocks=attn_res.attn_res_num_blocks,
        ngram_orders=list(ngram.orders),
        ngram_table_size=ngram.table_size,
        ngram_num_slices=ngram.num_slices,
        qkv_bias=mc.add_qkv_bias,
        shared_expert_gate=experts.moe_shared_expert_gate if moe else False,
        sliding_window=mc.sliding_window,
        partial_rotary_factor=mc.rotary_percent,
        rope_parameters=hf_rope_dict(mc.rope_scaling, mc.max_position_embeddings),
        **_mtp_fields(mc),
        **_mixed_and_family_fields(mc),
    )


def _mtp_fields(mc: ModelConfig) -> dict[str, Any]:
    """`mtp_num_layers` (our HF name, mtp.py) when the model has MTP heads; nothing otherwise, so
    configs without heads keep their key set."""
    try:  # in a try block: remote code loads without mcore_rl and must not import it
        from mcore_rl.config.model_keys.mtp import MTPKeys
    except ImportError as err:
        raise ImportError("reading a ModelConfig needs the mcore_rl package") from err
    n = mc.section(MTPKeys).mtp_num_layers
    return dict(mtp_num_layers=n) if n else {}


def _mixed_and_family_fields(mc: ModelConfig) -> dict[str, Any]:
    """HF fields of `model.moe_layer_pattern` and of the model's family (`families.py`), if any."""
    pattern = _sections(mc)[0].moe_layer_pattern if mc.is_moe else None
    out: dict[str, Any] = dict(mlp_only_layers=[i for i, p in enumerate(pattern or []) if not p])
    family = family_named(mc.arch)
    return dict(out, **family.hf_fields(mc)) if family else out


def moe_layer_pattern_of(hf: Any) -> list[int] | None:
    """`model.moe_layer_pattern` of an HF config: None when every layer is MoE (or the model is dense).

    Qwen3-MoE / ours: layer i is MoE iff i not in `mlp_only_layers` and (i+1) % `decoder_sparse_step`
    == 0 (transformers' rule); a stock config of another family: that family's rule.
    """
    n = hf.num_hidden_layers
    family = family_of(hf)
    if family and getattr(hf, "model_type", None) == family.stock_model_type:
        pattern = family.moe_layer_pattern(hf)
    else:
        step, dense = getattr(hf, "decoder_sparse_step", 1) or 1, set(getattr(hf, "mlp_only_layers", None) or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    return None if all(pattern) else pattern


def _windowed(model_type: str | None) -> bool:
    """Whether the config keeps sliding_window only to describe a window it applies on every layer:
    ours, and a stock type whose record says so (Qwen2's needs use_sliding_window, refused by
    `unsupported_stock_fields`)."""
    stock = stock_decoder(model_type)
    return stock.windowed if stock else model_type in OWN_MODEL_TYPES


def model_config_from_hf_config(hf: PretrainedConfig, rope_key: str | None = None) -> ModelConfig:
    """The trainer's `ModelConfig` of an HF config (ours, or stock `Qwen3Config`/`Qwen3MoeConfig`/
    `LlamaConfig`/`Qwen2Config`/`Qwen2MoeConfig`/`MistralConfig`). `mcore_rl.convert.model_config_from_hf`
    also rejects what it cannot map. `rope_key`: how the source file spells RoPE (`rope.rope_key_in_file`),
    kept for export."""
    try:  # in a try block: transformers' remote-code import check skips it (no mcore_rl needed)
        from mcore_rl.config.loader import config_from_dict
        from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
        from mcore_rl.config.schema import ModelConfig, RopeScalingConfig
    except ImportError as err:
        raise ImportError("model_config_from_hf_config needs the mcore_rl package") from err

    family = family_of(hf)
    num_experts = (family.num_experts(hf) if family else getattr(hf, "num_experts", 0)) or 0
    model_type = getattr(hf, "model_type", None)
    stock = stock_decoder(model_type)  # what a stock GQA-decoder config implies (stock_decoders.py)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope_theta = getattr(hf, "rope_theta", None)
    if rope_theta is None:  # transformers 5 stock configs keep it in rope_parameters
        rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    fields: dict[str, Any] = dict(
        arch="qwen3_moe" if num_experts > 0 else "qwen3",
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_attention_heads=heads,
        num_query_groups=hf.num_key_value_heads or heads,
        kv_channels=None if head_dim == hf.hidden_size // heads else head_dim,
        rotary_base=float(rope_theta),
        max_position_embeddings=hf.max_position_embeddings,
        norm_epsilon=hf.rms_norm_eps,
        # Llama has no QK-norm; our config says so explicitly; stock Qwen3 / Qwen3-MoE always have it.
        qk_layernorm=bool(getattr(hf, "use_qk_norm", stock.qk_norm if stock else True)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        init_method_std=getattr(hf, "initializer_range", 0.02),
        num_experts=num_experts,
        moe_router_topk=getattr(hf, "num_experts_per_tok", 2) if num_experts else 2,
        moe_ffn_hidden_size=getattr(hf, "moe_intermediate_size", None) if num_experts else None,
        moe_shared_expert_intermediate_size=(
            (getattr(hf, "shared_expert_intermediate_size", 0) or None) if num_experts else None
        ),
        moe_aux_loss_coeff=float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0) if num_experts else 0.0,
        moe_norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)) if num_experts else True,
        moe_latent_size=(getattr(hf, "moe_latent_size", None) or None) if num_experts else None,
        attn_res=getattr(hf, "attn_res", "none"),
        attn_res_num_blocks=getattr(hf, "attn_res_num_blocks", 8),
        # shard_over_data_parallel is a training layout choice, not part of the HF model
        ngram=NgramEmbeddingConfig(
            orders=list(getattr(hf, "ngram_orders", None) or []),
            table_size=getattr(hf, "ngram_table_size", 0) or 0,
            num_slices=getattr(hf, "ngram_num_slices", 1) or 1,
        ),
        # Qwen2 always has q/k/v biases; Qwen2-MoE says so in qkv_bias and always gates its shared expert.
        add_qkv_bias=bool(getattr(hf, "qkv_bias", stock is not None and stock.qkv_bias)),
        moe_shared_expert_gate=bool(
            getattr(hf, "shared_expert_gate", stock is not None and stock.shared_expert_gate)
            and num_experts
            and getattr(hf, "shared_expert_intermediate_size", 0)
        ),
        sliding_window=(getattr(hf, "sliding_window", None) or None) if _windowed(model_type) else None,
        rope_scaling=RopeScalingConfig(**rope_scaling_fields(hf, rope_key)),
        rotary_percent=partial_rotary_factor_of(hf),
        moe_layer_pattern=moe_layer_pattern_of(hf) if num_experts else None,
        mtp_num_layers=int(getattr(hf, "mtp_num_layers", 0) or 0),  # our MTP heads (mtp.py)
    )
    if family:
        fields.update(family.model_fields(hf))
    return config_from_dict(ModelConfig, fields, "model")


def to_stock_hf_config(cfg: McoreRLConfig, family: str | None = None) -> PretrainedConfig:
    """A stock `transformers.Qwen3Config` (dense), `Qwen3MoeConfig` (MoE) or, without QK-norm,
    `LlamaConfig` (dense) with the same model; with q/k/v biases or a gated shared expert
    `Qwen2Config` / `Qwen2MoeConfig`, with a sliding window `MistralConfig`.

    Stock Qwen3-MoE has no shared expert, so a config with one has no stock equivalent (Qwen2-MoE's
    is gated). `family="mistral"` picks `MistralConfig` for a Llama-shaped model without a window
    (the two are the same model; the source checkpoint's model_type tells which it was).
    """
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if getattr(cfg, "attn_res", "none") != "none":
        raise ValueError("AttnRes (attn_res) has no stock transformers equivalent")
    if getattr(cfg, "ngram_orders", None):
        raise ValueError("Over-Encoding n-gram embeddings (ngram_orders) have no stock transformers equivalent")
    own = family_named(getattr(cfg, "family", "qwen3"))
    if own:
        return own.to_stock(cfg)
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        use_sliding_window=False,
        # the 4.x keyword, which transformers 5 also takes (with rope_theta beside it)
        rope_scaling={k: v for k, v in (rope_scaling_of(cfg) or {}).items() if k != "rope_theta"} or None,
    )
    if any(getattr(cfg, key, None) for key in ("qkv_bias", "shared_expert_gate", "sliding_window")):
        return _qwen2_or_mistral_config(cfg, common)
    if not getattr(cfg, "use_qk_norm", True):
        if family == "mistral" and not cfg.is_moe:
            return _qwen2_or_mistral_config(cfg, common)
        if cfg.is_moe:
            raise ValueError("MoE without QK-norm has no stock transformers equivalent")
        del common["use_sliding_window"]
        return LlamaConfig(**common, mlp_bias=False)
    if not cfg.is_moe:
        return Qwen3Config(**common)
    if cfg.shared_expert_intermediate_size:
        raise ValueError("stock Qwen3-MoE has no shared expert; this config has no stock equivalent")
    if getattr(cfg, "moe_latent_size", None):
        raise ValueError("LatentMoE (moe_latent_size) has no stock transformers equivalent")
    return Qwen3MoeConfig(**common, **_stock_moe_fields(cfg))


def _stock_moe_fields(cfg: McoreRLConfig) -> dict[str, Any]:
    """The routed-expert fields stock Qwen3-MoE and Qwen2-MoE configs share (same names in both),
    with the layer pattern in their `decoder_sparse_step` / `mlp_only_layers`."""
    return dict(
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=cfg.norm_topk_prob,
        router_aux_loss_coef=cfg.router_aux_loss_coef,
        decoder_sparse_step=getattr(cfg, "decoder_sparse_step", 1),
        mlp_only_layers=list(getattr(cfg, "mlp_only_layers", None) or []),
    )


def keep_source_layer_keys(stock: PretrainedConfig, source: dict[str, Any] | None) -> None:
    """Write a Qwen3-MoE / Qwen2-MoE layer pattern with the source checkpoint's own keys (`decoder_sparse_step`,
    `mlp_only_layers`) when they give the same pattern as the ones derived here."""
    record = stock_decoder(getattr(stock, "model_type", None))
    if not source or record is None or not record.layer_pattern_keys or "decoder_sparse_step" not in source:
        return
    theirs = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": stock.num_hidden_layers,
        "decoder_sparse_step": source.get("decoder_sparse_step"),
        "mlp_only_layers": source.get("mlp_only_layers"),
    }
    ours = {
        "model_type": "qwen3_moe",
        "num_hidden_layers": stock.num_hidden_layers,
        "decoder_sparse_step": stock.decoder_sparse_step,
        "mlp_only_layers": stock.mlp_only_layers,
    }
    if moe_layer_pattern_of(PretrainedConfig(**theirs)) == moe_layer_pattern_of(PretrainedConfig(**ours)):
        stock.decoder_sparse_step = theirs["decoder_sparse_step"] or 1
        stock.mlp_only_layers = list(theirs["mlp_only_layers"] or [])


def _qwen2_or_mistral_config(cfg: McoreRLConfig, common: dict[str, Any]) -> PretrainedConfig:
    """`to_stock_hf_config` for Qwen2 (dense, q/k/v biases), Qwen2-MoE (gated shared expert) and
    Mistral (no biases, optional sliding window); all three have no QK-norm."""
    from transformers import MistralConfig, Qwen2Config, Qwen2MoeConfig

    bias, gate, window = cfg.qkv_bias, cfg.shared_expert_gate, cfg.sliding_window
    if cfg.use_qk_norm or cfg.attention_bias or getattr(cfg, "moe_latent_size", None):
        raise ValueError("Qwen2 / Qwen2-MoE / Mistral have no QK-norm, o_proj bias or LatentMoE")
    common = {k: v for k, v in common.items() if k not in ("attention_bias", "use_sliding_window")}
    if not cfg.is_moe and not bias:
        return MistralConfig(**common, sliding_window=window)
    if window:
        raise ValueError("sliding_window: stock Qwen2 / Qwen2-MoE apply a window per layer (max_window_layers)")
    if cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads:
        del common["head_dim"]  # Qwen2 configs have no head_dim field; write one only when it differs
    if not cfg.is_moe:
        return Qwen2Config(**common)
    if not (gate and cfg.shared_expert_intermediate_size):
        raise ValueError("stock Qwen2-MoE always has a shared expert with a gate")
    return Qwen2MoeConfig(
        **common,
        qkv_bias=bias,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        **_stock_moe_fields(cfg),
    )


def unsupported_stock_fields(hf: Any, rope_key: str | None = None) -> list[str]:
    """What of a stock Qwen3 / Qwen3-MoE / Llama config the reference and megatron models cannot
    compute, one `field=value: reason` line each (the converter and the engine refuse on these).
    `rope_key` names the RoPE key as the user's file spells it (`rope.rope_key_in_file`)."""
    problems = []
    family = family_of(hf)
    stock_family = family is not None and getattr(hf, "model_type", None) == family.stock_model_type
    # partial rotary: ours, and a family whose stock class rotates part of each head (its record says)
    partial_ok = getattr(hf, "model_type", None) in OWN_MODEL_TYPES or (
        family is not None and stock_family and family.partial_rotary
    )
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    if getattr(hf, "mlp_bias", False):
        problems.append("mlp_bias=true: MLP biases are not supported")
    for attr in ROPE_KEYS:
        rope = getattr(hf, attr, None)
        if isinstance(rope, dict) and rope:
            key = rope_key or attr
            kind, partial = rope_type_of(rope), rope.get("partial_rotary_factor", 1.0)
            if kind not in SUPPORTED_ROPE_TYPES:
                problems.append(f"{key}.rope_type={kind!r}: supported are {', '.join(SUPPORTED_ROPE_TYPES)}")
            if partial != 1.0 and not partial_ok:
                problems.append(f"{key}.partial_rotary_factor={partial}: only full RoPE is supported")
            break
    if getattr(hf, "partial_rotary_factor", None) not in (None, 1.0) and not partial_ok:
        problems.append(f"partial_rotary_factor={hf.partial_rotary_factor}: only full RoPE is supported")
    if getattr(hf, "use_sliding_window", False):  # Qwen2 / Qwen3: a window on some layers only
        problems.append(
            "use_sliding_window=true: a sliding window on some layers (max_window_layers) is not "
            "supported (a window on every layer is: Mistral's sliding_window)"
        )
    if family is not None and stock_family:
        problems += family.unsupported(hf)
    if getattr(hf, "pretraining_tp", 1) not in (None, 1):
        problems.append(f"pretraining_tp={hf.pretraining_tp}: only 1 is supported")
    return problems
