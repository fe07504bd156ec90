"""The trainer side of trainer -> engine weight sync: gather megatron-core shards into full Hugging
Face tensors, quantize for FP8 engines, pack them into buckets, hand them to a transport.

docs/design.md#weights-by-name. The flow, collective over the trainer world (every rank calls `WeightSync.sync`):

1. `iter_hf_weights` walks each rank's model chunks. Shards are gathered where they live —
   TP/ETP shards with `all_gather` in the TP/ETP group, experts across the EP group — by the one
   replica that matters (data-parallel rank 0; expert-data-parallel rank 0 for experts), and named
   with `mcore_rl.hf.weight_map` (the exporter's mapping). Each pipeline stage is gathered by its
   own ranks at the same time; its first rank streams the result to global rank 0 in buckets, one
   stage after another. Only global rank 0 ever holds full tensors, one bucket at a time.
2. On rank 0, FP8 engines get `x.weight` (e4m3) + `x.weight_scale_inv` for every Linear the engine
   quantizes (`engine.fp8.is_quantized_linear_name`), made with the engine's `quantize_block_fp8`.
3. Buckets (default 512 MiB) go to the engines through a transport of
   `mcore_rl.rollout.weight_transports` (disk, SGLang's broadcast group, tensors, in-process),
   which the engine pool hands out (rank 0 holds up to two buckets: the one in flight and the next).
4. While bucketing, rank 0 adds every tensor it sends to a `WeightChecksum`; the transport compares
   it with each engine's `/weights_checksum` before that engine generates again. Engines that
   differ (or report another version) get the whole sync once more, alone; if one still differs the
   sync raises `WeightSyncError` naming the engine, the version and both checksums, on every rank.
   Engines without the endpoint (real SGLang) are not checked.
5. A sync whose every engine dropped out while it ran (killed mid-sync, while the others were
   restarting) is sent again, up to `LOST_ENGINE_RETRIES` times: the pool then waits up to
   `rollout.no_engine_timeout_s` for an engine to come back before it gives up (`NoEngineToSync`).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.model_keys.moe import MoEKeys
from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.weight_map import megatron_to_hf
from mcore_rl.rollout.client import EngineUnavailable
from mcore_rl.rollout.router import NoEngineToSync
from mcore_rl.models.shards import gather_data_parallel_shards, iter_local_params, unshard
from mcore_rl.rollout.weight_protocol import (
    BucketMeta,
    NamedTensors,
    WeightChecksum,
    flatten,
    nbytes,
    parse_dtype,
    unflatten,
)
from mcore_rl.rollout.weight_transports import SyncStats, Transport
from mcore_rl.rollout.engine.fp8 import is_quantized_linear_name, quantize_block_fp8

DEFAULT_BUCKET_BYTES = 512 << 20
LOST_ENGINE_RETRIES = 3  # a sync every engine dropped out of is sent again (see 5. above)
logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight sync that did not leave every engine it reached with exactly the trainer's weights."""


# --------------------------------------------------------------------------------------------
# 1. megatron-core shards -> full HF tensors (collective)
# --------------------------------------------------------------------------------------------

_EXPERT_INDEX = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class _Role:
    pp_rank: int
    cp0: bool  # context-parallel rank 0 (CP ranks hold copies)
    dense: bool  # gathers dense tensors: data-parallel rank 0 of its stage
    experts: bool  # gathers expert tensors: expert-data-parallel rank 0
    holder: bool  # ends up with the full tensors of its stage


def _role() -> _Role:
    from megatron.core import parallel_state as ps

    cp0 = ps.get_context_parallel_rank() == 0
    dense = cp0 and ps.get_data_parallel_rank() == 0
    holder = (
        dense
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_expert_tensor_parallel_rank() == 0
        and ps.get_expert_model_parallel_rank() == 0
    )
    return _Role(ps.get_pipeline_model_parallel_rank(), cp0, dense, ps.get_expert_data_parallel_rank() == 0, holder)


def _stage_holders(role: _Role) -> list[int]:
    """Global rank of each pipeline stage's holder; every stage must have exactly one."""
    roles: list[_Role | None] = [None] * dist.get_world_size()
    dist.all_gather_object(roles, role)
    filled = [r for r in roles if r is not None]  # all_gather_object filled every slot
    pp = 1 + max(r.pp_rank for r in filled)
    holders: list[list[int]] = [[] for _ in range(pp)]
    for rank, r in enumerate(filled):
        if r.holder:
            holders[r.pp_rank].append(rank)
    if any(len(h) != 1 for h in holders) or holders[0] != [0]:
        raise RuntimeError(f"weight sync: expected one holder per pipeline stage, rank 0 first; got {holders}")
    return [h[0] for h in holders]


def _gather_tp(param: torch.Tensor, global_name: str, value: torch.Tensor, expert: bool) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if not getattr(param, "tensor_model_parallel", False):
        return value
    if expert:
        group, size = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size()
    else:
        group, size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    if size == 1:
        return value
    shards = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(shards, value.contiguous(), group=group)
    return unshard(shards, param, global_name)


def _gather_ep(global_name: str, value: torch.Tensor, num_local_experts: int) -> list[tuple[str, torch.Tensor]]:
    """All EP ranks' copies of this local expert slot, renamed to their global expert index."""
    from megatron.core import parallel_state as ps

    size = ps.get_expert_model_parallel_world_size()
    if size == 1:
        return [(global_name, value)]
    parts = [torch.empty_like(value) for _ in range(size)]
    dist.all_gather(parts, value.contiguous(), group=ps.get_expert_model_parallel_group())
    m = _EXPERT_INDEX.search(global_name)
    if m is None:
        raise ValueError(f"{global_name}: an expert parameter without an expert index")
    local = int(m.group(1)) - ps.get_expert_model_parallel_rank() * num_local_experts
    return [
        (global_name[: m.start(1)] + str(r * num_local_experts + local) + global_name[m.end(1) :], part)
        for r, part in enumerate(parts)
    ]


def _iter_stage(chunks: Sequence[torch.nn.Module], mc: ModelConfig, role: _Role) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's full HF tensors on its holder (other participants only join the collectives)."""
    from megatron.core import parallel_state as ps

    num_local_experts = mc.section(MoEKeys).num_experts // ps.get_expert_model_parallel_world_size() if mc.is_moe else 0
    for _, global_name, param in iter_local_params(chunks, with_buffers=True):
        if global_name == "output_layer.weight" and (
            mc.tie_word_embeddings or getattr(param, "shared_embedding", False)
        ):
            continue  # the last stage's copy of a tied embedding
        expert = ".mlp.experts." in global_name
        dp_sharded = getattr(param, "data_parallel_sharded", False)  # every DP rank holds a slice
        if not (role.experts if expert else role.dense or (dp_sharded and role.cp0)):
            continue
        value = _gather_tp(param, global_name, param.detach(), expert)
        if dp_sharded:
            value = gather_data_parallel_shards(param, value)
        full = _gather_ep(global_name, value, num_local_experts) if expert else [(global_name, value)]
        if role.holder:
            for name, tensor in full:
                yield from megatron_to_hf(name, tensor, mc)


def iter_hf_weights(
    chunks: Sequence[torch.nn.Module], mc: ModelConfig, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every full HF-named weight of the model, yielded on global rank 0 only.

    Collective: all trainer ranks must iterate it to the end (ranks other than 0 yield nothing).
    Tensors stay on the trainer's device; later pipeline stages reach rank 0 as flattened buckets of
    at most `bucket_bytes` (a larger single tensor travels alone) over the default group.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield from _iter_stage(chunks, mc, _Role(0, True, True, True, True))
        return
    role = _role()
    holders = _stage_holders(role)
    stage = _iter_stage(chunks, mc, role)
    rank = dist.get_rank()
    if rank == 0:
        yield from stage
        device = next(iter(chunks[0].parameters())).device
        for src in holders[1:]:
            yield from _recv_stage(src, device)
    elif role.holder:
        for bucket in iter_buckets(stage, bucket_bytes):
            meta = BucketMeta.of(bucket)
            dist.send_object_list([meta], dst=0)
            dist.send(flatten(bucket), dst=0)
        dist.send_object_list([None], dst=0)
    else:
        for _ in stage:  # join the TP/EP collectives of this stage
            pass


def _recv_stage(src: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        box: list[BucketMeta | None] = [None]
        dist.recv_object_list(box, src=src)
        meta = box[0]
        if meta is None:
            return
        flat = torch.empty(meta.total_bytes, dtype=torch.uint8, device=device)
        dist.recv(flat, src=src)
        dtypes = [parse_dtype(d, "dtypes") for d in meta.dtypes]
        yield from unflatten(flat, meta.names, dtypes, meta.shapes)


# --------------------------------------------------------------------------------------------
# 2. FP8 quantization and bucketing (rank 0)
# --------------------------------------------------------------------------------------------


def quantize_for_fp8_engine(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`x.weight` -> `x.weight` (e4m3) + `x.weight_scale_inv` (fp32 128x128 block scales) for every
    Linear an FP8 engine holds in FP8; everything else passes through unchanged."""

    for name, tensor in named:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and tensor.dim() == 2 and is_quantized_linear_name(module):
            q, scale_inv = quantize_block_fp8(tensor)
            yield name, q
            yield module + ".weight_scale_inv", scale_inv
        else:
            yield name, tensor


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, checksum: WeightChecksum | None = None
) -> Iterator[NamedTensors]:
    """Consecutive groups of at most `bucket_bytes` (a larger tensor forms a bucket of its own).
    With `checksum`, every tensor is added to it as it joins a bucket: what the transport sends."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        if checksum is not None:
            checksum.add(name, tensor)
        n = tensor.numel() * tensor.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


# --------------------------------------------------------------------------------------------
# the whole sync
# --------------------------------------------------------------------------------------------


@dataclass
class WeightSync:
    """Collective trainer -> engines weight sync; rank 0 drives the transport.

    `quantization="fp8"` sends FP8 block-quantized Linears (for engines started with
    `--quantization fp8`); None sends the trainer's dtype (engines cast on load).
    """

    chunks: Sequence[torch.nn.Module]
    model_config: ModelConfig
    transport: Transport | None  # used on rank 0 only
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization: expected None or 'fp8', got {self.quantization!r}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be positive, got {self.bucket_bytes}")

    def sync(self, version: int) -> SyncStats | None:
        """Ship the current weights as `version`, check every engine's checksum, and re-sync the
        engines that differ once (see the module docstring); returns stats on rank 0, None
        elsewhere. Collective; a failure on rank 0 raises on every rank."""
        start = time.perf_counter()
        stats, error = self._ship(version, None)
        status = self._agree(_status(stats, error, retries_left=LOST_ENGINE_RETRIES))
        for retry in range(LOST_ENGINE_RETRIES):
            if status != _AGAIN:
                break
            logger.warning(
                "weight sync of version %s: every engine dropped out of it (%s); sending it again to the "
                "engines that answer",
                version,
                error,
            )
            stats, error = self._ship(version, None)
            status = self._agree(_status(stats, error, retries_left=LOST_ENGINE_RETRIES - retry - 1))
        if status == _RESYNC:
            first = stats
            again: list[str] | None = None
            if first is not None:
                again = sorted(first.mismatched)
                logger.warning(
                    "weight sync of version %s: sending it again to %d engine(s) that do not hold what was sent: %s",
                    version,
                    len(again),
                    "; ".join(f"{u} {why}" for u, why in first.mismatched.items()),
                )
            stats, error = self._ship(version, again)
            if stats is not None:
                assert first is not None and again is not None  # rank 0 has both
                stats.resynced, stats.buckets = again, stats.buckets + first.buckets
                if error is None and stats.mismatched:
                    error = WeightSyncError(
                        f"weight sync of version {version}, sent twice: "
                        + "; ".join(f"engine {u} {why}" for u, why in stats.mismatched.items())
                        + " (left paused and out of routing)"
                    )
            status = self._agree(_FAILED if error is not None else _OK)
        if status == _FAILED:
            if error is not None:
                raise error
            raise WeightSyncError(f"weight sync of version {version} failed on global rank 0 (see its log)")
        if stats is not None:
            stats.seconds = time.perf_counter() - start
        return stats

    def _ship(self, version: int, only: Sequence[str] | None) -> tuple[SyncStats | None, BaseException | None]:
        """Gather and send once (collective): rank 0 returns its stats and the error it hit, if any
        (the collectives are finished first, so the other ranks are not left hanging)."""
        named = iter_hf_weights(self.chunks, self.model_config, self.bucket_bytes)
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in named:
                pass
            return None, None
        if self.transport is None:
            raise RuntimeError("weight sync: global rank 0 has no transport")
        stats = SyncStats(version, checksum=WeightChecksum(background=True))  # digests overlap the sending
        stream = quantize_for_fp8_engine(named) if self.quantization == "fp8" else named
        try:
            self.transport.send(
                iter_buckets(_counted(stream, stats), self.bucket_bytes, stats.checksum), version, stats, only
            )
        except BaseException as err:
            for _ in named:
                pass
            if not isinstance(err, Exception):
                raise
            return stats, err
        return stats, None

    def _agree(self, status: int) -> int:
        """Rank 0's status, on every rank (a no-op without a trainer world)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return status
        device = next(iter(self.chunks[0].parameters())).device
        t = torch.tensor([status], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())


_OK, _RESYNC, _FAILED, _AGAIN = 0, 1, 2, 3


def _status(stats: SyncStats | None, error: BaseException | None, retries_left: int) -> int:
    """What rank 0's attempt asks of every rank: done, re-sync the mismatched engines, send the
    whole sync again (every engine dropped out while it ran), or fail."""
    if isinstance(error, EngineUnavailable) and not isinstance(error, NoEngineToSync) and retries_left > 0:
        return _AGAIN
    if error is not None:
        return _FAILED
    return _RESYNC if stats is not None and stats.mismatched else _OK


def _counted(named: Iterable[tuple[str, torch.Tensor]], stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        stats.tensors += 1
        stats.bytes += nbytes(tensor.shape, tensor.dtype)
        yield name, tensor
