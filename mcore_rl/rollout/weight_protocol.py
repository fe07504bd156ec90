"""What travels between the trainer and an engine during a weight sync, in SGLang's formats.

Both sides import this module, so the byte layout is defined once:

- dtype names as SGLang's `update_weights_from_distributed` sends them (`"bfloat16"`, resolved
  with `getattr(torch, name)`), restricted to the dtypes a checkpoint can hold;
- the *flattened bucket* (SGLang's `FlattenedTensorBucket`, `load_format="flattened_bucket"`): the
  tensors of a bucket, each flattened and viewed as bytes, concatenated in request order without
  padding, so one broadcast carries a whole bucket;
- the payload of `/update_weights_from_tensor` (`serialized_named_tensors`, base64 text);
- the separate process group between trainer and engines (`init_custom_process_group`), created
  exactly as SGLang's `init_custom_process_group` does (TCP rendezvous, `PrefixStore(group_name)`,
  trainer = rank 0), without touching the caller's default process group.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

NamedTensors = list[tuple[str, torch.Tensor]]

# Dtypes a weight can travel as. gloo cannot reduce or broadcast float8, so every transfer moves
# bytes (uint8 views); the dtype only says how to read them back.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} cannot be sent in a weight sync (allowed: {', '.join(DTYPES)})")
    return name


def parse_dtype(name: object, field: str) -> torch.dtype:
    """`"bfloat16"` / `"torch.bfloat16"` -> torch.bfloat16; a ValueError naming `field` otherwise."""
    if isinstance(name, str) and name.removeprefix("torch.") in DTYPES:
        return DTYPES[name.removeprefix("torch.")]
    raise ValueError(f"{field}: {name!r} is not a supported dtype (one of {', '.join(DTYPES)})")


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------
# flattened buckets
# --------------------------------------------------------------------------------------------


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def flatten(named: NamedTensors) -> torch.Tensor:
    """One uint8 tensor holding every tensor's bytes, in order (SGLang's flattened bucket)."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    return torch.cat([as_bytes(t) for _, t in named])


def unflatten(
    flat: torch.Tensor, names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]
) -> NamedTensors:
    """Inverse of `flatten`, given the request's metadata; views where the byte offsets allow."""
    sizes = [nbytes(shape, dtype) for dtype, shape in zip(dtypes, shapes)]
    if sum(sizes) != flat.numel():
        raise ValueError(f"flattened bucket holds {flat.numel()} bytes, metadata describes {sum(sizes)}")
    out: NamedTensors = []
    start = 0
    for name, dtype, shape, size in zip(names, dtypes, shapes, sizes):
        chunk = flat[start : start + size]
        if start % torch.empty((), dtype=dtype).element_size():  # an unaligned byte offset
            chunk = chunk.clone()
        out.append((name, chunk.view(dtype).reshape(list(shape))))
        start += size
    return out


@dataclass(frozen=True)
class BucketMeta:
    """The `names` / `dtypes` / `shapes` fields of an `update_weights_from_distributed` request."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, named: NamedTensors) -> "BucketMeta":
        return cls(
            names=[n for n, _ in named],
            dtypes=[dtype_name(t.dtype) for _, t in named],
            shapes=[list(t.shape) for _, t in named],
        )

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(s, DTYPES[d]) for s, d in zip(self.shapes, self.dtypes))


# --------------------------------------------------------------------------------------------
# /update_weights_from_tensor payloads
# --------------------------------------------------------------------------------------------

_ZIP_MAGIC = b"PK\x03\x04"


def encode_named_tensors(named: NamedTensors) -> str:
    """base64 text of `torch.save(list of (name, tensor))`: one `serialized_named_tensors` entry.

    The embedded engine reads it with `torch.load(weights_only=True)`, which cannot run code. A
    real SGLang server instead expects its `MultiprocessingSerializer` (pickled CUDA IPC handles);
    see `encode_named_tensors_sglang`.
    """
    buf = io.BytesIO()
    torch.save([(n, t.detach().contiguous().cpu()) for n, t in named], buf)
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def encode_named_tensors_sglang(named: NamedTensors) -> str:
    """What `sglang.srt.utils.MultiprocessingSerializer.serialize(named, output_str=True)` sends:
    a ForkingPickler dump (CUDA tensors travel as IPC handles) in base64, for a colocated SGLang."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers the tensor reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def decode_named_tensors(payload: object, field: str) -> NamedTensors:
    """Inverse of `encode_named_tensors`; ValueError naming `field` for anything else."""
    if isinstance(payload, str):
        try:
            raw = base64.b64decode(payload, validate=True)
        except ValueError as e:
            raise ValueError(f"{field}: not valid base64 ({e})") from None
    elif isinstance(payload, (bytes, bytearray)):
        raw = bytes(payload)
    else:
        raise ValueError(f"{field}: expected a base64 string, got {type(payload).__name__}")
    if not raw.startswith(_ZIP_MAGIC):
        raise ValueError(
            f"{field}: not a torch.save payload. The embedded engine does not unpickle request data "
            "(SGLang's MultiprocessingSerializer format), because that could run arbitrary code; "
            "send mcore_rl.rollout.weight_protocol.encode_named_tensors(...) instead"
        )
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure is the client's input
        raise ValueError(f"{field}: could not read the tensors ({type(e).__name__}: {e})") from None
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise ValueError(f"{field}: expected a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]


# --------------------------------------------------------------------------------------------
# the trainer <-> engine process group
# --------------------------------------------------------------------------------------------


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=10),
) -> dist.ProcessGroup:
    """A process group over a TCP rendezvous, independent of the default process group.

    Mirrors SGLang's `init_custom_process_group` (itself from OpenRLHF): rank 0 hosts the TCP
    store; keys live under `group_name`; the group maps group rank i to "global" rank i. Works in a
    process that has no default group (the engine) and in one that has its own (a trainer rank).
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(
        rendezvous(f"tcp://{_host(master_address)}:{int(master_port)}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # `global_ranks_in_group=[]` makes the helper build a standalone group: it neither needs nor
    # consults a default group.
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg: dist.ProcessGroup) -> None:
    dist.destroy_process_group(pg)


def broadcast_bytes(tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Broadcast a tensor's bytes from group rank 0 in place (float8 too, which gloo lacks)."""
    dist.broadcast(tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor, group=group, group_src=0)


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def total_bytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)
