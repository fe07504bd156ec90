"""Build megatron-core GPT models (one chunk per virtual pipeline stage) from the config tree."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_rl.config.model_keys.latent_moe import LatentMoEKeys
from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig, ParallelConfig
from mcore_rl.models import attn_res, megatron_fixes, rope_scaling, sliding_window
from mcore_rl.models.family import megatron_family
from mcore_rl.models.mtp import add_mtp_heads
from mcore_rl.models.ngram_embedding import add_ngram_embedding
from mcore_rl.models.spec import decoder_block_spec
from mcore_rl.models.vocab_padding import install_vocab_padding, padded_vocab_size

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str = "fp32",
    recompute: str = "none",
) -> TransformerConfig:
    """The megatron-core `TransformerConfig` for a Qwen3(-MoE) decoder in the given layout."""
    experts = model.section(MoEKeys)
    dtype = _DTYPES[precision]
    family = megatron_family(model)  # a family's own attention and router (models/<family>.py)
    moe: dict = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=experts.num_experts,
            moe_router_topk=experts.moe_router_topk,
            moe_ffn_hidden_size=experts.moe_ffn_hidden_size or model.ffn_hidden_size,
            moe_shared_expert_intermediate_size=experts.moe_shared_expert_intermediate_size,
            moe_aux_loss_coeff=experts.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if experts.moe_aux_loss_coeff > 0 else "none",
            # Qwen3-MoE renormalises the top-k probabilities: softmax over the selected logits.
            moe_router_pre_softmax=not experts.moe_norm_topk_prob,
            moe_token_dispatcher_type=experts.moe_token_dispatcher_type,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_permute_fusion=False,
            moe_latent_size=model.section(LatentMoEKeys).moe_latent_size,  # LatentMoE: see models/latent_moe.py
            moe_shared_expert_gate=experts.moe_shared_expert_gate,  # Qwen2-MoE
        )
        if experts.moe_layer_pattern is not None:  # mixed layers: spec.decoder_block_spec reads the list
            moe["moe_layer_freq"] = [int(p) for p in experts.moe_layer_pattern]
        if family is not None:
            moe.update(family.moe_kwargs(model))
    recompute_kwargs: dict = {}
    if recompute == "full":
        recompute_kwargs = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        recompute_kwargs = dict(recompute_granularity="selective")
    on_cpu = not torch.cuda.is_available()
    own_rope = family is not None and family.rope_in_attention  # e.g. MLA's RoPE: GPTModel builds none
    if family is not None:
        config_class, family_fields = family.transformer_config(model)
    else:
        config_class, family_fields = rope_scaling.transformer_config_class(model), {}  # YaRN: + yarn_*
    fields = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        qk_layernorm=model.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,  # Qwen2
        window_size=sliding_window.window_size(model),  # Mistral
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        attention_softmax_in_fp32=True,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=on_cpu,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        # gloo matches point-to-point messages between two ranks in posting order; megatron-core's
        # batched p2p posts send_prev before send_next, which crosses the streams when a 2-stage
        # ring with virtual stages sends both ways to the same peer. The unbatched path orders
        # them by rank parity and uses a second group for the other direction.
        batch_p2p_comm=not on_cpu,
        # Losses are token sums divided by the global token count in finalize_model_grads; the MoE
        # router reads this flag at construction to scale its aux loss to match.
        calculate_per_token_loss=True,
        **moe,
        **recompute_kwargs,
        **({} if own_rope else rope_scaling.transformer_config_kwargs(model)),
    )
    return config_class(**{**fields, **family_fields})  # a family's fields replace the decoder's


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str = "fp32",
    recompute: str = "none",
    config: TransformerConfig | None = None,
) -> list[GPTModel]:
    """This rank's model chunks: one per virtual pipeline stage (a list of one without VPP).

    Requires `mcore_rl.parallel.setup.init_model_parallel` to have run.
    """
    megatron_fixes.apply()
    sliding_window.apply()  # windowed attention keeps the packed-document mask
    config = config or transformer_config(model, parallel, precision, recompute)
    vpp = parallel.virtual_pipeline_model_parallel_size
    family = megatron_family(model)
    own_rope = family is not None and family.rope_in_attention  # the family's attention builds its RoPE
    rope_kwargs = dict(position_embedding_type="rope") if own_rope else rope_scaling.gpt_model_kwargs(model)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        block_spec = decoder_block_spec(config, vp_stage=stage, family=family)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=attn_res.deferred_spec(block_spec, model),  # AttnRes: see below
            vocab_size=padded_vocab_size(
                model.vocab_size, model.make_vocab_size_divisible_by, parallel.tensor_model_parallel_size
            ),
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            rotary_base=int(model.rotary_base),
            vp_stage=stage,
            **rope_kwargs,  # position_embedding_type; linear's interpolation
        )
        if not own_rope:
            rope_scaling.configure_rotary_embedding(chunk, model)  # Llama 3.x frequencies; no-op otherwise
        attn_res.install_decoder(chunk, block_spec, model)  # AttnRes block; no-op without AttnRes
        add_ngram_embedding(chunk, model)  # Over-Encoding n-gram tables (first stage); no-op without
        install_vocab_padding(chunk, model.vocab_size)  # padded logits masked; no-op without padding
        add_mtp_heads(chunk, model, config, family)  # MTP draft heads (last stage); no-op without
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks
