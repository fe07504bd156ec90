"""Streaming mcore-to-hf: one parameter at a time to one writer, written into safetensors shards as it goes.

Every rank agrees on the order (the global megatron names, naturally sorted) and, from a small
exchange of names and shapes only, on who sends what. Per parameter: its TP/ETP shards are
gathered (`dist.gather`, not all-gather) to the TP leader of one replica; that rank sends the full
tensor point-to-point to the writer (global rank 0) unless it is the writer; the writer maps it to HF
names with `weight_map.megatron_to_hf`, casts each piece and appends its bytes to the current shard
file. Shard contents are planned up front from the shapes, so each file's safetensors header is
written first and the tensors are streamed after it: nothing waits in memory for a shard to fill.
A stock export of a family whose checkpoints stack expert tensors over the experts (GPT-OSS's
`mlp.experts.gate_up_proj` [E, ...]) walks each layer's experts leaf by leaf, so the experts'
slices of one stacked tensor arrive in turn and are appended one at a time (a stacked tensor is its
experts' slices back to back): the writer holds one expert's slice, never the stack.

Every rank walks the same list and joins only the operations it takes part in, so the earliest
unfinished operation always has all its ranks waiting on it: no deadlock.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

import torch
import torch.distributed as dist

from mcore_rl.convert.hf_checkpoint import _SAFETENSORS_DTYPES, HFCheckpoint
from mcore_rl.convert.stream_import import full_shape
from mcore_rl.convert.streaming import StreamStats, nbytes, tensor_split
from mcore_rl.hf.families import family_named
from mcore_rl.hf.weight_map import megatron_to_hf
from mcore_rl.models.shards import _tp_group_rank_size, gather_data_parallel_shards, iter_local_params, unshard
from mcore_rl.progress import progress

if TYPE_CHECKING:
    from mcore_rl.config.schema import ModelConfig

WRITER = 0  # the global rank that writes the files
_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


def natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


class SafetensorsShardWriter:
    """Writes tensors, in a planned order, into `model.safetensors` or `model-0000i-of-0000n.safetensors`
    files of at most `max_shard_bytes` each (a tensor larger than that gets a file of its own) plus the
    index json. `plan` is the (name, shape, dtype) of every tensor, in the order `write` will see them."""

    def __init__(
        self, output_dir: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int
    ) -> None:
        self.output_dir = output_dir
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            n = math.prod(shape) * dtype.itemsize
            if shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape), dtype))
            size += n
        self._shards = shards
        self.files = (
            ["model.safetensors"]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        self._queue = [(i, *entry) for i, shard in enumerate(shards) for entry in shard]
        self._next = 0
        self._part = 0  # the next slice of a tensor written in parts
        self._file: Any | None = None
        self._file_index = -1
        self.total_bytes = sum(math.prod(s) * d.itemsize for _, s, d in plan)

    def write(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """Append the next planned tensor (name, shape and dtype must be the planned ones), or with
        `part` its next slice along dim 0 (a stacked tensor written one expert at a time, in order)."""
        shard, *planned = self._queue[self._next]
        planned_shape = self._queue[self._next][2]
        shape = tuple(tensor.shape) if part is None else (planned_shape[0], *tensor.shape)
        if planned != [name, shape, tensor.dtype] or (part is not None and part != self._part):
            at = "" if part is None else f" part {part} (expected {self._part})"
            raise RuntimeError(f"export wrote {name}{at} {shape} {tensor.dtype} where the plan has {planned}")
        if shard != self._file_index:
            self._open(shard)
        assert self._file is not None  # opened by _open for this shard
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only for Python >= 3.12
        if part is not None and part + 1 < planned_shape[0]:
            self._part += 1
            return
        self._part = 0
        self._next += 1
        if self._next == len(self._queue) or self._queue[self._next][0] != shard:
            self._file.close()
            self._file = None

    def _open(self, shard: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in self._shards[shard]:
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(os.path.join(self.output_dir, self.files[shard]), "wb")
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._file_index = shard

    def close(self) -> list[str]:
        """Write the index (when sharded); returns the file names written."""
        if self._next != len(self._queue):
            raise RuntimeError(f"export stopped after {self._next} of {len(self._queue)} tensors")
        if len(self.files) == 1:
            return list(self.files)
        weight_map = {name: self.files[i] for i, shard in enumerate(self._shards) for name, _, _ in shard}
        with open(os.path.join(self.output_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return self.files + ["model.safetensors.index.json"]


def stacked_slot(hf_name: str, stacked: tuple[str, ...]) -> tuple[str, int] | None:
    """(stacked name, expert) of a per-expert HF name (`...mlp.experts.{j}.<leaf>`) whose leaf the
    stock checkpoint stacks over the experts (`ModelFamily.stacked_expert_tensors`); else None."""
    head, sep, tail = hf_name.partition(".mlp.experts.")
    expert, _, leaf = tail.partition(".")
    if sep and expert.isdigit() and leaf in stacked:
        return f"{head}.mlp.experts.{leaf}", int(expert)
    return None


def stack_experts(tensors: dict[str, torch.Tensor], stacked: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """An in-memory state dict with the per-expert tensors of `stacked` leaves stacked, as the stock
    checkpoint stores them (`write_hf_checkpoint`; the streaming export writes them one at a time)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        slot = stacked_slot(name, stacked)
        if slot is None:
            out[name] = tensor
        else:
            parts.setdefault(slot[0], {})[slot[1]] = tensor
    out.update({name: torch.stack([by[j] for j in range(len(by))]) for name, by in parts.items()})
    return out


def export_order(names: Iterable[str], stacked: bool) -> list[str]:
    """Global megatron names in the order every rank walks them: natural order, and with `stacked`
    each leaf of a layer's experts together, by expert (so a stacked HF tensor is written in one go)."""
    if not stacked:
        return sorted(names, key=natural_key)
    return sorted(names, key=lambda n: natural_key(_EXPERT_FIRST.sub(r"local_experts.\2.\1", n)))


_EXPERT_FIRST = re.compile(r"local_experts\.(\d+)\.(.+)$")


def _plan(
    order: list[str],
    meta: dict[str, tuple[list[int], torch.dtype]],
    mc: ModelConfig,
    kind: str | None,
    dtype: torch.dtype,
    stacked: tuple[str, ...],
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype) of every tensor the writer writes, a stacked one once with its expert count."""
    from mcore_rl.convert.to_hf import tensor_dtype  # lazy: import cycle (to_hf imports this module)

    plan: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name in order:
        for hf_name, piece in megatron_to_hf(name, torch.empty(meta[name][0], device="meta"), mc):
            shape, cast = tuple(piece.shape), tensor_dtype(hf_name, kind, dtype)
            slot = stacked_slot(hf_name, stacked)
            if slot is None:
                plan.append((hf_name, shape, cast))
            elif slot[1] == 0:
                plan.append((slot[0], (1, *shape), cast))
            elif plan[-1][0] == slot[0] and plan[-1][1][0] == slot[1]:
                plan[-1] = (slot[0], (slot[1] + 1, *shape), cast)
            else:
                raise RuntimeError(f"export: {hf_name} does not follow expert {slot[1] - 1} of {slot[0]}")
    return plan


def _exported(chunks: Iterable[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(global name, param) of this rank's parameters that go into the export."""

    return [
        (name, param)
        for _, name, param in iter_local_params(chunks, with_buffers=True)
        if not (getattr(param, "shared_embedding", False) and name == "output_layer.weight")
    ]


def _leader(param: torch.Tensor, global_name: str) -> int:
    """The global rank that holds this parameter whole once its TP/ETP group gathered it."""

    _, _, size = tensor_split(param, global_name)
    if size == 1:
        return dist.get_rank()
    group, _, _ = _tp_group_rank_size(param, global_name)
    assert group is not None  # parallel state is initialized: the TP/ETP group exists
    return dist.get_global_rank(group, 0)


def _gather_to_leader(param: torch.Tensor, global_name: str, stats: StreamStats) -> torch.Tensor | None:
    """The full tensor on the TP/ETP leader (None on the other members); DP-sharded tables are
    all-gathered over their TP and DP groups (they are small) and come back whole on every holder."""

    value = param.detach()
    dim, rank, size = tensor_split(param, global_name)
    dp_sharded = getattr(param, "data_parallel_sharded", False)
    if size > 1:
        group, _, _ = _tp_group_rank_size(param, global_name)
        assert group is not None  # parallel state is initialized: the TP/ETP group exists
        shards = [torch.empty_like(value) for _ in range(size)] if rank == 0 or dp_sharded else None
        if dp_sharded:
            dist.all_gather(shards, value.contiguous(), group=group)
        else:
            dist.gather(value.contiguous(), shards, dst=dist.get_global_rank(group, 0), group=group)
        if shards is None:
            return None
        value = unshard(shards, param, global_name)
        stats.held(*shards, value)
        del shards
    whole = gather_data_parallel_shards(param, value)
    if whole is not value:
        stats.held(value, whole)
    return whole


def stream_export(
    chunks: list[torch.nn.Module],
    mc: ModelConfig,
    output_dir: str,
    dtype: torch.dtype,
    max_shard_bytes: int,
    stats: StreamStats | None = None,
    kind: str | None = None,
    carried: HFCheckpoint | None = None,
) -> StreamStats:
    """Write the HF safetensors of the model in `chunks` (collective over the world; rank 0 writes);
    `kind` (the export kind, known on the writer) says which tensors stay fp32 (`to_hf.tensor_dtype`);
    `carried` (on the writer): tensors written after the model's as they are (`convert/carried.py`)."""
    from mcore_rl.convert.to_hf import tensor_dtype  # lazy: import cycle (to_hf imports this module)

    stats = stats if stats is not None else StreamStats()
    me = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = _exported(chunks)
    # names, full shapes and dtypes only: who could send each tensor, and the writer's plan
    offer = [
        (name, full_shape(param, name), str(param.dtype).replace("torch.", ""), _leader(param, name))
        for name, param in local
    ]
    offers: list[Any] = [offer]
    if world > 1:
        offers = [None] * world
        dist.all_gather_object(offers, offer)
    meta: dict[str, tuple[list[int], torch.dtype]] = {}
    source: dict[str, int] = {}
    for part in offers:
        for name, shape, dt, leader in part:
            meta[name] = (shape, getattr(torch, dt))
            source[name] = min(source.get(name, world), leader)
    family = family_named(mc.arch)
    order = export_order(meta, bool(family and family.stacked_expert_tensors))
    # a stock export of a family whose stock checkpoints stack expert tensors (GPT-OSS) stacks them
    stacked = family.stacked_expert_tensors if family and kind == family.stock_model_type else ()
    writer = None
    if me == WRITER:
        plan = _plan(order, meta, mc, kind, dtype, stacked)
        for carried_name in carried or []:
            assert carried is not None  # iterated only when given
            piece = carried.meta(carried_name)
            plan.append((carried_name, tuple(piece.shape), piece.dtype))
        writer = SafetensorsShardWriter(output_dir, plan, max_shard_bytes)
    params = dict(local)
    with progress(writer.total_bytes if writer else 0, "export", unit="B") as bar:
        for i, name in enumerate(order):
            full = None
            param = params.get(name)
            if param is not None and (
                _leader(param, name) == source[name] or getattr(param, "data_parallel_sharded", False)
            ):
                full = _gather_to_leader(param, name, stats)
            if source[name] != WRITER:
                if me == source[name]:
                    assert full is not None  # the source is the leader, which gathered it
                    dist.send(full.contiguous(), dst=WRITER)
                    full = None
                elif me == WRITER:
                    full = torch.empty(meta[name][0], dtype=meta[name][1])
                    dist.recv(full, src=source[name])
            if me != WRITER:
                continue
            assert full is not None and writer is not None  # the writer holds or received every tensor
            for hf_name, piece in megatron_to_hf(name, full, mc):
                cast = piece.to(tensor_dtype(hf_name, kind, dtype)).contiguous()
                stats.held(full, cast)
                slot = stacked_slot(hf_name, stacked)
                writer.write(*((hf_name, cast) if slot is None else (slot[0], cast, slot[1])))
                stats.moved(cast)
                bar.update(nbytes(cast))
                del cast
            bar.set_postfix_str(f"{i + 1}/{len(order)} tensors", refresh=False)
            del full
        if writer is not None and carried is not None:  # layers the model does not hold, as they are
            for carried_name in carried:
                tensor = carried[carried_name]
                writer.write(carried_name, tensor)
                stats.moved(tensor)
                bar.update(nbytes(tensor))
                del tensor
    if writer is not None:
        writer.close()
    return stats
