"""Pure-PyTorch reference model of every family here (`McoreRLForCausalLM`), written to Hugging Face
conventions: Qwen3 / Qwen3-MoE and what differs from them as config fields (Llama 3, Qwen2, Mistral,
LatentMoE, AttnRes, n-gram embeddings); a family of `families.py` brings its own attention and MoE.

This is the oracle the megatron-core models are tested against, the model inside the embedded
inference engine and the target of checkpoint export, so it favours directness over speed:
attention is an explicit matmul + fp32 softmax, experts run in a plain loop. The blocks it shares
with attn_res.py and latent_moe.py (RMSNorm, SwiGLU MLP, routing, the expert loop) live in
layers.py, which all three import, so the modules import each other without a cycle.

Parameter names are exactly those of stock HF Qwen3 / Qwen3-MoE *checkpoints*::

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.{i}.input_layernorm.weight, model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, model.layers.{i}.self_attn.{q,k}_norm.weight
    dense: model.layers.{i}.mlp.{gate,up,down}_proj.weight
    MoE:   model.layers.{i}.mlp.gate.weight                          (router, [E, hidden])
           model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight
           model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight  (optional; not in stock Qwen3-MoE)
           model.layers.{i}.mlp.shared_expert_gate.weight [1, hidden]     (Qwen2-MoE's gate, optional)
    Qwen2 (qkv_bias): + model.layers.{i}.self_attn.{q,k,v}_proj.bias; Mistral (sliding_window): no new weights
    LatentMoE (latent_moe.py): + model.layers.{i}.mlp.fc1_latent_proj.weight [l, hidden] (W_down),
           model.layers.{i}.mlp.fc2_latent_proj.weight [hidden, l] (W_up); experts work in l
    AttnRes (attn_res.py): + model.layers.{i}.{attn_res,mlp_res}.{query,norm.weight} and
           model.final_res.{query,norm.weight} (pseudo-query and key norm of each depth mix)
    Over-Encoding (ngram.py): + model.ngram_embeddings.tables.{n}.{i}.weight [m, w_n] and
           model.ngram_embeddings.projections.{n}.{i}.weight [hidden, w_n] (order n, slice i)

Stock `transformers>=5` `Qwen3MoeForCausalLM` keeps experts *fused* in its `state_dict`
(`mlp.experts.gate_up_proj` [E, 2*I, H] = per expert cat(gate, up) on dim 0, and
`mlp.experts.down_proj` [E, H, I]) and converts the per-expert checkpoint names on load;
`to_stock_state_dict` / `from_stock_state_dict` do that conversion for in-memory state dicts.

Conventions (megatron-style, documented because they differ from HF's `forward`):

* `labels[b, t]` is the target of position t (already shifted; no shift happens here). The loss is
  the mean token cross-entropy over positions where `loss_mask` is 1 (and `labels != -100`).
* `attention_mask` is None (plain causal), a [b, s_k] 0/1 padding mask (1 = real token) or a boolean
  [b, 1, s_q, s_k] mask with True = may attend (e.g. block-diagonal for packed documents). It is
  always intersected with the causal mask. Packed documents also need restarting `position_ids`,
  and left-padded rows need positions that start at their first real token; pass them explicitly.
* `cache` (alias `past_key_values`) is a `transformers` `Cache` (a `DynamicCache` by default, what
  `generate` passes), or a legacy list with one `(k, v)` per layer, each [b, kv_heads, s_past,
  head_dim] (keys after QK-norm and RoPE); with `use_cache=True` the output's `cache` (also readable
  as `.past_key_values`) holds the extended cache (cache.py). Default positions continue from s_past.
* The rest of transformers' forward keywords work as in stock models (`GenerationMixin.generate`
  passes them): `inputs_embeds`, `logits_to_keep`, `output_hidden_states`, `return_dict`; others
  that `generate` may add (`cache_position`) are accepted and unused.
* `aux_loss` is megatron-core's load-balancing loss, see `load_balancing_loss`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .attn_res import AttnResMixer, attn_res_decoder_forward
from .cache import layer_pasts, new_cache, ngram_context_of, past_length, store_presents
from .configuration import McoreRLConfig, to_stock_hf_config
from .families import family_named
from .latent_moe import ReferenceLatentMoeBlock
from .mtp import MTPHeads
from .layers import (  # route, load_balancing_loss: unused here, imported from here by callers
    KVCache,
    ReferenceMLP,
    ReferenceRMSNorm,
    RoutingTap,
    is_moe_layer,
    moe_aux_loss,
)
from .layers import load_balancing_loss as load_balancing_loss  # re-exported (hf/__init__, remote code)
from .layers import route as route  # re-exported
from .ngram import McoreRLNgramEmbeddings, NgramKVCache, next_ngram_context
from .rope import rope_inv_freq, rope_scaling_of, rotary_dim

try:  # transformers>=5: init functions that skip weights already loaded from a checkpoint
    from transformers import initialization as _init
except ImportError:  # pragma: no cover - transformers 4.x
    from torch.nn import init as _init  # type: ignore[no-redef]  # the same functions under torch's module


# The cache field is called `cache`, as in transformers>=5 outputs (whose ModelOutput renames a
# `past_key_values=` keyword to `cache`); `.past_key_values` reads the same thing.
@dataclass
class McoreRLModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    cache: Any | None = None  # a transformers Cache, or the extended legacy list (cache.py)
    aux_loss: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self) -> Any | None:
        return self.cache


@dataclass
class McoreRLCausalLMOutput(ModelOutput):
    """Like `CausalLMOutputWithPast`, plus `aux_loss`: the sum over layers of `load_balancing_loss`
    (already times the coefficient; a zero tensor without grad for dense models or coefficient 0).
    `loss` is the LM loss alone; `loss + aux_loss` has megatron's gradients."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any | None = None  # a transformers Cache, or the extended legacy list (cache.py)
    aux_loss: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self) -> Any | None:
        return self.cache


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [b, s, head_dim] for the non-interleaved (rotate_half) RoPE, computed in fp32;
    `scaling` is the config's RoPE scaling dict (`rope.rope_scaling_of`; None = plain RoPE)."""
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]; cos/sin [b, s, r]: the first r channels rotate, the rest pass (partial
    rotary, r < d: GLM-4.5, megatron-core's rotary_percent)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < x.shape[-1]:
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)
    return x * cos + rotate_half(x) * sin


class ReferenceAttention(nn.Module):
    """GQA self-attention with per-head QK RMSNorm applied before RoPE (none if not `use_qk_norm`)."""

    def __init__(self, config: McoreRLConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        bias = config.attention_bias
        qkv_bias = bias or getattr(config, "qkv_bias", False)  # Qwen2: q/k/v biases, none on o_proj
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        if getattr(config, "use_qk_norm", True):
            self.q_norm: nn.Module = ReferenceRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm: nn.Module = ReferenceRMSNorm(self.head_dim, config.rms_norm_eps)
        else:  # Llama-style attention: no QK-norm (and no parameters for it)
            self.q_norm = self.k_norm = nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        present = (k, v)
        # Query head h reads kv head h // group (consecutive heads share a group, as in megatron).
        group = self.num_heads // self.num_kv_heads
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k_rep.transpose(-1, -2)) * self.head_dim**-0.5
        # finfo.min rather than -inf: a fully masked row (left padding) gives no NaN. A sliding-window
        # layer of a transformers cache holds only its window: the mask's last columns are its keys.
        scores = scores.masked_fill(~allowed[..., -k.shape[2] :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v_rep).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out), present


class ReferenceSparseMoeBlock(nn.Module):
    """Router + experts (+ optional shared expert): y = sum_k p_k * expert_k(x) + g(x) * shared(x),
    g = 1, or sigmoid(shared_expert_gate(x)) with `shared_expert_gate` (Qwen2-MoE)."""

    def __init__(self, config: McoreRLConfig) -> None:
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.aux_loss_coef = config.router_aux_loss_coef
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            ReferenceMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        shared = config.shared_expert_intermediate_size
        self.shared_expert = ReferenceMLP(config.hidden_size, shared) if shared else None
        gated = shared and getattr(config, "shared_expert_gate", False)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if gated else None
        self.routing = RoutingTap()  # routing replay: record / force the experts (layers.py)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        out = self.routing.dispatch(x, logits, self.experts, self.topk, self.norm_topk_prob)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(shape), moe_aux_loss(logits, self.topk, self.aux_loss_coef)


class ReferenceDecoderLayer(nn.Module):
    """One layer; `layer_idx` picks its MLP kind in a model with mixed dense/MoE layers
    (`layers.is_moe_layer`); a family of families.py brings its own attention and MoE block."""

    def __init__(self, config: McoreRLConfig, layer_idx: int = 0) -> None:
        super().__init__()
        family = family_named(getattr(config, "family", "qwen3"))
        own_attention = family.attention if family else None  # None: the GQA decoder's
        self.self_attn = own_attention(config) if own_attention else ReferenceAttention(config)
        moe = is_moe_layer(config, layer_idx)
        if moe and family:
            self.mlp: nn.Module = family.moe_block(config)
        elif moe and getattr(config, "moe_latent_size", None):
            self.mlp = ReferenceLatentMoeBlock(config)
        elif moe:
            self.mlp = ReferenceSparseMoeBlock(config)
        else:
            self.mlp = ReferenceMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ReferenceRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ReferenceRMSNorm(config.hidden_size, config.rms_norm_eps)
        if getattr(config, "attn_res", "none") != "none":  # AttnRes: depth mixers (attn_res.py)
            self.attn_res = AttnResMixer(config.hidden_size, config.rms_norm_eps)
            self.mlp_res = AttnResMixer(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        attn, present = self.self_attn(self.input_layernorm(x), cos, sin, allowed, past)
        x = x + attn
        mlp = self.mlp(self.post_attention_layernorm(x))
        aux = None
        if isinstance(mlp, tuple):
            mlp, aux = mlp
        return x + mlp, present, aux


def _allowed_mask(
    attention_mask: torch.Tensor | None,
    s: int,
    past_len: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean [b|1, 1, s, past_len+s]: True where query (at past_len+i) may attend key j; with a
    `sliding_window` W only the W keys j > i - W (HF's window, counted in cache positions)."""
    q = torch.arange(past_len, past_len + s, device=device)[:, None]
    k = torch.arange(past_len + s, device=device)[None, :]
    allowed = (k <= q)[None, None]
    if sliding_window:
        allowed = allowed & (k > q - sliding_window)[None, None]
    if attention_mask is None:
        return allowed
    if attention_mask.dim() == 2:
        return allowed & attention_mask.bool()[:, None, None, :]
    if attention_mask.dim() == 4:
        return allowed & attention_mask.bool()
    shape = tuple(attention_mask.shape)
    raise ValueError(f"attention_mask must be [b, s_k] or [b, 1, s_q, s_k], got {shape}")


class McoreRLPreTrainedModel(PreTrainedModel):
    config_class: type[McoreRLConfig] = McoreRLConfig
    base_model_prefix = "model"
    _no_split_modules = ["ReferenceDecoderLayer"]
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """normal(0, initializer_range) for linear and embedding weights, ones for norms."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                _init.zeros_(cast(torch.Tensor, module.bias))  # a Linear's bias, present (checked above)
        elif isinstance(module, ReferenceRMSNorm):
            _init.ones_(module.weight)
        elif isinstance(module, AttnResMixer):  # zero pseudo-queries: uniform depth weights
            _init.zeros_(module.query)
        elif callable(own_init := getattr(module, "init_reference_weights", None)):  # a family's own module
            own_init(_init, std)


class McoreRLModel(McoreRLPreTrainedModel):
    """Embedding, decoder layers, final norm."""

    def __init__(self, config: McoreRLConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Over-Encoding (ngram.py): hashed n-gram embeddings added to embed_tokens; None = off.
        orders = getattr(config, "ngram_orders", None)
        self.ngram_embeddings = McoreRLNgramEmbeddings(config) if orders else None
        self.layers = nn.ModuleList(ReferenceDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ReferenceRMSNorm(config.hidden_size, config.rms_norm_eps)
        attn_res = getattr(config, "attn_res", "none") != "none"  # AttnRes: the output's depth mix
        self.final_res = AttnResMixer(config.hidden_size, config.rms_norm_eps) if attn_res else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:  # type: ignore[override]  # transformers types it nn.Module; this model's input embedding is an nn.Embedding
        self.embed_tokens = value

    def embed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        ngram_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Input embeddings: `embed_tokens`, plus the n-gram embeddings with Over-Encoding (which
        need the positions and, when decoding, the preceding tokens `ngram_context`, see ngram.py)."""
        x = self.embed_tokens(input_ids)
        if self.ngram_embeddings is not None:
            x = x + self.ngram_embeddings(input_ids, position_ids, ngram_context).to(x.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
        ngram_context: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> McoreRLModelOutput:
        """`cache` (the transformers>=5 name) and `past_key_values` are aliases (module doc).
        `ngram_context` ([b, c] tokens before `input_ids`, -1 = none) overrides the one the cache
        carries. `output_hidden_states`: the input of every layer, then the final normed output."""
        _refuse_unsupported(kwargs)
        past = past_key_values if past_key_values is not None else cache
        if use_cache and past is None:
            past = new_cache(self.config)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        given = input_ids if input_ids is not None else inputs_embeds
        assert given is not None  # exactly one of them was passed (checked above)
        b, s = given.shape[:2]
        device = given.device
        past_len, pasts = past_length(past), layer_pasts(past)
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + s, device=device).expand(b, s)
        if ngram_context is None:
            ngram_context = ngram_context_of(past)
        if inputs_embeds is None:
            assert input_ids is not None  # exactly one of them was passed (checked above)
            x = self.embed(input_ids, position_ids, ngram_context)
        else:
            x = inputs_embeds
        cos, sin = rope_cos_sin(
            position_ids, rotary_dim(self.config), self.config.rope_theta, x.dtype, rope_scaling_of(self.config)
        )
        window = getattr(self.config, "sliding_window", None)
        # `layer_types` (transformers' name): the window only on the "sliding_attention" layers
        layer_types = getattr(self.config, "layer_types", None)
        allowed = _allowed_mask(attention_mask, s, past_len, device, None if layer_types else window)
        windowed = _allowed_mask(attention_mask, s, past_len, device, window) if layer_types else allowed
        masks = [windowed if not layer_types or t == "sliding_attention" else allowed for t in layer_types or []]
        presents: KVCache = []
        hidden: list[torch.Tensor] = []
        aux_loss = x.new_zeros((), dtype=torch.float32)
        if self.final_res is not None:  # AttnRes: attention over depth instead of residual sums
            hidden.append(x)  # layer inputs are depth mixes, not one residual stream: only the embedding
            x, presents, aux_loss = attn_res_decoder_forward(self, x, cos, sin, allowed, pasts)
        else:
            for i, layer in enumerate(self.layers):
                hidden.append(x)
                x, present, aux = layer(x, cos, sin, masks[i] if masks else allowed, pasts[i] if pasts else None)
                presents.append(present)
                if aux is not None:
                    aux_loss = aux_loss + aux
        out_cache = store_presents(past, presents, s) if use_cache else None
        if use_cache and self.ngram_embeddings is not None:  # the cache keeps the last n-1 tokens
            assert input_ids is not None, (
                "an n-gram model's cache needs input_ids (not inputs_embeds) to carry its n-gram context"
            )
            context = next_ngram_context(ngram_context, input_ids, self.ngram_embeddings.context_size)
            if isinstance(out_cache, list):
                out_cache = NgramKVCache(out_cache, context)
            else:
                assert out_cache is not None  # use_cache: store_presents built it
                out_cache.ngram_context = context
        x = self.norm(x)
        return McoreRLModelOutput(
            last_hidden_state=x,
            cache=out_cache,
            aux_loss=aux_loss,
            hidden_states=(*hidden, x) if output_hidden_states else None,
        )


def _refuse_unsupported(kwargs: dict[str, Any]) -> None:
    """transformers' forward keywords this model does not implement fail loudly when asked for."""
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions=True: the reference model does not return attention weights")
    unknown = sorted(set(kwargs) - {"output_attentions", "cache_position", "return_dict"})
    if unknown:
        raise TypeError(f"unexpected keyword arguments {unknown}")


# transformers 5 ties through a {target: source} dict, transformers 4 through a list of targets.
_TIED = (
    {"lm_head.weight": "model.embed_tokens.weight"}
    if int(transformers.__version__.split(".")[0]) >= 5
    else ["lm_head.weight"]
)


class McoreRLForCausalLM(McoreRLPreTrainedModel, GenerationMixin):
    """Causal LM head on `McoreRLModel`; megatron-style labels and loss mask (module doc).
    `GenerationMixin` gives it `generate` (with a `DynamicCache`), as stock transformers models."""

    _tied_weights_keys = _TIED  # type: ignore[assignment]  # transformers 4 takes a list here; the installed 5.x annotates only the dict

    def __init__(self, config: McoreRLConfig) -> None:
        super().__init__(config)
        self.model = McoreRLModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # MTP draft heads (mtp.py), one decoder layer each past the model's; 0 = none
        n, mtp_layers = config.num_hidden_layers, int(getattr(config, "mtp_num_layers", 0) or 0)
        self.mtp = (
            MTPHeads(
                [ReferenceDecoderLayer(config, n + d) for d in range(mtp_layers)],
                config.hidden_size,
                config.rms_norm_eps,
            )
            if mtp_layers
            else None
        )
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:  # type: ignore[override]  # transformers types it nn.Module; this model's input embedding is an nn.Embedding
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
        ngram_context: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> McoreRLCausalLMOutput | tuple:
        """Logits [b, s, vocab]; `loss` when labels are given (labels[t] = target of position t).

        `cache` / `past_key_values` and `ngram_context`: see `McoreRLModel.forward`.
        `logits_to_keep`: an int k keeps the last k positions (0 = all), a tensor the positions it
        lists (as in stock transformers). `return_dict=False` returns the output's tuple.
        """
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            past_key_values=past_key_values if past_key_values is not None else cache,
            use_cache=use_cache,
            attention_mask=attention_mask,
            ngram_context=ngram_context,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(out.last_hidden_state[:, keep])
        loss = None
        if labels is not None:
            loss = masked_token_loss(logits, labels, loss_mask)
        result = McoreRLCausalLMOutput(
            loss=loss, logits=logits, cache=out.cache, aux_loss=out.aux_loss, hidden_states=out.hidden_states
        )
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return result if return_dict else result.to_tuple()

    def mtp_logits(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The policy's logits [b, s, V] and each MTP depth's [b, s, V] over whole sequences (no
        cache): depth d's row t predicts token t + d + 1 (mtp.py)."""
        if self.mtp is None:
            raise ValueError("mtp_logits: the model has no MTP heads (config.mtp_num_layers is 0)")
        out = self.model(input_ids=input_ids, position_ids=position_ids)
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        hidden = out.last_hidden_state
        cos, sin = rope_cos_sin(
            position_ids, rotary_dim(self.config), self.config.rope_theta, hidden.dtype, rope_scaling_of(self.config)
        )
        allowed = _allowed_mask(None, s, 0, input_ids.device, getattr(self.config, "sliding_window", None))

        def run_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return layer(x, cos, sin, allowed)[0]

        depths = self.mtp(hidden, input_ids, self.model.embed_tokens, run_layer)
        return self.lm_head(hidden), [self.lm_head(h) for h in depths]


def masked_token_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """sum_t mask[t] * CE(logits[t], labels[t]) / sum_t mask[t], in fp32; labels == -100 are masked too."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    mask = (labels.flatten() != -100).float()
    if loss_mask is not None:
        mask = mask * loss_mask.flatten().float()
    return (ce * mask).sum() / mask.sum().clamp_min(1.0)


# ---- stock transformers Qwen3-MoE state dict <-> checkpoint (per-expert) names ------------------


def _stock_moe_is_fused(config: McoreRLConfig) -> bool:
    """Whether the installed stock `Qwen3MoeForCausalLM` stores experts fused (transformers>=5)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as stock

    family = family_named(getattr(config, "family", "qwen3"))
    if family:
        return family.stock_experts_fused(config)
    with torch.device("meta"):
        block = stock.Qwen3MoeSparseMoeBlock(
            cast(stock.Qwen3MoeConfig, to_stock_hf_config(config))
        )  # MoE: a Qwen3MoeConfig
    return any(name == "experts.gate_up_proj" for name, _ in block.named_parameters())


def to_stock_state_dict(state_dict: dict[str, torch.Tensor], config: McoreRLConfig) -> dict[str, torch.Tensor]:
    """Our (= HF checkpoint) names -> the names the installed stock class's `state_dict` uses.

    Dense models and transformers 4.x: unchanged. transformers>=5 Qwen3-MoE: per layer,
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I].
    """
    stacked = _stacked_expert_tensors(config)
    if stacked:
        return _stack_experts(state_dict, stacked)
    if not config.is_moe or not _stock_moe_is_fused(config):
        return dict(state_dict)
    out = {k: v for k, v in state_dict.items() if ".mlp.experts." not in k}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in state_dict:  # a dense layer of a mixed model
            continue
        names = ("gate", "up", "down")
        w = [{n: state_dict[f"{p}.{j}.{n}_proj.weight"] for n in names} for j in range(config.num_experts)]
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat((x["gate"], x["up"])) for x in w])
        out[f"{p}.down_proj"] = torch.stack([x["down"] for x in w])
    return out


def from_stock_state_dict(state_dict: dict[str, torch.Tensor], config: McoreRLConfig) -> dict[str, torch.Tensor]:
    """Inverse of `to_stock_state_dict`: split fused experts back into per-expert checkpoint names."""
    stacked = _stacked_expert_tensors(config)
    if stacked:
        return unstack_experts(state_dict, stacked)
    fused = (".experts.gate_up_proj", ".experts.down_proj")
    out = {k: v for k, v in state_dict.items() if not k.endswith(fused)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.gate_up_proj" not in state_dict:
            continue
        gate_up, down = state_dict[f"{p}.gate_up_proj"], state_dict[f"{p}.down_proj"]
        for j in range(gate_up.shape[0]):
            gate, up = gate_up[j].chunk(2, dim=0)
            out[f"{p}.{j}.gate_proj.weight"] = gate
            out[f"{p}.{j}.up_proj.weight"] = up
            out[f"{p}.{j}.down_proj.weight"] = down[j]
    return out


# ---- a family whose stock checkpoints stack expert tensors (`ModelFamily.stacked_expert_tensors`) ----


def _stacked_expert_tensors(config: McoreRLConfig) -> tuple[str, ...]:
    family = family_named(getattr(config, "family", "qwen3"))
    return family.stacked_expert_tensors if family else ()


def _stack_experts(state_dict: dict[str, torch.Tensor], stacked: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`mlp.experts.{j}.<name>` -> `mlp.experts.<name>` [E, ...] for each stacked `name`."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state_dict.items():
        head, sep, tail = key.partition(".mlp.experts.")
        expert, _, name = tail.partition(".")
        if sep and expert.isdigit() and name in stacked:
            parts.setdefault(f"{head}.mlp.experts.{name}", {})[int(expert)] = value
        else:
            out[key] = value
    for key, by_expert in parts.items():
        out[key] = torch.stack([by_expert[j] for j in range(len(by_expert))])
    return out


def unstack_experts(state_dict: Mapping[str, torch.Tensor], stacked: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Inverse of `_stack_experts`: `mlp.experts.<name>` [E, ...] -> `mlp.experts.{j}.<name>`."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        head, sep, name = key.partition(".mlp.experts.")
        if sep and name in stacked:
            out.update({f"{head}.mlp.experts.{j}.{name}": value[j] for j in range(value.shape[0])})
        else:
            out[key] = value
    return out
