"""Over-Encoding (OverTok, arXiv:2501.16975) on megatron-core: hashed n-gram input embeddings.

The formulas, the n-gram id (exact, overflow-free, never crossing a document) and the padding id
for missing context are those of the reference, `mcore_rl.hf.ngram` (this module calls the same
`ngram_hash_ids`). Here they are laid out for model parallelism:

* **Where**: the n-gram part is an `ngram` submodule of GPTModel's `LanguageModelEmbedding`, so it
  exists only on the first pipeline stage (`pre_process`) and receives GPTModel's `position_ids`,
  from which it finds document boundaries in packed rows (positions restart at 0 per document).
  `add_ngram_embedding` installs it on a built GPTModel (builder.py calls it).
* **Tables** (one per order n, the k slices side by side: [rows, k * w_n]) are sharded by rows,
  never replicated: across the tensor-parallel ranks, and with `shard_over_data_parallel` across
  TP x DP ranks (shard s = dp_rank * tp + tp_rank holds rows [s R, (s+1) R)). Rows are padded to
  a multiple of `TABLE_ROW_ALIGNMENT` (ids are < m, padding rows are never read), so the global
  shape — and the checkpoint — does not depend on the layout.
* **Lookup**: every TP rank sees the same tokens, so it looks up the ids its rows own and leaves
  zeros elsewhere (as `VocabParallelEmbedding` does). With DP sharding, each DP rank first sends
  its (de-duplicated) ids to the DP rank owning them with an all-to-all, that rank looks them up
  in its TP shard, and a second all-to-all returns the rows (the backward runs the same route in
  reverse, so each table shard's gradient already sums all DP ranks' tokens). The partial lookups
  of all orders are then summed over TP in one collective — an all-reduce, or under sequence
  parallelism a reduce-scatter straight into the sequence-parallel layout — and only then
  projected to d_model: the projections are replicated, so their gradients need no extra
  reduction without SP and are summed over TP like the SP norms' with SP (`sequence_parallel`).
* **Gradients of DP-sharded tables** must not be all-reduced over DP (each DP rank holds other
  rows): wrap the model with `DataParallelShardedDDP` (forward_backward.wrap_ddp does), which
  keeps such params (`data_parallel_sharded=True`) out of megatron-core DDP's buffers, gives them
  their own `main_grad` and skips them in the parameter broadcast. The optimizer's global grad
  norm sums their squares over DP as well.
* Every DP rank of the first stage must run the same number of forward passes (the all-to-all is
  a collective), as with MoE expert parallelism; shapes may differ between DP ranks.

Context parallelism is not supported (a CP rank would lack the tokens before its chunk).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast


import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from mcore_rl.config.model_keys.ngram import NgramEmbeddingConfig
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.ngram import check_table_size, ngram_hash_ids, padded_table_rows, slice_width
from mcore_rl.models.param_attrs import megatron_attrs

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


class _Weight(torch.nn.Module):
    """Holds one parameter as `.weight` (so names read `tables.2.weight`)."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def _init_device(config: TransformerConfig) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class NgramEmbedding(MegatronModule):
    """Sharded n-gram tables + replicated projections; `forward` returns [s(/tp), b, hidden]."""

    def __init__(self, config: TransformerConfig, vocab_size: int, ngram: NgramEmbeddingConfig) -> None:
        super().__init__(config=config)
        self.orders = [int(n) for n in ngram.orders]
        self.vocab_size = vocab_size
        self.table_size = ngram.table_size
        self.num_slices = ngram.num_slices
        check_table_size(self.table_size, vocab_size, key="model.ngram.table_size")
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.dp_group: dist.ProcessGroup | None = None
        dp, dp_rank = 1, 0
        if ngram.shard_over_data_parallel:
            self.dp_group = parallel_state.get_data_parallel_group()
            dp, dp_rank = self.dp_group.size(), self.dp_group.rank()
            if dp == 1:
                self.dp_group = None
        self.tp_size, self.dp_size = tp, dp
        self.num_shards = tp * dp
        self.shard = dp_rank * tp + tp_rank
        rows = padded_table_rows(self.table_size)
        if rows % self.num_shards:
            raise ValueError(
                f"model.ngram.table_size: {rows} padded rows are not divisible by {self.num_shards} "
                f"table shards (TP {tp} x DP {dp})"
            )
        self.rows_per_shard = rows // self.num_shards

        device, dtype, h = _init_device(config), config.params_dtype, config.hidden_size
        # One seed for all ranks (the global RNG is identical on them at build time); each table
        # shard draws its own rows from it, every rank the same projections.
        base_seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        std = config.init_method_std
        self.tables = torch.nn.ModuleDict()
        self.projections = torch.nn.ModuleDict()
        self.widths: list[int] = []
        for n in self.orders:
            width = self.num_slices * slice_width(h, n, self.num_slices)
            if width < 1:
                raise ValueError(
                    f"model.hidden_size {h} is too small for n-gram order {n} with {self.num_slices} slices"
                )
            self.widths.append(width)
            table = torch.empty(self.rows_per_shard, width, dtype=dtype)
            proj = torch.empty(h, width, dtype=dtype)
            if config.perform_initialization:
                g = torch.Generator().manual_seed(base_seed + 7919 * n + 104729 * (self.shard + 1))
                table.normal_(0.0, std, generator=g)
                proj.normal_(0.0, std, generator=torch.Generator().manual_seed(base_seed + 7919 * n))
            table = torch.nn.Parameter(table.to(device))
            set_tensor_model_parallel_attributes(table, is_parallel=True, dim=0, stride=1)
            if self.dp_group is not None:
                megatron_attrs(table).data_parallel_sharded = True
            proj = torch.nn.Parameter(proj.to(device))
            megatron_attrs(proj).sequence_parallel = config.sequence_parallel  # partial grads under SP: sum over TP
            self.tables[str(n)] = _Weight(table)
            self.projections[str(n)] = _Weight(proj)

    # ------------------------------------------------------------------------------ lookup

    def _local_lookup(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` that this rank's shard holds; zeros for the others."""
        local = ids - self.shard * self.rows_per_shard
        outside = (local < 0) | (local >= self.rows_per_shard)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def _dp_lookup(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """All-to-all lookup over the DP group: ids to their owner, rows back (partial over TP)."""
        group = self.dp_group
        uniq, inverse = torch.unique(ids.reshape(-1), return_inverse=True)  # sorted => grouped by owner
        owner = torch.div(uniq, self.rows_per_shard * self.tp_size, rounding_mode="floor")
        send = torch.bincount(owner, minlength=self.dp_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        requested = uniq.new_empty(sum(recv_sizes))
        dist.all_to_all_single(requested, uniq, recv_sizes, send_sizes, group=group)
        rows = self._local_lookup(weight, requested)
        back = tensor_parallel.all_to_all(group, rows, send_sizes, recv_sizes)
        return back[inverse].reshape(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, scatter_to_sp: bool) -> torch.Tensor:
        """n-gram embeddings of input_ids [b, s]: [s, b, h], or [s/tp, b, h] if `scatter_to_sp`."""
        ids = ngram_hash_ids(input_ids, position_ids, self.orders, self.vocab_size, self.table_size)
        lookup = self._dp_lookup if self.dp_group is not None else self._local_lookup
        parts = [lookup(cast(_Weight, self.tables[str(n)]).weight, idx) for n, idx in zip(self.orders, ids)]
        looked = torch.cat(parts, dim=-1).transpose(0, 1).contiguous()  # [s, b, sum of widths]
        if scatter_to_sp:
            looked = tensor_parallel.reduce_scatter_to_sequence_parallel_region(looked, group=self.tp_group)
        else:
            looked = tensor_parallel.reduce_from_tensor_model_parallel_region(looked, group=self.tp_group)
        out, offset = None, 0
        for n, width in zip(self.orders, self.widths):
            y = F.linear(looked[..., offset : offset + width], cast(_Weight, self.projections[str(n)]).weight)
            out = y if out is None else out + y
            offset += width
        assert out is not None  # orders is non-empty: built only for n-gram models
        return out

    # ------------------------------------------------------------------------ checkpointing

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Tables sharded by rows over TP (replicated over DP) or over TP x DP; projections replicated."""
        out = {}
        for n in self.orders:
            key = f"{prefix}tables.{n}.weight"
            table = self.tables[str(n)].weight
            if self.dp_group is None:
                out[key] = make_tp_sharded_tensor_for_checkpoint(table, key, 0, prepend_offsets=sharded_offsets)
            else:
                axis = len(sharded_offsets)
                out[key] = ShardedTensor.from_rank_offsets(
                    key,
                    table,
                    *sharded_offsets,
                    (axis, self.shard, self.num_shards),
                    replica_id=0,
                    prepend_axis_num=len(sharded_offsets),
                )
            pkey = f"{prefix}projections.{n}.weight"
            out[pkey] = make_sharded_tensor_for_checkpoint(
                self.projections[str(n)].weight, pkey, prepend_offsets=sharded_offsets
            )
        return out


class NgramLanguageModelEmbedding(LanguageModelEmbedding):
    """GPTModel's embedding with the n-gram part added: word (+ position) embeddings as megatron-core
    computes them (incl. the SP scatter), plus `self.ngram(input_ids, position_ids)` in the same
    layout. Embedding dropout applies to the word embeddings only (Qwen3 configs use none)."""

    ngram: NgramEmbedding

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, tokentype_ids: int | None = None
    ) -> torch.Tensor:
        embeddings = super().forward(input_ids, position_ids, tokentype_ids)
        scatter = bool(self.config.sequence_parallel and self.scatter_to_sequence_parallel)
        return embeddings + self.ngram(input_ids, position_ids, scatter).to(embeddings.dtype)


def add_ngram_embedding(gpt_model: GPTModel, model: ModelConfig) -> None:
    """Give a built GPTModel's first-stage embedding the n-gram tables (no-op without them).

    The existing `LanguageModelEmbedding` is kept (its word embeddings carry megatron-core's tied /
    shared-embedding attributes) and becomes an `NgramLanguageModelEmbedding`.
    """
    if not model.section(NgramEmbeddingConfig).orders or not getattr(gpt_model, "pre_process", False):
        return
    embedding = gpt_model.embedding
    if not isinstance(embedding, NgramLanguageModelEmbedding):
        embedding.__class__ = NgramLanguageModelEmbedding
    embedding.ngram = NgramEmbedding(gpt_model.config, model.vocab_size, model.section(NgramEmbeddingConfig))


# ---------------------------------------------------------------------------------------------
# DDP for params sharded over data parallel
# ---------------------------------------------------------------------------------------------


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    if param.grad is not None:
        megatron_attrs(param).main_grad.add_(param.grad)
        param.grad = None


class DataParallelShardedDDP(DistributedDataParallel):
    """megatron-core DDP that leaves params marked `data_parallel_sharded` alone.

    Such a param holds different rows on every DP rank (no DP replica), so the DP all-reduce and
    the rank-0 broadcast would be wrong for it. It is kept out of DDP's buffers; autograd's
    gradient is added into its own `main_grad` (fp32 with `grad_reduce_in_fp32`) after each
    backward, zeroed and scaled with the others, and never reduced over DP: the all-to-all lookup's
    backward already delivered every DP rank's contribution. Without such params this is exactly
    megatron-core's DDP.
    """

    def __init__(self, config: TransformerConfig, ddp_config, module: torch.nn.Module, **kwargs) -> None:
        sharded = [p for p in module.parameters() if p.requires_grad and getattr(p, "data_parallel_sharded", False)]
        for p in sharded:
            p.requires_grad_(False)
        try:
            super().__init__(config=config, ddp_config=ddp_config, module=module, **kwargs)
        finally:
            for p in sharded:
                p.requires_grad_(True)
        self.dp_sharded_params = sharded
        # What DDP's reduction would have done to a sum over DP ranks' gradients.
        self._dp_sharded_scale = 1.0
        if not config.calculate_per_token_loss:
            self._dp_sharded_scale = 1.0 / self.dp_cp_group.size()
        for p in sharded:
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else p.dtype
            megatron_attrs(p).main_grad = torch.zeros_like(p, dtype=grad_dtype)
            megatron_attrs(p).grad_added_to_main_grad = False
            if not getattr(p, "_main_grad_hooked", False):
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
                megatron_attrs(p)._main_grad_hooked = True

    def finish_grad_sync(self, *args, **kwargs) -> None:
        super().finish_grad_sync(*args, **kwargs)
        if self._dp_sharded_scale != 1.0:
            for p in self.dp_sharded_params:
                megatron_attrs(p).main_grad.mul_(self._dp_sharded_scale)

    def scale_gradients(self, scaling_factor: float) -> None:
        super().scale_gradients(scaling_factor)
        for p in self.dp_sharded_params:
            megatron_attrs(p).main_grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        super().zero_grad_buffer()
        for p in self.dp_sharded_params:
            megatron_attrs(p).main_grad.zero_()

    def broadcast_params(self) -> None:
        for param in self.module.parameters():
            if getattr(param, "data_parallel_sharded", False):
                continue
            group = self.expt_dp_group if not getattr(param, "allreduce", True) else self.dp_cp_group
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
