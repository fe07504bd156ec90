"""Building blocks shared by the reference model's modules (modeling, attn_res, latent_moe).

They live here so that those modules import this one instead of each other: the relative imports
of the remote-code files form a DAG. Part of the remote-code modeling files: imports only torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class ReferenceRMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (HF Qwen3 order of operations)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class ReferenceMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, topk: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing as megatron-core's `TopKRouter` (score_function="softmax").

    norm_topk_prob=True  (moe_router_pre_softmax=False): top-k on logits, softmax over the k picked.
    norm_topk_prob=False (moe_router_pre_softmax=True):  softmax over all experts, keep the top k.
    Returns (probs [T, k] in fp32, expert indices [T, k]).
    """
    if norm_topk_prob:
        top_logits, idx = torch.topk(logits, topk, dim=-1)
        return torch.softmax(top_logits.float(), dim=-1), idx
    probs, idx = torch.topk(torch.softmax(logits.float(), dim=-1), topk, dim=-1)
    return probs, idx


def load_balancing_loss(logits: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """One layer's load-balancing loss as megatron-core 0.16.1 adds it (type "aux_loss", one rank).

    With T tokens (every token of the micro-batch, b*s), E experts, p = softmax(logits) over all E
    experts in fp32 (whatever the routing mode), and n_i = number of tokens whose top-k (of p)
    contains expert i:

        aux = coeff * E / (k * T**2) * sum_i n_i * sum_t p[t, i]
            = coeff * E * sum_i f_i * P_i,   f_i = n_i / (k*T),  P_i = mean_t p[t, i]

    (`compute_routing_scores_for_aux_loss` + `switch_load_balancing_loss_func`, unfused, no padding
    mask, `calculate_per_token_loss=False`). T is the micro-batch's token count (all TP/CP shards of
    it together), not the global batch. Only p carries gradient (through the router and everything
    upstream of it). megatron does not add `aux` to the loss value: `MoEAuxLossAutoScaler` attaches it
    to the router probs and its backward injects d(aux) * `cp_size / num_microbatches` (the main loss
    is divided by num_microbatches too), so for one micro-batch without CP the gradients are those of
    `lm_loss + sum_layers aux`. It only does so when training with grad enabled; this reference
    always computes it. megatron logs `load_balancing_loss` = mean over layers of aux / coeff.
    """
    num_tokens, num_experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    top_idx = torch.topk(probs, topk, dim=-1).indices
    tokens_per_expert = torch.zeros_like(probs).scatter(1, top_idx, 1.0).sum(0)
    return (probs.sum(0) * tokens_per_expert).sum() * (num_experts * coeff / (topk * num_tokens * num_tokens))


def moe_dispatch(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    experts: nn.ModuleList | Sequence[nn.Module],
    topk: int,
    norm_topk_prob: bool,
    forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k p_k * expert_k(token) per row of `tokens` [T, h], routed by `logits` [T, E] (`route`).

    The one expert loop of the MoE blocks (plain and latent, where `tokens` is the latent input):
    each expert runs on the rows that picked it, weighted by their probability in the tokens' dtype.
    `forced` [T, k] (routing replay): rows whose first entry is >= 0 use those experts instead of
    their top-k, with the probabilities megatron-core's `RouterReplay` gives them (the scores of
    `route` gathered at the forced ids); rows of -1 route as usual. Returns (output, the expert ids
    used [T, k]).
    """
    probs, idx = route(logits, topk, norm_topk_prob)
    if forced is not None:
        forced = forced.to(device=idx.device, dtype=idx.dtype)
        rows = forced[:, 0] >= 0
        if bool(rows.any()):
            idx = torch.where(rows[:, None], forced, idx)
            if norm_topk_prob:
                replayed = torch.softmax(logits.gather(1, idx).float(), dim=-1)
            else:
                replayed = torch.softmax(logits.float(), dim=-1).gather(1, idx)
            probs = torch.where(rows[:, None], replayed, probs)
    return run_experts(tokens, probs, idx, experts), idx


def run_experts(
    tokens: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor, experts: nn.ModuleList | Sequence[nn.Module]
) -> torch.Tensor:
    """sum_k probs[t, k] * experts[idx[t, k]](tokens[t]): each expert runs on the rows that picked it,
    weighted in the tokens' dtype."""
    probs = probs.to(tokens.dtype)
    out = torch.zeros_like(tokens)
    for e, expert in enumerate(experts):
        rows_e, slot = torch.where(idx == e)
        if rows_e.numel():
            out.index_add_(0, rows_e, expert(tokens[rows_e]) * probs[rows_e, slot, None])
    return out


class RoutingTap:
    """What an MoE block exposes for routing replay (SGLang's `return_routed_experts`).

    `record`: keep the expert ids of the last forward in `routed` ([T, k], the embedded engine reads
    them after each pass); `forced`: [T, k] ids to route by instead (rows of -1 route as usual), used
    to check the trainer's replay against this reference model."""

    def __init__(self) -> None:
        self.record = False
        self.routed: torch.Tensor | None = None
        self.forced: torch.Tensor | None = None

    def dispatch(
        self,
        tokens: torch.Tensor,
        logits: torch.Tensor,
        experts: nn.ModuleList | Sequence[nn.Module],
        topk: int,
        norm_topk_prob: bool,
    ) -> torch.Tensor:
        out, idx = moe_dispatch(tokens, logits, experts, topk, norm_topk_prob, self.forced)
        self.routed = idx if self.record else None
        return out


def is_moe_layer(config: object, layer: int) -> bool:
    """Whether layer `layer` (0-based) of an HF config has an MoE MLP: the transformers Qwen3-MoE
    rule (not in `mlp_only_layers`, and (layer + 1) % `decoder_sparse_step` == 0) on our config."""
    if not getattr(config, "num_experts", 0):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


def moe_aux_loss(logits: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """`load_balancing_loss` of one MoE layer, or a zero fp32 scalar without grad when coeff is 0."""
    if coeff > 0:
        return load_balancing_loss(logits, topk, coeff)
    return logits.new_zeros((), dtype=torch.float32)
