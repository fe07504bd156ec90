"""One language-model forward/backward over a list of micro-batches with megatron-core schedules.

The loss is a token mean over the *global* batch (all micro-batches, all data-parallel ranks):
micro-batches return summed losses with `calculate_per_token_loss`, and `finalize_model_grads`
divides the gradients by the global token count. That keeps the gradient independent of how the
batch was split into micro-batches and DP ranks, which the parity tests rely on.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

if TYPE_CHECKING:  # annotations only: megatron-core is imported after the CPU compatibility layer patched it
    from megatron.core.distributed import DistributedDataParallel

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

Batch = dict[str, torch.Tensor]


def prepare_config(config: TransformerConfig, chunks: list[DistributedDataParallel]) -> None:
    """Set the hooks megatron-core's schedules read from the config (call after `wrap_ddp`)."""
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [c.no_sync for c in chunks]
    config.no_sync_func = no_sync if len(chunks) > 1 else no_sync[0]


def wrap_ddp(
    chunks: list[torch.nn.Module], config: TransformerConfig, bucket_size: int | None = None
) -> list[DistributedDataParallel]:
    """megatron-core DDP around each chunk: fp32 grad buffers (`param.main_grad`), DP all-reduce."""
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
        bucket_size=bucket_size,
        average_in_collective=False,
    )
    # megatron-core's DDP, except that params sharded over DP (n-gram tables with
    # model.ngram.shard_over_data_parallel) are neither all-reduced nor broadcast over DP.
    from mcore_rl.models.ngram_embedding import DataParallelShardedDDP

    wrapped = [
        DataParallelShardedDDP(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=i > 0,
        )
        for i, chunk in enumerate(chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def attention_mask_from_segments(segment_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Block-diagonal causal mask for packed rows ([b, 1, s, s], True = masked); None if unpacked.

    RoPE scores depend only on i - j, so with this mask a packed document attends exactly as if it
    were alone, even though megatron-core's local RoPE counts positions from the row start.
    """
    if segment_ids is None or bool((segment_ids == segment_ids[:, :1]).all()):
        return None
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return ~(same_doc & causal)[:, None]


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """Summed masked token loss; megatron-core divides by the global token count afterwards."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    reported = torch.stack([loss_sum.detach(), mask.sum()])
    return loss_sum, num_tokens, {"lm_loss": reported}


def _forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple:
    batch = next(data_iterator)
    mask = attention_mask_from_segments(batch.get("segment_ids"))
    output = model(
        batch["tokens"],
        batch["position_ids"],
        mask,
        labels=batch["labels"],
    )
    return output, partial(_loss_func, batch["loss_mask"])


def _p2p_seq_factor(chunks: list[torch.nn.Module]) -> int:
    """How many [s, b, h] slabs a pipeline message holds: AttnRes stages send their depth state
    stacked along the sequence dim (mcore_rl.models.attn_res); 1 for every other model."""
    module: Any = chunks[0]  # a wrapper's `.module`
    while hasattr(module, "module"):
        module = module.module
    return getattr(getattr(module, "decoder", None), "p2p_seq_factor", 1)


def forward_backward(
    chunks: list[DistributedDataParallel],
    microbatches: list[Batch],
    forward_only: bool = False,
    forward_step: Callable = _forward_step,
) -> dict[str, float]:
    """Run the schedule over `microbatches` (this DP rank's share of the global batch).

    Returns the global token-mean loss and token count (valid on every rank). Gradients are left
    in `param.main_grad`, reduced across DP and scaled by 1 / global tokens.
    """
    seq_length = microbatches[0]["tokens"].shape[1] * _p2p_seq_factor(chunks)
    micro_batch_size = microbatches[0]["tokens"].shape[0]
    device = next(chunks[0].parameters()).device
    microbatches = [{k: v.to(device) for k, v in mb.items()} for mb in microbatches]
    iterators: Any = [iter(microbatches) for _ in chunks] if len(chunks) > 1 else iter(microbatches)
    if not forward_only:
        for chunk in chunks:
            chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators,
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    totals = torch.zeros(2, dtype=torch.float64)
    for item in losses:
        totals += item["lm_loss"].double().cpu()
    # Only the last pipeline stage has losses; share them, then sum over data parallel ranks.
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(
            totals,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    num_tokens = float(totals[1])
    return {"loss": float(totals[0]) / max(num_tokens, 1.0), "num_tokens": num_tokens}
