"""Batched prefill and decode over the reference model's weights, with a paged KV pool.

The reference model's own `forward` concatenates its cache every step, repeats K/V heads for GQA
and runs ~70 small ops per layer; serving a batch wants few, larger kernels. This runner computes
the same function from the same parameters with:

* fused projections: q/k/v are one GEMM and gate/up one GEMM. For a full-precision model the
  module parameters are re-pointed at row slices of the fused tensor (views), so weight loads
  that copy into the named parameters update the fused weight with no extra memory and nothing
  to rebuild; FP8 layers keep e4m3 storage and get a fused dequantized copy in `refresh()`;
* residual adds folded into the output GEMMs (`addmm`), `F.rms_norm`, and RoPE as one
  roll-multiply-add on q and k together;
* grouped-query attention as two batched GEMMs per layer (`baddbmm` with an additive mask,
  `bmm`): the `group` query heads of a KV head read that head's keys directly (query head h reads
  KV head h // group, as in the reference model and megatron); decode gathers each KV head's keys
  of slots 0..B-1 from the paged pool (`PagedKVCache`) in one `index_select`, so its batched GEMMs
  run kv-head-major; the mask ([KV*B, 1, T], broadcast over the group), the pool rows to read and
  the rows the new K/V go to (one `index_copy_` each) are computed once per step, not per layer;
* logits only at the positions a caller asks for.

Numerics follow the reference op for op up to float rounding (scores in the model dtype, an
additive finfo.min mask, softmax in fp32, RMSNorm in fp32); fp32 log-probs agree with the
reference model to ~1e-6. MoE and LatentMoE blocks run through the reference module itself; with
`record_routing(True)` each pass leaves the experts every MoE layer picked in `last_routing`
([rows, layers, k], -1 for dense layers; SGLang's `return_routed_experts`).

Every architecture the trainer supports:

* AttnRes (Full / Block, `config.attn_res`): the layer loop runs through the reference model's
  `DepthState` (`mcore_rl/hf/attn_res.py`): each sublayer's input is the state's depth mix instead of
  the running residual and its output is handed back to the state; the final norm reads
  `state.output()`. The mix is per token, so the KV cache is unchanged. Without AttnRes the residual
  adds stay folded into the output GEMMs;
* Over-Encoding n-gram embeddings (`config.ngram_orders`): inputs are embedded by the reference
  `McoreRLModel.embed`; each slot keeps its last n_max - 1 token ids (`-1` = none) in a
  [slots, n_max - 1] tensor that decode passes as `ngram_context`, shifts by one token per step and
  that moves with the slot's KV (`move`);
* attention without QK-norm (`use_qk_norm=False`, Llama): q and k go straight to RoPE.
* q/k/v biases (Qwen2, `qkv_bias`) ride in the fused QKV GEMM; a gated shared expert (Qwen2-MoE) runs
  in the reference MoE block; a sliding window (Mistral, `sliding_window` W) masks keys older than
  W - 1 positions in prefill and decode, as the reference's `_allowed_mask` does; with `layer_types`
  only on the "sliding_attention" layers (the others attend to every earlier token);
* attention sinks (an attention module with `sinks`, one learned logit per query head): the sink joins
  each row's softmax as one more column and is dropped after it, as in the reference attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcore_rl.hf.attn_res import DepthState
from mcore_rl.hf.modeling import rope_cos_sin
from mcore_rl.hf.rope import rope_scaling_of, rotary_dim

from .fp8 import Fp8Linear, quantize_activation_fp8
from .kv_cache import PagedKVCache


@dataclass
class _Layer:
    """One decoder layer's tensors in the shapes the runner multiplies."""

    module: Any  # the reference decoder layer, read by submodule name (see `ModelRunner.__init__`)
    wqkv: torch.Tensor  # [(H + 2 KV) * D, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    w_gate_up: torch.Tensor | None  # [2 I, hidden]; None for MoE layers
    w_down: torch.Tensor | None
    qk_norm: torch.Tensor | None = None  # [H + KV, D]: q_norm weight for q heads, k_norm for k heads


def _fuse_params(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate `attr` (weight/bias) of `linears` along dim 0 and re-point each at its slice."""
    parts = [getattr(m, attr) for m in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for m, p in zip(linears, parts):
        n = p.shape[0]
        setattr(m, attr, nn.Parameter(fused[offset : offset + n], requires_grad=False))
        offset += n
    return fused


def _fused_weight(linears: list[nn.Linear]) -> torch.Tensor:
    """`_fuse_params` of the weights, which every Linear has."""
    fused = _fuse_params(linears, "weight")
    assert fused is not None
    return fused


def _weight(m: nn.Linear | Fp8Linear) -> torch.Tensor:
    return m.dequantized_weight() if isinstance(m, Fp8Linear) else m.weight


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The reference RMSNorm: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y * weight if weight is not None else y


class ModelRunner:
    def __init__(
        self, model: nn.Module, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        # The runner walks the reference model's module tree by name (model.model.layers[i].self_attn...):
        # torch types every submodule attribute as `Tensor | Module` and HF configs' keys are dynamic,
        # so the tree and its config are read untyped here; `model` itself is checked at the call.
        tree: Any = model.model
        cfg: Any = model.config
        self.model, self._tree = model, tree
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.group = self.num_heads // self.kv_heads
        self.head_dim = cfg.head_dim
        self.hidden_size = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.dtype, self.device = dtype, device
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", True))
        self.sliding_window = getattr(cfg, "sliding_window", None)  # Mistral: keys j > i - W only
        # which layers the window applies to: every one, or those `layer_types` calls "sliding_attention"
        layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
        self.windowed = [bool(self.sliding_window) and t == "sliding_attention" for t in layer_types]
        # A family's attention that caches one latent entry per token (multi-head latent attention,
        # hf/<family>.py) says how wide it is (`cache_entry_width`); the pool keeps it as a single
        # "KV head" that all query heads read, and the module projects and attends (`_latent_attention`).
        first_attention = tree.layers[0].self_attn
        self.latent_cache = hasattr(first_attention, "cache_entry_width")
        if self.latent_cache:
            self.kv_heads, self.group, self.use_qk_norm = 1, self.num_heads, False
        self.attn_res = getattr(cfg, "attn_res", "none") != "none"
        ngram = getattr(tree, "ngram_embeddings", None)
        self.ngram_context_size = ngram.context_size if ngram is not None else 0
        # Over-Encoding: the last n_max - 1 token ids of each slot (-1 = none), the decode context.
        self.ngram_context = (
            torch.full((num_slots, self.ngram_context_size), -1, dtype=torch.long, device=device)
            if ngram is not None
            else None
        )
        self.kv_entry = first_attention.cache_entry_width if self.latent_cache else self.head_dim
        self.num_slots, self.max_len = num_slots, max_len
        self.cache: PagedKVCache | None = None  # `allocate_cache`, once the engine has sized the pool
        positions = torch.arange(max_len, device=device)[None]
        self.rotary_dim = rotary_dim(cfg)  # partial rotary (< head_dim): the first channels turn
        cos, sin = rope_cos_sin(positions, self.rotary_dim, cfg.rope_theta, dtype, rope_scaling_of(cfg))
        half = self.rotary_dim // 2
        # rotate_half(x) * sin == roll(x, D/2) * [-sin[:D/2], sin[D/2:]]
        self._cos = cos[0]
        self._sin_signed = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        self._positions = torch.arange(max_len, device=device)
        self.fp8 = any(isinstance(m, Fp8Linear) for m in model.modules())
        if self.fp8 and self.latent_cache:
            raise ValueError(
                "the embedded engine's FP8 mode does not cover multi-head latent attention (a latent KV cache)"
            )
        self.layers = [self._plan(layer) for layer in tree.layers]
        # routing replay (SGLang's return_routed_experts): the MoE blocks' taps, None for dense layers
        self.routing_taps = [getattr(layer.mlp, "routing", None) for layer in tree.layers]
        self.routing_topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.last_routing: torch.Tensor | None = None  # [rows, layers, k] int32 of the last pass, -1 = dense
        # MTP drafts (drafts.py: MTPDrafter): every pass's final-normed hidden state per slot and
        # position, [slots, max_len, hidden]; None = not kept (`keep_hidden`)
        self.hidden: torch.Tensor | None = None
        self.last_normed: torch.Tensor | None = None  # [B, s, hidden] of the last `extend`
        self.refresh()

    def keep_hidden(self) -> torch.Tensor:
        """Keep the final-normed hidden state of every position each pass computes (what MTP heads
        read); returns the [slots, max_len, hidden] store."""
        if self.hidden is None:
            self.hidden = torch.zeros(
                self.num_slots, self.max_len, self.hidden_size, dtype=self.dtype, device=self.device
            )
        return self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer (a latent cache keeps its entry in both)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.kv_heads * self.kv_entry * elem

    def allocate_cache(self, max_tokens: int) -> PagedKVCache:
        """The KV pool of `max_tokens` tokens (sequences up to `max_len` each)."""
        self.cache = PagedKVCache(
            len(self.layers),
            self.num_slots,
            self.kv_heads,
            self.kv_entry,
            max_tokens,
            self.max_len,
            self.dtype,
            self.device,
        )
        return self.cache

    @property
    def kv(self) -> PagedKVCache:
        if self.cache is None:
            raise RuntimeError("the KV pool is not allocated yet (call allocate_cache first)")
        return self.cache

    def _plan(self, layer: Any) -> _Layer:  # a decoder layer of the tree above
        attn, mlp = layer.self_attn, layer.mlp
        dense = hasattr(mlp, "gate_proj")
        if self.latent_cache:  # attention runs through the reference module (`_latent_attention`)
            w_gate_up = _fused_weight([mlp.gate_proj, mlp.up_proj]) if dense else None
            return _Layer(
                layer,
                torch.empty(0),
                None,
                attn.o_proj.weight,
                None,
                w_gate_up,
                mlp.down_proj.weight if dense else None,
            )
        proj = [attn.q_proj, attn.k_proj, attn.v_proj]
        if self.fp8:  # fused dequantized copies come from refresh()
            empty = torch.empty(0)
            return _Layer(layer, empty, None, empty, None, empty if dense else None, empty if dense else None)
        return _Layer(
            module=layer,
            wqkv=_fused_weight(proj),
            bqkv=_fuse_params(proj, "bias"),
            wo=attn.o_proj.weight,
            bo=attn.o_proj.bias,
            w_gate_up=_fused_weight([mlp.gate_proj, mlp.up_proj]) if dense else None,
            w_down=mlp.down_proj.weight if dense else None,
        )

    def refresh(self) -> None:
        """Rebuild what is derived from weights (QK-norm tables; FP8 fused dequantized weights).
        Call after loading weights."""
        h, kv = self.num_heads, self.kv_heads
        for lay in self.layers:
            attn, mlp = lay.module.self_attn, lay.module.mlp
            if self.use_qk_norm:
                lay.qk_norm = torch.cat((attn.q_norm.weight.expand(h, -1), attn.k_norm.weight.expand(kv, -1)), dim=0)
            if self.fp8:
                proj = [attn.q_proj, attn.k_proj, attn.v_proj]
                lay.wqkv = torch.cat([_weight(m) for m in proj], dim=0)
                lay.bqkv = None if attn.q_proj.bias is None else torch.cat([m.bias for m in proj], dim=0)
                lay.wo, lay.bo = _weight(attn.o_proj), attn.o_proj.bias
                if lay.w_gate_up is not None:
                    lay.w_gate_up = torch.cat((_weight(mlp.gate_proj), _weight(mlp.up_proj)), dim=0)
                    lay.w_down = _weight(mlp.down_proj)
                for m in (
                    *proj,
                    attn.o_proj,
                    *([mlp.gate_proj, mlp.up_proj, mlp.down_proj] if lay.w_gate_up is not None else []),
                ):
                    m._dequantized = None  # the fused copies above are the ones in use

    def drop_derived(self) -> None:
        """Free what `refresh()` derives from the weights (QK-norm tables, FP8 fused dequantized
        copies), for a weight release; the next `refresh()` rebuilds them."""
        empty = torch.empty(0, device=self.device)
        for lay in self.layers:
            lay.qk_norm = None
            if self.fp8:
                lay.wqkv, lay.bqkv, lay.wo = empty, None, empty
                if lay.w_gate_up is not None:
                    lay.w_gate_up = lay.w_down = empty
        for m in self.model.modules():
            if isinstance(m, Fp8Linear):
                m._dequantized = None

    def move(self, src: int, dst: int) -> None:
        """Move slot `src`'s state (its KV pages, its n-gram context) to `dst`, whose pages are freed."""
        self.kv.move(src, dst)
        if self.ngram_context is not None:
            self.ngram_context[dst] = self.ngram_context[src]
        if self.hidden is not None:
            self.hidden[dst] = self.hidden[src]

    # ---- one layer -------------------------------------------------------------------------

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        """A GEMM input: rounded to e4m3 per token per 128 channels in FP8 mode."""
        return quantize_activation_fp8(x) if self.fp8 else x

    def _out(
        self, residual: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
    ) -> torch.Tensor:
        """residual + x @ w.T (+ b), the add fused into the GEMM; without a residual x @ w.T (+ b)."""
        if residual is None:
            return F.linear(self._act(x), w, b)
        out = torch.addmm(residual, self._act(x), w.t())
        return out + b if b is not None else out

    def _attention(
        self,
        li: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        b: int,
        s: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        decode_at: tuple[torch.Tensor, torch.Tensor] | None,
        prefill_at: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [b*s, hidden] -> (residual +) attention(input_layernorm(x)). `decode_at` = (pool rows
        to write, pool rows to read [b, T]) for a decode step (s == 1, keys from the pool); None for
        a prefill, whose K/V go to `prefill_at` (the pool rows of slots slot0..)."""
        if self.latent_cache:
            return self._latent_attention(li, x, residual, b, s, cos, sin, bias, decode_at, prefill_at)
        lay = self.layers[li]
        layer = lay.module
        H, KV, G, D = self.num_heads, self.kv_heads, self.group, self.head_dim
        qkv = F.linear(self._act(_rms(x, layer.input_layernorm.weight, self.eps)), lay.wqkv, lay.bqkv)
        qkv = qkv.view(b, s, H + 2 * KV, D)
        qk = qkv[:, :, : H + KV]
        if lay.qk_norm is not None:
            qk = _rms(qk, None, self.eps) * lay.qk_norm
        R = self.rotary_dim
        if R == D:
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)
        else:  # partial rotary: the rest of each head passes unrotated
            rot = qk[..., :R]
            qk = torch.cat((torch.addcmul(rot * cos, rot.roll(R // 2, dims=-1), sin), qk[..., R:]), dim=-1)
        q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + KV :]
        if decode_at is not None:
            write, read = decode_at
            self.kv.write_decode(li, write, k.reshape(b * s, KV, D), v.reshape(b * s, KV, D))
            keys, vals = self.kv.gather(li, read)  # [KV*b, T, D]
            if s == 1:
                q3 = q.reshape(b, KV, G, D).transpose(0, 1).reshape(KV * b, G, D)
            else:  # `extend`: s new tokens per slot, kv-head-major as decode
                q3 = q.reshape(b, s, KV, G, D).permute(2, 0, 3, 1, 4).reshape(KV * b, G * s, D)
        else:
            assert prefill_at is not None  # a prefill always names its pool rows
            k4, v4 = k.transpose(1, 2), v.transpose(1, 2)  # [b, KV, s, D]
            self.kv.write_prefill(li, prefill_at, k4, v4)
            keys, vals = k4.reshape(b * KV, s, D), v4.reshape(b * KV, s, D)
            q3 = q.reshape(b, s, KV, G, D).permute(0, 2, 3, 1, 4).reshape(b * KV, G * s, D)
        scores = torch.baddbmm(bias, q3, keys.transpose(1, 2), alpha=self.scale)
        sinks = getattr(layer.self_attn, "sinks", None)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        else:  # one more column per row: its query head's sink logit (rows as q3 lays them out)
            per_head = sinks.float().view(KV, G)
            if decode_at is None:
                column = per_head[None, :, :, None].expand(b, KV, G, s)
            else:
                column = per_head[:, None, :, None].expand(KV, b, G, s)
            scores = torch.cat((scores.float(), column.reshape(b * KV, G * s, 1)), dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1].to(vals.dtype)
        o = torch.bmm(probs, vals)  # [b*KV, G*s, D] (decode: [KV*b, G, D])
        if decode_at is None:
            o = o.view(b, KV, G, s, D).permute(0, 3, 1, 2, 4)
        elif s == 1:
            o = o.view(KV, b, G, D).transpose(0, 1)
        else:
            o = o.view(KV, b, G, s, D).permute(1, 3, 0, 2, 4)
        return self._out(residual, o.reshape(b * s, H * D), lay.wo, lay.bo)

    def _latent_attention(
        self,
        li: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        b: int,
        s: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bias: torch.Tensor,
        decode_at: tuple[torch.Tensor, torch.Tensor] | None,
        prefill_at: torch.Tensor | None,
    ) -> torch.Tensor:
        """`_attention` for a latent cache (MLA), through the reference module's `project` / `attend`; the cache row
        of a token is cat(latent, k_rot). cos / sin_signed come in this runner's layout (first halves:
        cos, -sin of each frequency); the bias rows are those of one KV head with G = heads."""
        attn = self.layers[li].module.self_attn
        h = _rms(x, self.layers[li].module.input_layernorm.weight, self.eps).view(b, s, self.hidden_size)
        q_pass, q_rot, latent, k_rot = attn.project(h, cos[:, :, 0], -sin[:, :, 0])
        entry = torch.cat((latent, k_rot), dim=-1)  # [b, 1, s, r + dr]
        if decode_at is not None:  # decode (s == 1) or `extend` (s new tokens per slot)
            write, read = decode_at
            length = read.shape[1]
            rows = entry[:, 0].reshape(b * s, 1, -1)  # slot-major, as the pool's write rows
            self.kv.write_decode(li, write, rows, rows)
            entry = self.kv.gather(li, read)[0].view(b, 1, length, -1)  # one KV head: [b, 1, T, r + dr]
            allowed = bias.view(b, -1, s, length)[:, :1] == 0  # the rows of one query head serve all
        else:
            assert prefill_at is not None  # a prefill always names its pool rows
            self.kv.write_prefill(li, prefill_at, entry, entry)
            allowed = bias.view(b, self.num_heads, s, s) == 0
        latent, k_rot = attn.split_cache_entry(entry)
        out = attn.attend(q_pass, q_rot, latent, k_rot, allowed).reshape(b * s, self.hidden_size)
        return out if residual is None else residual + out

    def _mlp(self, li: int, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """(residual +) mlp(post_attention_layernorm(x))."""
        lay = self.layers[li]
        h2 = _rms(x, lay.module.post_attention_layernorm.weight, self.eps)
        if lay.w_gate_up is None:  # MoE / LatentMoE block (returns its aux loss too)
            out = lay.module.mlp(h2)[0]
            return out if residual is None else residual + out
        gu = F.linear(self._act(h2), lay.w_gate_up)
        inter = gu.shape[-1] // 2
        assert lay.w_down is not None  # a dense layer has both
        return self._out(residual, F.silu(gu[:, :inter]) * gu[:, inter:], lay.w_down, None)

    def _decoder(
        self,
        x: torch.Tensor,
        b: int,
        s: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        biases: tuple[torch.Tensor, torch.Tensor],
        decode_at: tuple[torch.Tensor, torch.Tensor] | None,
        prefill_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The embedding [b*s, hidden] through every decoder layer, before the final norm; `biases`
        = (full, windowed) masks, each layer reading the one of its kind (`self.windowed`)."""
        if not self.attn_res:  # plain residual stream, the adds folded into the output GEMMs
            for li in range(len(self.layers)):
                bias = biases[self.windowed[li]]
                x = self._attention(li, x, x, b, s, cos, sin, bias, decode_at, prefill_at)
                x = self._mlp(li, x, x)
            return x
        state = DepthState(self._tree, x)  # AttnRes: depth mixes instead of residual sums
        for li in range(len(self.layers)):
            bias = biases[self.windowed[li]]
            state.add(self._attention(li, state.input(li, 0), None, b, s, cos, sin, bias, decode_at, prefill_at))
            state.add(self._mlp(li, state.input(li, 1), None))
        return state.output()

    def _mask_bias(self, allowed: torch.Tensor) -> torch.Tensor:
        """allowed [b, sq, sk] -> additive bias [b*KV, G*sq, sk] (0 or finfo.min), shared by all layers."""
        b, sq, sk = allowed.shape
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return (
            bias[:, None, None]
            .expand(b, self.kv_heads, self.group, sq, sk)
            .reshape(b * self.kv_heads, self.group * sq, sk)
        )

    def _extend_bias(self, allowed: torch.Tensor, length: int) -> torch.Tensor:
        """allowed [b, s, T] -> additive bias [KV*b, G*s, T], kv-head-major as decode."""
        b, s, _ = allowed.shape
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return (
            bias[None, :, None]
            .expand(self.kv_heads, b, self.group, s, length)
            .reshape(self.kv_heads * b, self.group * s, length)
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self._final_norm(hidden))

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms(hidden, self._tree.norm.weight, self.eps)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed hidden states (the output layer alone)."""
        head: Any = self.model.lm_head  # the tree's modules by name (see `__init__`)
        return F.linear(normed, head.weight).float()

    # ---- routing replay ----------------------------------------------------------------------

    @property
    def has_moe(self) -> bool:
        return any(t is not None for t in self.routing_taps)

    def record_routing(self, on: bool) -> None:
        """Keep (or stop keeping) the experts every MoE layer picks in the next passes."""
        for tap in self.routing_taps:
            if tap is not None:
                tap.record, tap.routed = on, None
        self.last_routing = None

    def _collect_routing(self, rows: int) -> None:
        """After a pass over `rows` token rows: [rows, layers, k] int32 expert ids, -1 for dense layers."""
        taps = self.routing_taps
        if not any(t is not None and t.record for t in taps):
            self.last_routing = None
            return
        out = torch.full((rows, len(taps), self.routing_topk), -1, dtype=torch.int32)
        for li, tap in enumerate(taps):
            if tap is not None and tap.routed is not None:
                out[:, li] = tap.routed.reshape(rows, -1).to("cpu", torch.int32)
                tap.routed = None
        self.last_routing = out

    # ---- passes ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slot0: int, logit_rows: list[tuple[int, int]]) -> torch.Tensor:
        """Run prompts (right-padded into one batch) into slots slot0.., whose pages must hold
        them (`PagedKVCache.reserve`); fp32 logits [N, V] at the (row, position) pairs of
        `logit_rows`, in that order (none: only the cache is written)."""
        b = len(prompts)
        s = max(len(t) for t in prompts)
        rows = self.kv.prefill_rows(slot0, [len(t) for t in prompts], s)
        ids = torch.zeros(b, s, dtype=torch.long)
        for i, t in enumerate(prompts):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        ids = ids.to(self.device)
        lens = torch.tensor([len(t) for t in prompts], device=self.device)
        pos = self._positions[:s]
        allowed = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])  # [b, s, s]
        full = self._mask_bias(allowed)
        windowed = full
        if any(self.windowed):
            assert self.sliding_window is not None  # a windowed layer has a window
            windowed = self._mask_bias(allowed & (pos[None, :] > pos[:, None] - self.sliding_window)[None])
        cos, sin = self._cos[None, :s, None], self._sin_signed[None, :s, None]
        if self.ngram_context is not None:
            # Right padding follows the prompt, and n-grams only look back: padding changes nothing.
            x = self._tree.embed(ids, pos.expand(b, s)).view(b * s, self.hidden_size)
            c = self.ngram_context_size
            tails = [([-1] * c + t)[len(t) :] for t in prompts]  # the last c tokens, -1 where none
            self.ngram_context[slot0 : slot0 + b] = torch.tensor(tails, dtype=torch.long).view(b, c).to(self.device)
        else:
            x = self._tree.embed_tokens(ids).view(b * s, self.hidden_size)
        x = self._decoder(x, b, s, cos, sin, (full, windowed), None, rows)
        self._collect_routing(b * s)  # row r * s + c: prompt r, position c
        if self.hidden is not None:  # right padding lands past each prompt: rewritten before it is read
            self.hidden[slot0 : slot0 + b, :s] = self._final_norm(x).view(b, s, -1)
        flat = torch.tensor([r * s + c for r, c in logit_rows], dtype=torch.long, device=self.device)
        return self._logits(x[flat])

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of slots 0..B-1 at its position (= tokens already cached; the slot's
        pages must hold position + 1 tokens); fp32 logits [B, V]."""
        b = len(tokens)
        length = max(positions) + 1
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        # [b*KV, 1, length]: the G query heads of a KV head share their row (baddbmm broadcasts it)
        full = torch.zeros(b, length, dtype=self.dtype, device=self.device)
        full.masked_fill_(self._positions[None, :length] > pos[:, None], torch.finfo(self.dtype).min)
        windowed = full
        if any(self.windowed):  # cached keys older than the window
            assert self.sliding_window is not None  # a windowed layer has a window
            outside = self._positions[None, :length] <= pos[:, None] - self.sliding_window
            windowed = full.masked_fill(outside, torch.finfo(self.dtype).min)
        full, windowed = (
            m[None, :, None].expand(self.kv_heads, b, 1, length).reshape(self.kv_heads * b, 1, length)
            for m in (full, windowed)
        )
        cos, sin = self._cos[pos][:, None, None], self._sin_signed[pos][:, None, None]
        if self.ngram_context is not None:
            ctx = self.ngram_context[:b]
            x = self._tree.embed(ids[:, None], pos[:, None], ngram_context=ctx)[:, 0]
            self.ngram_context[:b] = torch.cat((ctx[:, 1:], ids[:, None]), dim=1)
        else:
            x = self._tree.embed_tokens(ids)
        at = self.kv.decode_rows(pos, length)  # pool rows to write and to read, shared by all layers
        x = self._decoder(x, b, 1, cos, sin, (full, windowed), at)
        self._collect_routing(b)
        if self.hidden is None:
            return self._logits(x)
        normed = self._final_norm(x)
        self.hidden[torch.arange(b, device=self.device), pos] = normed
        return self.head(normed)

    @torch.inference_mode()
    def extend(
        self, tokens: list[list[int]], positions: list[int], inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Slots 0..B-1 each run `tokens[i]` (at least one) from position `positions[i]` on (= tokens
        already cached; the slot's pages must hold positions[i] + len(tokens[i])), reading their cached
        K/V and each other causally: decode of several tokens at once, the pass that verifies a
        speculative draft. fp32 logits [B, s, V], s the longest row (a shorter row's tail is padding).
        `inputs_embeds` [B, s, hidden]: the layers' input instead of the tokens' embeddings (an MTP
        head's projected input, drafts.py); `last_normed` then holds the final-normed output."""
        if self.ngram_context is not None:
            raise ValueError(
                "speculative decoding: the embedded engine's multi-token pass does not cover n-gram embeddings"
            )
        b = len(tokens)
        s = max(len(t) for t in tokens)
        ids = torch.zeros(b, s, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        ids = ids.to(self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        counts = torch.tensor([len(t) for t in tokens], dtype=torch.long, device=self.device)
        write, read = self.kv.extend_rows(pos, counts, s)
        length = read.shape[1]
        qpos = pos[:, None] + torch.arange(s, device=self.device)[None]  # [b, s]
        keys = self._positions[None, None, :length]
        allowed = keys <= qpos[:, :, None]  # [b, s, T]
        in_window = allowed
        if any(self.windowed):
            assert self.sliding_window is not None  # a windowed layer has a window
            in_window = allowed & (keys > qpos[:, :, None] - self.sliding_window)
        full, windowed = (self._extend_bias(a, length) for a in (allowed, in_window))
        qpos = qpos.clamp(max=self.max_len - 1)  # padding past the context reads the last table row
        cos, sin = self._cos[qpos][:, :, None], self._sin_signed[qpos][:, :, None]
        if inputs_embeds is None:
            x = self._tree.embed_tokens(ids).view(b * s, self.hidden_size)
        else:
            x = inputs_embeds.to(self.dtype).reshape(b * s, self.hidden_size)
        x = self._decoder(x, b, s, cos, sin, (full, windowed), (write, read))
        self._collect_routing(b * s)  # row i * s + t: slot i, position positions[i] + t
        normed = self._final_norm(x)
        self.last_normed = normed.view(b, s, -1)
        if self.hidden is not None:  # a shorter row's padding lands past its tokens: rewritten before read
            self.hidden[torch.arange(b, device=self.device)[:, None], qpos] = self.last_normed
        return self.head(normed).view(b, s, -1)
