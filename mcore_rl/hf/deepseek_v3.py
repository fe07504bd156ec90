"""DeepSeek-V3 blocks of the reference model: multi-head latent attention and the sigmoid MoE.

Part of the remote-code modeling files (imports only torch and `.layers`). Parameter names are those
of stock `DeepseekV3ForCausalLM` checkpoints::

    model.layers.{i}.self_attn.q_proj.weight                          (q_lora_rank None)
    model.layers.{i}.self_attn.{q_a_proj,q_a_layernorm,q_b_proj}.weight (q_lora_rank set)
    model.layers.{i}.self_attn.{kv_a_proj_with_mqa,kv_a_layernorm,kv_b_proj,o_proj}.weight
    model.layers.{i}.mlp.gate.weight [E, hidden], model.layers.{i}.mlp.gate.e_score_correction_bias [E]
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight

Routing follows megatron-core's `topk_routing_with_score_function` (which, for the shapes the
converter accepts, is what stock DeepSeek-V3 computes): sigmoid scores; the expert bias is added
only to choose the experts; grouped top-k ranks each group by the sum of its best
`topk // topk_group` biased scores (DeepSeek: the best 2) and searches the best `topk_group` groups;
the chosen (unbiased) scores are renormalised and multiplied by `routed_scaling_factor`.

MLA caches the compressed latent per layer, as transformers does: the cache's (k, v) pair is
(normalised kv latent [b, 1, s, kv_lora_rank], rotated shared key [b, 1, s, qk_rope_head_dim]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Qwen3ReferenceMLP, Qwen3ReferenceRMSNorm, RoutingTap, run_experts


def grouped_topk(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None) -> torch.Tensor:
    """Expert indices [T, k] of the top-k `scores` [T, E], limited to the best `group_topk` groups."""
    if not group_topk:
        return torch.topk(scores, topk, dim=-1).indices
    t, e = scores.shape
    grouped = scores.view(t, num_groups, e // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)
    chosen = torch.topk(group_scores, group_topk, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0).bool()
    mask = mask[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)
    return torch.topk(scores.masked_fill(~mask, float("-inf")), topk, dim=-1).indices


class DeepseekV3ReferenceRouter(nn.Module):
    """`mlp.gate`: router weight and the selection-only expert bias, both fp32 (as stock keeps them)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.num_groups, self.group_topk = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [T, k] fp32, expert ids [T, k]) for tokens x [T, hidden]."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        idx = grouped_topk(scores + self.e_score_correction_bias.float(), self.topk, self.num_groups, self.group_topk)
        probs = scores.gather(1, idx)
        if self.norm_topk_prob and self.topk > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        return probs * self.scaling, idx


class DeepseekV3ReferenceMoeBlock(nn.Module):
    """Sigmoid router, routed experts and always-on shared experts: sum_k p_k * expert_k(x) + shared(x)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = DeepseekV3ReferenceRouter(config)
        self.experts = nn.ModuleList(
            Qwen3ReferenceMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )
        shared = config.shared_expert_intermediate_size
        self.shared_experts = Qwen3ReferenceMLP(config.hidden_size, shared) if shared else None
        self.routing = RoutingTap()  # the engine records the routed experts through it

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, idx = self.gate(x)
        self.routing.routed = idx if self.routing.record else None
        out = run_experts(x, probs, idx, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        # no auxiliary loss: balance comes from the expert bias (aux-loss-free)
        return out.reshape(shape), x.new_zeros((), dtype=torch.float32)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE on pairs (x0, x1), (x2, x3), ... (transformers' `apply_rotary_pos_emb_interleave`):
    the output holds the rotated even entries, then the rotated odd ones. x [b, h, s, d]; cos/sin
    [b, s, d] as `rope_cos_sin` makes them (cat(freqs, freqs))."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half layout (first half / second half paired). x [b, h, s, d]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)


class MLAReferenceAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    bottleneck, keys and values from one compressed latent plus a RoPE key shared by all heads."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.interleave = bool(getattr(config, "rope_interleave", True))
        q_out = self.num_heads * (self.nope + self.rope)
        eps = config.rms_norm_eps
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=False)
            self.q_a_layernorm = Qwen3ReferenceRMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = Qwen3ReferenceRMSNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        allowed: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        q_pass, q_rot, latent, k_rot = self.project(x, cos, sin)
        if past is not None:
            latent, k_rot = torch.cat((past[0], latent), dim=2), torch.cat((past[1], k_rot), dim=2)
        present = (latent, k_rot)
        return self.attend(q_pass, q_rot, latent, k_rot, allowed), present

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, s, hidden] -> (q_pass, q_rot [b, heads, s, .], latent [b, 1, s, kv_lora_rank],
        k_rot [b, 1, s, qk_rope_head_dim]), RoPE applied: what the cache keeps is (latent, k_rot)."""
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(b, s, self.num_heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(b, 1, s, self.kv_lora_rank)
        k_rot = k_rot.view(b, 1, s, self.rope)
        rope = rope_interleaved if self.interleave else rope_half
        return q_pass, rope(q_rot, cos, sin), latent, rope(k_rot, cos, sin)

    def attend(
        self,
        q_pass: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of queries [b, heads, s, .] over the cached latents [b, 1, S, .] -> [b, s, hidden]."""
        b, _, s_k, _ = latent.shape
        kv = self.kv_b_proj(latent).view(b, s_k, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.nope + self.rope) ** -0.5
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
        return self.o_proj(out)
