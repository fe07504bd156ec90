"""Log-probs and entropy of given tokens from a megatron-core GPTModel, without full logits.

RL needs log π(y_t) of the *sampled* token (and often the entropy) at every position. The naive
route, `log_softmax(hidden @ W.T)`, holds fp32 [tokens × vocab] tensors: 4.9 GB for 8k tokens and
a 150k vocabulary, several times over in backward. Here the output projection, the softmax
statistics and their gradients are computed per chunk of tokens by one autograd Function
(`_VocabParallelTokenStats`) that keeps only per-token scalars (log-sum-exp, E[z]) between forward
and backward and recomputes each chunk's logits in backward. Peak extra memory is one
[chunk × vocab/TP] fp32 buffer for log-probs alone, two with the entropy, plus the output-weight
gradient (which any method needs). The price is one more output-layer matmul (the recompute).

Tensor parallelism: each TP rank holds a vocabulary shard of the output weight
(`ColumnParallelLinear`). Like megatron-core's `vocab_parallel_cross_entropy`, the max, the
sum of exponentials, the target logit and Σ e^z·z are all-reduced over the TP group (a few floats
per token); the full vocabulary is never gathered on one rank. The hidden states enter through the
same region op the output layer would use (all-gather over sequence-parallel ranks, or an identity
whose backward all-reduces), so gradients reach the hidden states and the weight shard exactly as
with megatron-core's own output layer.

Pipeline parallelism: the statistics are computed on the last stage inside megatron-core's
schedule — `make_forward_step` builds the `forward_step` that `train.forward_backward` takes.

Context parallelism is not exercised: megatron-core's CP runs inside transformer-engine attention,
which does not exist on CPU, and the config rejects CP>1 without it. The computation is per token
and needs only TP collectives, so under CP it applies to each rank's local tokens as long as the
labels are split the same way as the tokens (megatron's load-balanced CP split); untested.

Temperature: logits are divided by `temperature` before the softmax, matching engines that report
log-probs of the temperature-scaled distribution they sampled from.

Sampling-mask replay: with `mask_ids` / `mask_counts` (per token, the ids of the support S the
engine drew it from, flat), the softmax of a token with a non-empty S is taken over S only —
log π(y) = z_y − log Σ_{i∈S} e^{z_i}, the entropy −Σ_{i∈S} p_i log p_i — as the engine's processed
log-probs are. Per chunk each rank builds a [chunk × vocab/TP] bool mask from the ids inside its
shard (the target is always kept), sets the logits outside it to −inf, and the same max / Σe^z /
Σe^z·z all-reduces follow; masked entries get probability 0 and gradient 0 (the z·p products are
taken with z zeroed there, so no −inf·0). Tokens without S (prompt positions, no mask) use the
full vocabulary. Extra memory: one bool [chunk × vocab/TP] buffer and the flat ids.

Only where they are needed: with `token_mask` (per token, whether its statistics are wanted; the
micro-batch key `stats_mask`, which `train/packing.py` sets to the trainable response tokens) the
hidden states of the other tokens — the prompt, and in a multi-turn episode the observations, tool
results and template text between the model's turns — never enter the output projection: the kept
rows are selected before the chunked statistics (forward and the backward recompute) and the
results scattered back, 0 elsewhere. The values and gradients at the kept tokens are unchanged
(tested against the full computation, also at TP=2); the output-layer work and its [chunk × vocab]
buffers scale with the kept tokens instead of all of them. Every TP rank selects the same rows (the
micro-batch is replicated over TP), so the all-reduces still pair up.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from mcore_rl.models.vocab_padding import padded_columns_from

if TYPE_CHECKING:  # annotations only: megatron-core is imported after the CPU compatibility layer patched it
    from megatron.core.models.gpt import GPTModel

Batch = dict[str, torch.Tensor]

# Default size of one [chunk × local vocab] fp32 buffer (two are live at the peak with entropy).
DEFAULT_CHUNK_BYTES = 128 * 2**20


def auto_chunk_size(local_vocab: int, max_chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one fp32 [chunk × local_vocab] buffer fits in `max_chunk_bytes`."""
    return max(1, max_chunk_bytes // (4 * local_vocab))


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs (as megatron's cross entropy); fp64 stays fp64 (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _VocabParallelTokenStats(torch.autograd.Function):
    """(logprob, entropy) per token from hidden [n, h] and a vocab shard of the output weight.

    Forward saves only per-token log-sum-exp and E_p[z]; backward recomputes each chunk's logits:
      d logp / dz_j = 1[j = y] - p_j,      d H / dz_j = -p_j (z_j - E_p[z]),
    with z = logits / T, then chains through 1/T into the hidden states and the weight. The
    hidden-state gradient returned here is this shard's partial sum; the region op in front of it
    (all-reduce / reduce-scatter in backward) adds the other shards' parts.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        topk_ids: torch.Tensor,
        vocab_start: int,
        inv_temp: float,
        chunk_size: int,
        with_entropy: bool,
        group: dist.ProcessGroup | None,
        mask_ids: torch.Tensor | None = None,
        mask_offsets: torch.Tensor | None = None,
        pad_from: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        local_vocab = weight.shape[0]
        pad_from = local_vocab if pad_from is None else pad_from  # local columns >= pad_from: vocabulary padding
        acc = _acc_dtype(hidden)
        local_t = targets - vocab_start
        in_shard = (local_t >= 0) & (local_t < local_vocab)
        local_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))
        k = topk_ids.shape[1]
        local_k = topk_ids - vocab_start
        in_k = (local_k >= 0) & (local_k < local_vocab)
        local_k = torch.where(in_k, local_k, torch.zeros_like(local_k))
        topk_logp = torch.empty(n, k, dtype=acc, device=hidden.device)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        entropy = torch.zeros(n, dtype=acc, device=hidden.device)
        lse = torch.empty_like(logp)
        mean_z = torch.zeros_like(logp)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            z = (hidden[s:e] @ weight.t()).to(acc)
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            z[:, pad_from:] = float("-inf")  # padded ids: never in the normaliser
            drop = None
            if mask_ids is not None:
                assert mask_offsets is not None  # ids and offsets come together
                drop = _drop_mask(mask_ids, mask_offsets, s, e, local_t, in_shard, vocab_start, local_vocab)
                if drop is not None:
                    z.masked_fill_(drop, float("-inf"))
            zmax = z.max(dim=-1).values
            _all_reduce(zmax, dist.ReduceOp.MAX, group)
            z.sub_(zmax[:, None])
            target_z = z.gather(1, local_t[s:e, None]).squeeze(1)
            target_z = torch.where(in_shard[s:e], target_z, torch.zeros_like(target_z))
            topk_z = z.gather(1, local_k[s:e]) * in_k[s:e] if k else None  # the ids in this shard
            if with_entropy:
                ez = torch.exp(z)
                if drop is not None:  # e^z·z with z = 0 where masked: 0, not 0·(−inf)
                    z.masked_fill_(drop, 0.0)
                z[:, pad_from:] = 0.0
                stats = torch.stack([ez.sum(dim=-1), target_z, ez.mul_(z).sum(dim=-1)])  # Σe^z, z_y, Σe^z·z
                del ez
            else:  # one [chunk × vocab] buffer: exponentiate in place
                stats = torch.stack([z.exp_().sum(dim=-1), target_z])
            del z
            if topk_z is not None:  # one all-reduce for both: rows of stats, then the [chunk, k] block
                rows = stats.shape[0]
                both = torch.cat([stats.reshape(-1), topk_z.reshape(-1)])
                _all_reduce(both, dist.ReduceOp.SUM, group)
                stats, topk_z = both[: rows * (e - s)].view(rows, e - s), both[rows * (e - s) :].view(e - s, k)
            else:
                _all_reduce(stats, dist.ReduceOp.SUM, group)
            log_sum = stats[0].log()
            logp[s:e] = stats[1] - log_sum
            if topk_z is not None:
                topk_logp[s:e] = topk_z - log_sum[:, None]
            lse[s:e] = log_sum + zmax
            if with_entropy:
                ez_mean = stats[2] / stats[0]
                entropy[s:e] = log_sum - ez_mean
                mean_z[s:e] = ez_mean + zmax
        ctx.save_for_backward(hidden, weight, local_t, in_shard, lse, mean_z, local_k, in_k)
        ctx.inv_temp, ctx.chunk_size, ctx.with_entropy = inv_temp, chunk_size, with_entropy
        ctx.mask = (mask_ids, mask_offsets, vocab_start)  # tensors that need no gradient, and an int
        ctx.pad_from = pad_from
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logp, entropy, topk_logp

    @staticmethod
    def backward(
        ctx: Any,
        grad_logp: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
        grad_topk: torch.Tensor | None,
    ):
        hidden, weight, local_t, in_shard, lse, mean_z, local_k, in_k = ctx.saved_tensors
        mask_ids, mask_offsets, vocab_start = ctx.mask
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        inv_temp = ctx.inv_temp
        acc = _acc_dtype(hidden)
        if grad_logp is None:
            grad_logp = torch.zeros(n, dtype=acc, device=hidden.device)
        use_entropy = ctx.with_entropy and grad_entropy is not None
        use_topk = grad_topk is not None and grad_topk.numel() > 0
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        rows = torch.arange(n, device=hidden.device)
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            z = (hidden[s:e] @ weight.t()).to(acc)
            if inv_temp != 1.0:
                z.mul_(inv_temp)
            z[:, ctx.pad_from :] = float("-inf")  # padded ids: p = 0
            drop = None
            if mask_ids is not None:
                drop = _drop_mask(mask_ids, mask_offsets, s, e, local_t, in_shard, vocab_start, weight.shape[0])
                if drop is not None:
                    z.masked_fill_(drop, float("-inf"))  # p = 0 there
            gl = grad_logp[s:e].to(acc)
            gk = None
            if use_topk:  # d log p_v / dz_j = 1[j = v] - p_j: the -p_j parts add up with the target's
                assert grad_topk is not None  # use_topk says so
                gk = grad_topk[s:e].to(acc) * in_k[s:e]
                gl_all = gl + grad_topk[s:e].to(acc).sum(-1)
            else:
                gl_all = gl
            if use_entropy:  # z is still needed: p in a second buffer
                p = torch.sub(z, lse[s:e, None]).exp_()
            else:
                p = z.sub_(lse[s:e, None]).exp_()
            if use_entropy:
                # g = -p * (gl + gH * (z - E[z])), built in place in z
                if drop is not None:  # p = 0 there; a finite z keeps the product 0
                    z.masked_fill_(drop, 0.0)
                z[:, ctx.pad_from :] = 0.0
                assert grad_entropy is not None  # use_entropy says so
                ge = grad_entropy[s:e].to(acc)
                z.sub_(mean_z[s:e, None]).mul_(ge[:, None]).add_(gl_all[:, None]).mul_(p).neg_()
                g = z
            else:
                g = p.mul_(-gl_all[:, None])
            g[rows[: e - s], local_t[s:e]] += gl * in_shard[s:e]
            if gk is not None:
                g.scatter_add_(1, local_k[s:e], gk)
            if inv_temp != 1.0:
                g.mul_(inv_temp)
            if grad_hidden is not None:
                grad_hidden[s:e] = g.to(hidden.dtype) @ weight
            if grad_weight is not None:  # in place: `+= g.t() @ h` would allocate a weight-sized temporary per chunk
                grad_weight.addmm_(g.t(), hidden[s:e].to(acc))
            del z, p, g
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None, None, None


def _drop_mask(
    mask_ids: torch.Tensor,
    offsets: torch.Tensor,
    s: int,
    e: int,
    local_t: torch.Tensor,
    in_shard: torch.Tensor,
    vocab_start: int,
    local_vocab: int,
) -> torch.Tensor | None:
    """[e-s, local_vocab] bool: True where a token of rows s..e-1 drops that vocabulary entry of this
    shard — all but its support's ids inside the shard and its target; nothing for rows without a
    support. None when no row of the chunk has one."""
    lo, hi = int(offsets[s]), int(offsets[e])
    counts = offsets[s + 1 : e + 1] - offsets[s:e]
    if hi == lo:
        return None
    ids = mask_ids[lo:hi].long() - vocab_start
    rows = torch.repeat_interleave(torch.arange(e - s, device=ids.device), counts)
    inside = (ids >= 0) & (ids < local_vocab)
    drop = (counts > 0)[:, None].expand(e - s, local_vocab).clone()
    drop.view(-1)[(rows * local_vocab + ids)[inside]] = False
    r = torch.arange(e - s, device=ids.device)
    drop[r[in_shard[s:e]], local_t[s:e][in_shard[s:e]]] = False  # the sampled token is in S; never −inf
    return drop


def vocab_parallel_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy, per token, from hidden [n, h] and this rank's vocab shard.

    `weight` is the [vocab/TP, h] shard of TP rank r (rows r·V/TP … (r+1)·V/TP); `targets` [n] are
    global token ids. `hidden` must already be replicated over TP with the right backward (see
    `tp_region`); with `tp_group=None` the shard is the whole vocabulary. Returns fp32 [n] tensors;
    the entropy is zeros (and not differentiable) when `with_entropy` is False. `vocab_size`: the
    true size of a padded vocabulary (see `vocab_parallel_topk_stats`).
    """
    logp, ent, _ = vocab_parallel_topk_stats(
        hidden, weight, targets, None, temperature, chunk_size, with_entropy, tp_group, vocab_size=vocab_size
    )
    return logp, ent


def vocab_parallel_topk_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor | None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    tp_group: dist.ProcessGroup | None = None,
    mask_ids: torch.Tensor | None = None,
    mask_counts: torch.Tensor | None = None,
    vocab_size: int | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`vocab_parallel_token_stats` plus the log-probs of given ids per token: `topk_ids` [n, k]
    global ids (a teacher's top-k), returned as a differentiable [n, k] tensor ([n, 0] without ids).

    Sampling-mask replay: `mask_counts` [n] (ints, 0 = no support: the full vocabulary) and
    `mask_ids` [Σ counts] (global ids, token by token) give each token's support; log-probs and
    entropy are then those of the softmax renormalised over it (see the module docstring). Not
    combinable with `topk_ids`.

    Vocabulary padding: with `vocab_size` (the true size) the ids >= vocab_size of a padded output
    weight are masked to -inf (models/vocab_padding.py): they are in no normaliser and no entropy.

    Each TP rank reads the logits of the ids inside its vocabulary shard (zero for the others), the
    log-sum-exp is the vocab-parallel one the target log-prob uses, and the [n, k] block travels in
    the same all-reduce as the per-token statistics: nothing vocabulary-sized leaves a rank.

    `token_mask` [n] (bool): compute only these tokens' statistics (the others are 0 and get no
    gradient); the same on every TP rank.
    """
    if token_mask is not None:
        return _kept_tokens_only(
            hidden,
            weight,
            targets,
            topk_ids,
            token_mask,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            tp_group=tp_group,
            mask_ids=mask_ids,
            mask_counts=mask_counts,
            vocab_size=vocab_size,
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(tp_group) if tp_group is not None and dist.get_world_size(tp_group) > 1 else 0
    vocab_start = rank * weight.shape[0]
    chunk = chunk_size or auto_chunk_size(weight.shape[0])
    ids = (
        torch.zeros(hidden.shape[0], 0, dtype=torch.long, device=hidden.device)
        if topk_ids is None
        else topk_ids.long().reshape(hidden.shape[0], -1)
    )
    offsets = None
    if mask_counts is not None:
        if topk_ids is not None and topk_ids.numel():
            raise ValueError("sampling-mask replay with top-k ids (distillation) is not supported")
        counts = mask_counts.reshape(-1).long()
        if counts.numel() != hidden.shape[0]:
            raise ValueError(f"mask_counts: {counts.numel()} entries for {hidden.shape[0]} tokens")
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.long, device=counts.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        if mask_ids is None or mask_ids.numel() != int(offsets[-1]):
            raise ValueError(f"mask_ids: expected {int(offsets[-1])} ids (the sum of mask_counts)")
        if not bool((offsets[1:] > offsets[:-1]).any()):
            mask_ids = offsets = None  # nothing to mask
    return _VocabParallelTokenStats.apply(
        hidden,
        weight,
        targets.long(),
        ids,
        vocab_start,
        1.0 / temperature,
        chunk,
        with_entropy,
        tp_group,
        mask_ids,
        offsets,
        padded_columns_from(vocab_size, vocab_start, weight.shape[0]),
    )


def _kept_tokens_only(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor | None,
    token_mask: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int | None,
    with_entropy: bool,
    tp_group: dist.ProcessGroup | None,
    mask_ids: torch.Tensor | None,
    mask_counts: torch.Tensor | None,
    vocab_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`vocab_parallel_topk_stats` of the rows `token_mask` keeps, scattered back to all n rows."""
    n = hidden.shape[0]
    keep = token_mask.reshape(-1).to(device=hidden.device, dtype=torch.bool)
    if keep.numel() != n:
        raise ValueError(f"token_mask: {keep.numel()} entries for {n} tokens")
    rows = keep.nonzero().squeeze(1)
    if mask_counts is not None:  # the supports of the kept tokens, still flat and in order
        counts = mask_counts.reshape(-1).long().to(hidden.device)
        if mask_ids is not None and mask_ids.numel() == int(counts.sum()):
            mask_ids = mask_ids[torch.repeat_interleave(keep, counts)]
        mask_counts = counts[rows]
    ids = None if topk_ids is None else topk_ids.reshape(n, -1)[rows]
    logp, ent, topk = vocab_parallel_topk_stats(
        hidden.index_select(0, rows),
        weight,
        targets.reshape(-1)[rows],
        ids,
        temperature,
        chunk_size,
        with_entropy,
        tp_group,
        mask_ids=mask_ids,
        mask_counts=mask_counts,
        vocab_size=vocab_size,
    )

    def spread(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=t.device).index_copy(0, rows, t)

    return (
        spread(logp),
        spread(ent) if with_entropy else torch.zeros(n, dtype=ent.dtype, device=ent.device),
        spread(topk),
    )


# --------------------------------------------------------------------------------------------
# megatron-core GPTModel
# --------------------------------------------------------------------------------------------


@dataclass
class TokenStats:
    """Per-token outputs of the last pipeline stage, [batch, seq] fp32."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    topk_logprobs: torch.Tensor | None = None  # [batch, seq, k] log-probs of given ids (a teacher's top-k)


def unwrap_gpt(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    inner: Any = model  # a wrapper's `.module`
    while not isinstance(inner, GPTModel) and hasattr(inner, "module"):
        inner = inner.module
    if not isinstance(inner, GPTModel):
        raise TypeError(f"expected a megatron-core GPTModel (possibly wrapped), got {type(inner).__name__}")
    return inner


@contextlib.contextmanager
def _decoder_output_only(gpt: GPTModel) -> Iterator[None]:
    """Make GPTModel.forward return the final-normed hidden states instead of logits.

    `_postprocess` returns the decoder output before the output layer when `post_process` is
    False; the decoder's final norm is its own flag and still runs. Nothing else reads the flag
    during the forward, and backward does not read it at all.
    """
    saved = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = saved


def tp_region(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Enter the output layer's TP region: what ColumnParallelLinear does to its input."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return hidden
    if sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    return tensor_parallel.copy_to_tensor_model_parallel_region(hidden)


def output_weight(gpt: GPTModel) -> torch.Tensor:
    """This stage's output-projection shard (the embedding on a tied single-stage model)."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def gpt_token_stats(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    topk_ids: torch.Tensor | None = None,
    mask_ids: torch.Tensor | None = None,
    mask_counts: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor | TokenStats:
    """Run one (possibly wrapped) GPTModel chunk. On the last pipeline stage return `TokenStats`
    for `labels` [b, s] (labels[:, t] is the token that follows position t), with the log-probs of
    `topk_ids` [b, s, k] at each position when given; on other stages the hidden states to send on.
    Sampling-mask replay: `mask_counts` [b, s] and the flat `mask_ids` (row-major over [b, s]) give
    the support each label was sampled from (see `vocab_parallel_topk_stats`). `token_mask` [b, s]:
    only these labels' statistics are computed (the others are 0; see the module docstring)."""
    from megatron.core import parallel_state

    gpt = unwrap_gpt(model)
    with _decoder_output_only(gpt):
        hidden = model(tokens, position_ids, attention_mask)
    if not gpt.post_process:
        return hidden
    hidden = tp_region(hidden, gpt.config.sequence_parallel)  # [s, b, h]
    s, b, h = hidden.shape
    ids = None if topk_ids is None else topk_ids.permute(1, 0, 2).reshape(s * b, -1)  # [s·b, k], like the labels
    if mask_counts is not None:
        assert mask_ids is not None  # counts and ids come together
        mask_ids, mask_counts = seq_major_masks(mask_ids.to(hidden.device), mask_counts.to(hidden.device))
    logp, ent, topk = vocab_parallel_topk_stats(
        hidden.reshape(s * b, h),
        output_weight(gpt),
        labels.t().reshape(-1),
        ids,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        mask_ids=mask_ids,
        mask_counts=mask_counts,
        vocab_size=getattr(gpt, "unpadded_vocab_size", None),
        token_mask=None if token_mask is None else token_mask.t().reshape(-1),
    )
    topk_out = None if topk_ids is None else topk.view(s, b, -1).permute(1, 0, 2)
    return TokenStats(logp.view(s, b).t(), ent.view(s, b).t() if with_entropy else None, topk_out)


def seq_major_masks(mask_ids: torch.Tensor, mask_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat supports of a [b, s] grid, row-major, reordered to the [s·b] token order of the hidden
    states (`counts.t()`): returns (ids, counts [s·b])."""
    counts = mask_counts.long()
    b, s = counts.shape
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # row-major start of each position's ids
    perm = torch.arange(b * s, device=counts.device).view(b, s).t().reshape(-1)  # seq-major -> row-major index
    new_counts = flat[perm]
    total = int(new_counts.sum())
    if total == 0:
        return mask_ids[:0], new_counts
    new_starts = torch.cumsum(new_counts, 0) - new_counts
    src = torch.repeat_interleave(starts[perm] - new_starts, new_counts) + torch.arange(total, device=counts.device)
    return mask_ids[src], new_counts


# A loss on the last stage: (batch, stats) -> (summed loss, count for the global mean, report).
# `report` must hold "lm_loss": stack([summed loss (detached), count]) for `forward_backward`; any
# other entries are kept too (see `make_forward_step`'s `store`).
LossFn = Callable[[Batch, TokenStats], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def make_forward_step(
    loss_fn: LossFn,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    store: list[dict[str, Any]] | None = None,
) -> Callable:
    """A megatron-core `forward_step(data_iterator, model)` for `train.forward_backward`.

    Micro-batches hold `tokens`, `labels`, `position_ids` and optionally `segment_ids` (packed
    rows), `stats_mask` ([b, s]: only these labels' statistics are computed), `label_topk_ids` ([b, s, k]
    ids whose log-probs are wanted too), `routed_experts` (the experts
    to replay, see `train.routing_replay`), `label_mask_counts` [b, s] and `label_mask_ids` (sampling-mask
    replay: each label's support, flat, row-major) plus whatever `loss_fn` reads (masks, advantages,
    old/rollout log-probs). `loss_fn`
    follows `calculate_per_token_loss`: it returns a *sum* and the integer count it should be
    divided by; megatron-core divides the gradients by the count summed over micro-batches and DP
    ranks. If `store` is given, each micro-batch's report dict is appended to it (last stage only).
    """
    from mcore_rl.train.forward_backward import attention_mask_from_segments  # lazy: megatron

    def _loss(batch: Batch, stats: TokenStats) -> tuple:
        loss, count, report = loss_fn(batch, stats)
        if store is not None:
            store.append(report)
        return loss, count, report

    def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple:
        from mcore_rl.train import routing_replay  # lazy: megatron

        batch = next(data_iterator)
        routing_replay.install(model, batch.get(routing_replay.ROUTING_KEY))  # MoE routing replay, if attached
        out = gpt_token_stats(
            model,
            batch["tokens"],
            batch["position_ids"],
            attention_mask_from_segments(batch.get("segment_ids")),
            batch["labels"],
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            topk_ids=batch.get("label_topk_ids"),
            mask_ids=batch.get("label_mask_ids"),
            mask_counts=batch.get("label_mask_counts"),
            token_mask=batch.get("stats_mask"),
        )
        return out, partial(_loss, batch)

    return forward_step


def _collect_loss(key_mask: str, batch: Batch, stats: TokenStats) -> tuple:
    mask = batch[key_mask].float() if key_mask in batch else torch.ones_like(stats.logprobs)
    report: dict[str, torch.Tensor] = {
        "lm_loss": torch.zeros(2, device=stats.logprobs.device),
        "logprobs": stats.logprobs.detach(),
    }
    if stats.entropy is not None:
        report["entropy"] = stats.entropy.detach()
    if stats.topk_logprobs is not None:
        report["topk_logprobs"] = stats.topk_logprobs.detach()
    zero = (stats.logprobs * 0.0).sum()
    return zero, torch.tensor(int(mask.sum()), dtype=torch.int), report


@torch.no_grad()
def compute_token_stats(
    chunks: list[torch.nn.Module],
    microbatches: list[Batch],
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    all_stages: bool = True,
) -> list[TokenStats]:
    """Forward-only log-probs (and entropy) of every micro-batch's labels, e.g. π_old or π_ref.

    Returns one `TokenStats` per micro-batch, [b, s] each (plus [b, s, k] top-k log-probs for
    micro-batches with `label_topk_ids`), on the CPU. Under PP they exist on the last stage; with
    `all_stages` they are broadcast to the other stages too (shapes are known from the
    micro-batches, so the broadcast needs no handshake).
    """
    from megatron.core import parallel_state

    from mcore_rl.train.forward_backward import forward_backward  # lazy: megatron

    store: list[dict[str, Any]] = []
    step = make_forward_step(partial(_collect_loss, "loss_mask"), temperature, chunk_size, with_entropy, store=store)
    forward_backward(chunks, microbatches, forward_only=True, forward_step=step)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    out: list[TokenStats] = []
    for i, mb in enumerate(microbatches):
        shape = mb["labels"].shape
        k = mb["label_topk_ids"].shape[-1] if "label_topk_ids" in mb else None
        if last:
            rows = [store[i]["logprobs"]] + ([store[i]["entropy"]] if with_entropy else [])
            packed = torch.stack(rows).float()
            topk = store[i]["topk_logprobs"].float() if k is not None else None
        else:
            packed = torch.empty((2 if with_entropy else 1, *shape), dtype=torch.float32)
            topk = torch.empty((*shape, k), dtype=torch.float32) if k is not None else None
        if pp > 1 and all_stages:
            device = next(chunks[0].parameters()).device
            for i_t, t in enumerate([packed] + ([topk] if topk is not None else [])):
                t = t.to(device)
                dist.broadcast(
                    t,
                    src=parallel_state.get_pipeline_model_parallel_last_rank(),
                    group=parallel_state.get_pipeline_model_parallel_group(),
                )
                if i_t == 0:
                    packed = t
                else:
                    topk = t
        elif not last:
            continue
        packed = packed.cpu()
        out.append(TokenStats(packed[0], packed[1] if with_entropy else None, topk.cpu() if topk is not None else None))
    return out
