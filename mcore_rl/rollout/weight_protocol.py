"""What travels between the trainer and an engine during a weight sync, in SGLang's formats.

Both sides import this module, so the byte layout is defined once:

- dtype names as SGLang's `update_weights_from_distributed` sends them (`"bfloat16"`, resolved
  with `getattr(torch, name)`), restricted to the dtypes a checkpoint can hold;
- the *flattened bucket* (SGLang's `FlattenedTensorBucket`, `load_format="flattened_bucket"`): the
  tensors of a bucket, each flattened and viewed as bytes, concatenated in request order without
  padding, so one broadcast carries a whole bucket;
- safetensors, written and read with one copy: the disk transport's shards, and (in base64) the
  payload of `/update_weights_from_tensor` (`serialized_named_tensors`);
- the separate process group between trainer and engines (`init_custom_process_group`), created
  exactly as SGLang's `init_custom_process_group` does (TCP rendezvous, `PrefixStore(group_name)`,
  trainer = rank 0), without touching the caller's default process group;
- the weight checksum (`WeightChecksum`, ours: SGLang has none) that the trainer computes over what
  it sends and the engine over what it received, so a sync can be checked end to end.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import struct
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    import numpy as np
    from torch.distributed.distributed_c10d import GroupName  # not in every torch the pin admits

NamedTensors = list[tuple[str, torch.Tensor]]

# Dtypes a weight can travel as.
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
    return n * dtype.itemsize


# --------------------------------------------------------------------------------------------
# flattened buckets
# --------------------------------------------------------------------------------------------


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (a copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def flatten(named: NamedTensors, out: torch.Tensor | None = None) -> torch.Tensor:
    """One uint8 tensor holding every tensor's bytes, in order (SGLang's flattened bucket).

    Each tensor is copied straight into its slice (`torch.cat` of uint8 views runs several times
    slower than a copy on CPU). `out`: a uint8 buffer of at least the bucket's size to fill instead
    of a new one (its first bytes are returned): a buffer reused across buckets and syncs has its
    pages already mapped, and first-touch page faults cost as much as the copy itself on CPU."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    total = sum(t.numel() * t.element_size() for _, t in named)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=named[0][1].device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < total:
        raise ValueError(f"out: expected a 1-D uint8 tensor of at least {total} bytes")
    flat = out[:total]
    at = 0
    for _, t in named:
        n = t.numel() * t.element_size()
        chunk = flat[at : at + n]
        if t.dim() and chunk.storage_offset() % t.element_size() == 0:
            chunk.view(t.dtype).view(t.shape).copy_(t.detach())  # no contiguous() copy first
        else:
            chunk.copy_(as_bytes(t))
        at += n
    return flat


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
        out.append((name, _view(flat[start : start + size], dtype, shape)))
        start += size
    return out


@dataclass(frozen=True)
class BucketMeta:
    """The `names` / `dtypes` / `shapes` fields of an `update_weights_from_distributed` request."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, named: NamedTensors) -> BucketMeta:
        return cls(
            names=[n for n, _ in named],
            dtypes=[dtype_name(t.dtype) for _, t in named],
            shapes=[list(t.shape) for _, t in named],
        )

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(s, DTYPES[d]) for s, d in zip(self.shapes, self.dtypes))


# --------------------------------------------------------------------------------------------
# safetensors: disk shards and /update_weights_from_tensor payloads
# --------------------------------------------------------------------------------------------
#
# Written here rather than with `safetensors.torch.save_file`, which first turns every tensor into
# a Python bytes object (a second copy of the bucket); these write each tensor's memory straight
# into the file or buffer. Read side: the engine copies file bytes straight into its parameters.
# The format is the standard one (any safetensors reader opens the files, and the engine reads
# files any safetensors writer made): u64 little-endian header length, a JSON header
# {name: {"dtype", "shape", "data_offsets": [begin, end)}} padded with spaces to 8 bytes, then the
# data, offsets relative to its start.

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class StEntry:
    """One tensor of a safetensors file/buffer; `begin`/`end` are absolute byte offsets."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def host_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (a copy only when the tensor is
    not a contiguous CPU tensor): the zero-copy bridge to file and buffer I/O."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def safetensors_header(named: NamedTensors, metadata: dict[str, str] | None = None) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in named:
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(named: NamedTensors, path: str) -> None:
    """Write (or overwrite in place: rewriting pages the file already has is several times faster
    than filling fresh page cache or shared memory)."""
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.write(safetensors_header(named))
        for _, t in named:
            f.write(host_bytes(t).data)
        f.truncate()


def safetensors_bytes(named: NamedTensors) -> bytearray:
    header = safetensors_header(named)
    buf = bytearray(len(header) + sum(t.numel() * t.element_size() for _, t in named))
    buf[: len(header)] = header
    view, at = memoryview(buf), len(header)
    for _, t in named:
        data = host_bytes(t)
        view[at : at + data.size] = data.data
        at += data.size
    return buf


def parse_safetensors_header(
    head: bytes, read_more: Callable[[int], bytes], total_size: int
) -> tuple[list[StEntry], dict[str, str]]:
    """Entries and `__metadata__` of a safetensors file/buffer of `total_size` bytes whose first 8
    bytes are `head`; `read_more(n)` returns the next n bytes. ValueError if anything is invalid."""
    if len(head) != 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES or 8 + size > total_size:
        raise ValueError(f"safetensors header of {size} bytes does not fit")
    try:
        header = json.loads(read_more(size))
    except ValueError as e:
        raise ValueError(f"safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError("safetensors __metadata__ is not a JSON object")
    start, entries = 8 + size, []
    for name, info in header.items():
        try:
            dtype, shape = _ST_NAMES[info["dtype"]], tuple(int(d) for d in info["shape"])
            begin, end = (start + int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"safetensors header entry {name!r} is malformed: {info!r}"[:300]) from None
        if not start <= begin <= end <= total_size or end - begin != nbytes(shape, dtype):
            raise ValueError(f"safetensors entry {name!r}: offsets [{begin}, {end}) do not fit its shape or the data")
        entries.append(StEntry(name, dtype, shape, begin, end))
    return entries, metadata


def read_safetensors_header(f: io.BufferedReader) -> list[StEntry]:
    return parse_safetensors_header(f.read(8), f.read, os.fstat(f.fileno()).st_size)[0]


def encode_named_tensors(named: NamedTensors) -> str:
    """One `serialized_named_tensors` entry for the embedded engine, carrying the tensors: base64
    of them in safetensors format (read without unpickling anything). A real SGLang server instead
    expects its `MultiprocessingSerializer` format; see `encode_named_tensors_sglang`."""
    return base64.b64encode(safetensors_bytes(named)).decode("ascii")


def encode_tensor_file(path: str) -> str:
    """One `serialized_named_tensors` entry that points at a safetensors file on the engine's host
    (shared memory, e.g. /dev/shm) instead of carrying the bytes: the CPU analogue of the CUDA IPC
    handles a colocated SGLang receives. A header-only safetensors whose metadata names the file."""
    return base64.b64encode(safetensors_header([], {"file": str(path)})).decode("ascii")


def encode_named_tensors_sglang(named: NamedTensors) -> str:
    """What `sglang.srt.utils.MultiprocessingSerializer.serialize(named, output_str=True)` sends:
    a ForkingPickler dump (CUDA tensors travel as IPC handles) in base64, for a colocated SGLang."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers the tensor reductions

    buf = io.BytesIO()
    ForkingPickler(buf).dump(list(named))
    return base64.b64encode(buf.getbuffer()).decode("ascii")


def decode_tensor_payload(payload: object, field: str) -> tuple[NamedTensors, str | None]:
    """Inverse of `encode_named_tensors` (tensors are read-only views of the decoded bytes) or of
    `encode_tensor_file` (the file's path); a ValueError naming `field` for anything else —
    pickles (SGLang's format) included, since unpickling request data could run arbitrary code."""
    if not isinstance(payload, str):
        raise ValueError(f"{field}: expected a base64 string, got {type(payload).__name__}")
    try:
        raw = binascii.a2b_base64(payload)
    except (ValueError, binascii.Error) as e:
        raise ValueError(f"{field}: not valid base64 ({e})") from None
    if raw[:1] == b"\x80":
        raise ValueError(
            f"{field}: a pickle (SGLang's MultiprocessingSerializer format); the embedded engine does not "
            "unpickle request data, send mcore_rl.rollout.weight_protocol.encode_named_tensors(...)"
        )
    view = memoryview(raw)
    try:
        entries, metadata = parse_safetensors_header(bytes(view[:8]), lambda n: bytes(view[8 : 8 + n]), len(raw))
    except ValueError as e:
        raise ValueError(f"{field}: not a safetensors payload ({e})") from None
    if "file" in metadata:
        if entries:
            raise ValueError(f"{field}: a file reference must not also carry tensors")
        return [], metadata["file"]
    with warnings.catch_warnings():  # the tensors only get copied from: read-only memory is fine
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    return [(e.name, _view(flat[e.begin : e.end], e.dtype, e.shape)) for e in entries], None


def _view(chunk: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if chunk.storage_offset() % dtype.itemsize:
        chunk = chunk.clone()  # an unaligned offset: view() needs one
    return chunk.view(dtype).reshape(list(shape))


# --------------------------------------------------------------------------------------------
# checksums: did every engine get exactly what the trainer sent?
# --------------------------------------------------------------------------------------------
#
# A tensor's content digest is a position-weighted sum of its bytes read as little-endian int64
# words, mod 2^64: rows of 1024 words are multiplied by 1024 fixed odd constants and summed (one
# int64 matrix-vector product), the row sums likewise with constants of the next level, and so on.
# Integer arithmetic mod 2^64 is exact and does not depend on summation order, so trainer and
# engine, CPU and GPU, any thread count, get the same number; it reads the bytes once (~9 GB/s on
# one CPU core's memory bandwidth, against ~0.8 GB/s for blake2b). Every word has an odd (hence
# invertible) weight, so changing any one word always changes the digest; moving words (a transpose,
# swapped rows) changes their weights. It is a check against accidents, not an adversary.

_ROW = 1024  # int64 words per row
_LEVELS = 7  # enough for 1024**7 words


def _splitmix64(seed: int, n: int) -> list[int]:
    out, x = [], seed
    for _ in range(n):
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
        out.append(((z | 1) ^ (1 << 63)) - (1 << 63))  # odd, as a signed int64
    return out


_MULTIPLIERS = [_splitmix64(level + 1, _ROW) for level in range(_LEVELS)]
_TAIL_MULTIPLIER = _splitmix64(0, 1)[0]
_weights_cache: dict[tuple[str, int], torch.Tensor] = {}


def _level_weights(level: int, device: torch.device) -> torch.Tensor:
    key = (str(device), level)
    w = _weights_cache.get(key)
    if w is None:
        w = _weights_cache[key] = torch.tensor(_MULTIPLIERS[level], dtype=torch.int64, device=device)
    return w


def _row_sums(x: torch.Tensor, level: int, mv: bool | None = None) -> torch.Tensor:
    """x [n] int64 -> [ceil(n / 1024)]: each row of 1024 words weighted by this level's constants.
    `mv`: one int64 matrix-vector product (CPU; default there), else products and sums."""
    w = _level_weights(level, x.device)
    rows = x.numel() // _ROW
    use_mv = x.device.type == "cpu" if mv is None else mv
    parts = []
    if rows:
        head = x[: rows * _ROW].view(rows, _ROW)
        if use_mv:
            parts.append(torch.mv(head, w))
        else:  # no integer matrix-vector product on GPUs: products and sums, 64 MiB of rows at a time
            step = max(1, (8 << 20) // _ROW)
            parts += [(head[i : i + step] * w).sum(1) for i in range(0, rows, step)]
    rest = x[rows * _ROW :]
    if rest.numel():
        parts.append((rest * w[: rest.numel()]).sum().view(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tensor_digest(tensor: torch.Tensor, mv: bool | None = None) -> torch.Tensor:
    """The 64-bit content digest of a tensor's bytes (see above), as a 0-dim int64 tensor on the
    tensor's device (reading it back is left to the caller, so GPU digests need no sync each).
    `mv=False` takes the GPU path on any device (for tests)."""
    raw = as_bytes(tensor)
    n = raw.numel()
    words = n // 8
    if raw.data_ptr() % 8:
        raw = raw.clone()  # an unaligned view (inside a flattened bucket): int64 needs alignment
    x = raw[: words * 8].view(torch.int64)
    level = 0
    while x.numel() > 1:
        x = _row_sums(x, level, mv)
        level += 1
    # (a one-word tensor's digest is that word: copied, not a view of memory a later sync reuses)
    digest = x.reshape(()).clone() if x.numel() else torch.zeros((), dtype=torch.int64, device=raw.device)
    if n % 8:  # the last bytes, zero-padded to a word, with a multiplier of their own
        tail = torch.zeros(8, dtype=torch.uint8, device=raw.device)
        tail[: n % 8] = raw[words * 8 :]
        digest = digest + tail.view(torch.int64)[0] * _TAIL_MULTIPLIER
    return digest


def _entry_digest(name: str, dtype: torch.dtype, shape: Sequence[int], content: int) -> int:
    """One name's contribution: its name, dtype and shape hashed with its content digest."""
    key = f"{name}\0{str(dtype).removeprefix('torch.')}\0{','.join(str(int(d)) for d in shape)}\0".encode()
    h = hashlib.blake2b(key + (content & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _digest_worker() -> ThreadPoolExecutor:
    """One thread per process that digests CPU tensors in the background (torch releases the GIL)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-digest")
        return _worker


class WeightChecksum:
    """An order-independent 64-bit checksum over named tensors: the sum mod 2^64 of one digest per
    name, of the last tensor added under it (name, dtype, shape and bytes all count).

    The trainer adds every tensor it sends (after FP8 quantization), the engine every tensor it
    receives, before any cast; equal `hexdigest()`s mean each name holds the bytes the trainer
    sent. Content digests of GPU tensors stay on the GPU until `hexdigest()` reads them back. With
    `background`, CPU tensors are digested on a worker thread while the caller goes on sending or
    receiving (a digest reads every byte once: on CPU that costs about as much as a copy); the
    caller must not change a tensor it added before `wait()` (or `hexdigest()`) returns."""

    def __init__(self, background: bool = False) -> None:
        self.background = background
        self._done: dict[str, int] = {}
        self._pending: dict[str, tuple[torch.dtype, tuple[int, ...], torch.Tensor | Future]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_digest(name, tensor.dtype, tuple(tensor.shape), self.digest_later(tensor))

    def add_digest(self, name: str, dtype: torch.dtype, shape: Sequence[int], content: torch.Tensor | Future) -> None:
        """`content`: `tensor_digest` of the tensor, or its future (computed as other bytes arrived)."""
        self._done.pop(name, None)
        self._pending[name] = (dtype, tuple(int(d) for d in shape), content)

    def digest_later(self, tensor: torch.Tensor) -> torch.Tensor | Future:
        """`tensor_digest(tensor)`, on the worker thread if `background` (for `add_digest`)."""
        if self.background and tensor.device.type == "cpu":
            return _digest_worker().submit(tensor_digest, tensor)
        return tensor_digest(tensor)

    def contents(self, names: Sequence[str]) -> list[torch.Tensor | Future] | None:
        """The content digests (or their futures) of `names` if all are still pending, else None:
        for a receiver that holds the very tensors added here (an in-process engine), so that it
        need not read them again."""
        got = [self._pending.get(n) for n in names]
        return [g[2] for g in got if g is not None] if all(g is not None for g in got) else None

    def discard(self, names: Iterable[str]) -> None:
        """Forget these names (their tensors may be partly overwritten: unknown until sent again)."""
        for n in names:
            self._done.pop(n, None)
            self._pending.pop(n, None)

    def wait(self) -> None:
        """Every digest computed: the tensors added may change from now on."""
        if not self._pending:
            return
        contents = {n: c.result() if isinstance(c, Future) else c for n, (_, _, c) in self._pending.items()}
        by_device: dict[torch.device, list[str]] = {}
        for name, d in contents.items():
            by_device.setdefault(d.device, []).append(name)
        for names in by_device.values():
            values = torch.stack([contents[n] for n in names]).tolist()  # one read-back per device
            for n, v in zip(names, values):
                dtype, shape, _ = self._pending[n]
                self._done[n] = _entry_digest(n, dtype, shape, v)
        self._pending.clear()

    def digests(self) -> dict[str, int]:
        self.wait()
        return dict(self._done)

    def hexdigest(self) -> str:
        self.wait()
        return f"{sum(self._done.values()) & 0xFFFFFFFFFFFFFFFF:016x}"

    def __len__(self) -> int:
        return len(self._done) + len(self._pending)


def checksum_problem(reply: object, version: object, expected: WeightChecksum) -> str | None:
    """Why an engine's `/weights_checksum` reply does not show the trainer's `version` with exactly
    the tensors of `expected`; None if it does."""
    want = f"weight_version {version}, checksum {expected.hexdigest()} ({len(expected)} tensors)"
    if not isinstance(reply, dict):
        return f"answered {reply!r} to /weights_checksum"[:300]
    got = (
        f"weight_version {reply.get('weight_version')}, checksum {reply.get('checksum')} "
        f"({reply.get('num_tensors')} tensors)"
    )
    if (
        str(reply.get("weight_version")) != str(version)
        or reply.get("checksum") != expected.hexdigest()
        or reply.get("num_tensors") != len(expected)
    ):
        return f"reports {got}; the trainer sent {want}"
    return None


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
        world_size, rank, [], Backend(backend), store, group_name=cast("GroupName", group_name), timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, each: Callable[[int], None] | None = None
) -> None:
    """Broadcast tensors from group rank 0 in place, in order, each in its own dtype as SGLang's
    receiver expects; float8 goes as uint8 bytes (gloo has no float8; NCCL maps it to uint8 too).
    All are posted before waiting, so small tensors do not each pay a round trip. `each(i)` runs
    once tensor i is complete, while later ones are still on the wire (the receiver's checksum)."""
    works = [
        dist.broadcast(t.view(torch.uint8) if t.dtype in _FLOAT8 else t, group=group, group_src=0, async_op=True)
        for t in tensors
    ]
    error: BaseException | None = None
    for i, w in enumerate(works):
        w.wait()
        if each is not None and error is None:
            try:
                each(i)
            except BaseException as e:
                error = e
    if error is not None:
        raise error


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
