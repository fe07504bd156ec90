"""What streaming import and export share: who owns which slice of a tensor, and how much is held.

Streaming conversion moves one tensor at a time, so a rank's host memory beyond its own model shard
is bounded by a few of the largest tensors, not by the model (`stream_import`, `stream_export`).
`owned_range` is the one place that decides which rows of a full tensor a TP/ETP rank owns; a
padded row range (vocabulary padding) belongs there too.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_rl.models.param_attrs import megatron_attrs
from mcore_rl.models.shards import _tp_group_rank_size


@dataclasses.dataclass
class StreamStats:
    """Counters a conversion fills in: tensors and bytes moved (copied into parameters on import,
    written to files on export), and the most tensor bytes this rank held at once outside its model
    (read slices, gather buffers, full and cast tensors) and the largest single one of them."""

    tensors: int = 0
    bytes: int = 0
    peak_held_bytes: int = 0
    largest_tensor_bytes: int = 0

    def held(self, *tensors: torch.Tensor | None) -> None:
        """Record that `tensors` are alive at the same time (their sum may be the new peak)."""
        sizes = [nbytes(t) for t in tensors if t is not None]
        self.peak_held_bytes = max(self.peak_held_bytes, sum(sizes))
        self.largest_tensor_bytes = max([self.largest_tensor_bytes, *sizes])

    def moved(self, tensor: torch.Tensor) -> None:
        self.tensors += 1
        self.bytes += nbytes(tensor)


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def owned_range(length: int, rank: int, size: int) -> tuple[int, int]:
    """Rows [start, stop) of a dimension of `length` that rank `rank` of `size` owns (an even split,
    as megatron-core's column/row-parallel layers and `shards.shard_for_rank` cut it)."""
    if length % size:
        raise ValueError(f"a dimension of {length} does not split evenly over {size} ranks")
    step = length // size
    return rank * step, (rank + 1) * step


def tensor_split(param: torch.Tensor, global_name: str) -> tuple[int, int, int]:
    """(dim, rank, size) of the TP/ETP split of a parameter; (0, 0, 1) when it is not split."""

    if not getattr(param, "tensor_model_parallel", False):
        return 0, 0, 1
    _, rank, size = _tp_group_rank_size(param, global_name)
    return megatron_attrs(param).partition_dim, rank, size
