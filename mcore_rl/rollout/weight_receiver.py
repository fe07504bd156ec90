"""Engine side of the weight sync: SGLang's weight-update requests applied to an `EngineCore`.

The server's handlers pass the request's JSON body (a dict) and get SGLang's reply shape back,
`{"success": bool, "message": str}` (HTTP 200 on success, 400 otherwise). A malformed request
raises `ValueError` whose message starts with the offending field, before anything changed. The
server runs the `update_weights_from_*` handlers on the engine thread at a safe point
(`EngineDriver.update_weights`) after honouring `abort_all_requests`; they load, then set the
version the engine reports and flush the cache (`flush_cache`). The group handlers do not touch
the model and block until the trainer joins: the server runs them off the engine thread.
Request fields are those of SGLang's `io_struct`:

- `init_weights_update_group`: master_address, master_port, rank_offset, world_size,
  group_name="weight_update_group", backend="nccl", and our `timeout_s` (SGLang has no such field;
  default 600): how long the rendezvous, and later each broadcast, may wait for the trainer
  before the request fails. The engine joins a process group with the
  trainer (rank 0) as rank `rank_offset` (+ its TP rank, always 0 here) through the trainer's TCP
  store, as SGLang's `init_custom_process_group` does; no default process group is needed.
  `backend="nccl"` needs an engine on CUDA; the CPU engine speaks gloo.
- `update_weights_from_distributed`: names, dtypes, shapes, group_name, flush_cache=True,
  weight_version=None, load_format=None | "flattened_bucket". Receives one broadcast per tensor
  from group rank 0 in request order (float8 as uint8 bytes, which gloo needs and NCCL does
  anyway), or one uint8 broadcast of the flattened bucket, then loads.
- `update_weights_from_tensor`: serialized_named_tensors (one per TP rank; entry 0 is used),
  load_format=None | "direct", flush_cache=True, weight_version=None. An entry carries the
  tensors (`weight_protocol.encode_named_tensors`) or points at a safetensors file in shared
  memory (`encode_tensor_file`, for a trainer on the same host); pickles are refused.
- `update_weights_from_disk`: model_path, load_format=None, weight_version=None,
  flush_cache=True. Loads every *.safetensors file of model_path.
- `destroy_weights_update_group`: group_name.

Files: a path in a request (`model_path`, a tensor file) is read only if it lies, after resolving
symlinks, inside one of the allowed directories (the server's `--weight-dirs`; by default
`launch_flags.default_weight_dirs`). A path outside them is refused with the same message whether
or not it exists, before the filesystem is touched.

Versions: `weight_version` (any string, as in SGLang; an integer is taken as its decimal string)
sets the version the engine reports. Without it a disk update, always a whole checkpoint, advances
an integer version by one (a non-integer one stays), and a bucket (distributed / tensor) leaves it
alone, as SGLang does: a trainer names the version on its last bucket. Every tensor of a request is
checked against the model (name, shape, FP8 dtype) before any is copied, so a rejected request
leaves the weights as they were (a broadcast or read that breaks midway can leave them partly
updated; the reply says so). Bytes land directly in the model's tensors where dtype and shape
allow, so a sync costs one copy on the engine side.
"""

from __future__ import annotations

import io
import math
import os
import threading
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from mcore_rl.rollout.launch_flags import default_weight_dirs

from mcore_rl.rollout.weight_protocol import (
    NamedTensors,
    WeightChecksum,
    broadcast_tensors,
    decode_tensor_payload,
    host_bytes,
    init_custom_process_group,
    nbytes,
    parse_dtype,
    read_safetensors_header,
    unflatten,
)

GROUP_TIMEOUT = timedelta(minutes=10)


@dataclass
class _Group:
    """A joined broadcast group. `staging`: the receive buffer of flattened buckets on CPU, kept
    for the group's lifetime: a fresh buffer per bucket costs first-touch page faults on every sync
    (about as long as the broadcast itself on CPU). On CUDA the caching allocator already reuses."""

    pg: dist.ProcessGroup
    backend: str
    staging: torch.Tensor | None = None

    def buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = None  # free the old one before allocating the larger one
            self.staging = torch.empty(nbytes, dtype=torch.uint8)
        return self.staging[:nbytes]


_groups: weakref.WeakKeyDictionary[Any, dict[str, _Group | None]] = weakref.WeakKeyDictionary()
_groups_lock = threading.Lock()


_checksums: weakref.WeakKeyDictionary[Any, WeightChecksum] = weakref.WeakKeyDictionary()


def received(core: Any) -> WeightChecksum:
    """The checksum of what this engine received: per HF name, the last tensor that arrived for it
    (in the dtype it travelled in, before any cast), over every transport and the in-process path."""
    c = _checksums.get(core)
    if c is None:
        c = _checksums[core] = WeightChecksum(background=True)  # digests overlap the next reads
    return c


def weights_checksum(core: Any) -> dict:
    """`/weights_checksum`: the version the engine serves and the checksum of the tensors it
    received (`weight_protocol.WeightChecksum`), to compare with the trainer's of that version.
    While the weights are released or not reloaded since (zeros), nothing received is held any
    more: the checksum is that of no tensors until the next sync."""
    c = received(core)
    if getattr(core, "weights_released", False) or getattr(core, "weights_need_reload", False):
        c.discard(list(c.digests()))
    return {"weight_version": str(core.weight_version), "checksum": c.hexdigest(), "num_tensors": len(c)}


def _load_recorded(core: Any, named: NamedTensors, digests: Sequence[Any] | None = None) -> int:
    """`core.load_weights(named)`, recording what arrived for `/weights_checksum` (digests of the
    tensors as they arrived, before the load casts anything; `digests` if already under way). If
    the load fails, the bucket's names are unknown until sent again."""
    sums = received(core)
    fp8_layers = getattr(core, "fp8_layers", {})
    try:
        for i, (n, t) in enumerate(named):
            sums.add_digest(n, t.dtype, t.shape, digests[i] if digests is not None else sums.digest_later(t))
            if t.dtype != torch.float8_e4m3fn and n.endswith(".weight") and n[: -len(".weight")] in fp8_layers:
                sums.discard([n[: -len(".weight")] + ".weight_scale_inv"])  # the engine quantizes it: new scales
        return len(core.load_weights(named))
    except BaseException:
        sums.discard(n for n, _ in named)
        raise


def _ok(message: str) -> dict:
    return {"success": True, "message": message}


def _fail(message: str) -> dict:
    return {"success": False, "message": message}


# --------------------------------------------------------------------------------------------
# request fields
# --------------------------------------------------------------------------------------------


def _field(req: dict, name: str, kind: type | tuple[type, ...], default: Any = ..., allow_none: bool = False) -> Any:
    if not isinstance(req, dict):
        raise ValueError(f"request: expected a JSON object, got {type(req).__name__}")
    if name not in req:
        if default is ...:
            raise ValueError(f"{name}: required")
        return default
    value = req[name]
    if value is None and allow_none:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join(k.__name__ for k in kinds)
        raise ValueError(f"{name}: expected {want}{' or null' if allow_none else ''}, got {value!r}"[:300])
    return value


def _version(req: dict) -> str | None:
    value = _field(req, "weight_version", (str, int), None, allow_none=True)
    return None if value is None else str(value)


def core_version(version: str) -> int | str:
    """How the core keeps a version it was given as a string: a canonical decimal integer as an
    int (in-process pools and the trainer compare numbers; it prints back the same), any other
    string as it is."""
    try:
        return int(version) if str(int(version)) == version else version
    except ValueError:
        return version


def next_version(version: Any) -> Any:
    """The version after a whole-checkpoint load that names none: an integer (or a decimal string
    of one) plus one; any other string is kept (there is no "next" of "policy-v3")."""
    if isinstance(version, int) and not isinstance(version, bool):
        return version + 1
    if isinstance(version, str) and version.strip().lstrip("-").isdigit():
        return str(int(version) + 1)
    return version


def check_weights_present(core: Any) -> None:
    """Weight requests need the weights in memory (see `EngineCore.release_memory`)."""
    if getattr(core, "weights_released", False):
        raise ValueError("weights: released by /release_memory_occupation; call /resume_memory_occupation first")


# --------------------------------------------------------------------------------------------
# files: only inside the allowed directories
# --------------------------------------------------------------------------------------------


def _inside(path: str, dirs: Sequence[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def allowed_path(path: str, allowed_dirs: Sequence[str], field: str) -> str:
    """The resolved `path` if it lies in one of `allowed_dirs`, else ValueError. The lexical check
    comes first and touches no file, so a refusal says nothing about what exists outside them;
    the resolved check then stops symlinks that lead out."""
    refused = _refusal(path, allowed_dirs, field)
    if not isinstance(path, str) or not path or "\0" in path:
        raise refused
    lexical = os.path.normpath(os.path.abspath(path))
    if not _inside(lexical, [os.path.normpath(os.path.abspath(d)) for d in allowed_dirs]):
        raise refused
    resolved = os.path.realpath(lexical)
    if not _inside(resolved, [os.path.realpath(d) for d in allowed_dirs]):
        raise refused
    return resolved


def _refusal(path: object, allowed_dirs: Sequence[str], field: str) -> ValueError:
    if not allowed_dirs:
        return ValueError(f"{field}: this server reads no weight files (--weight-dirs is empty)")
    return ValueError(f"{field}: {path!r} is not inside a directory this server reads weights from (--weight-dirs)")


def _open_allowed(path: str, allowed_dirs: Sequence[str], field: str) -> io.BufferedReader:
    """Open a checked path and check again what was opened (a symlink swapped in meanwhile)."""
    f = open(path, "rb")
    opened = f"/proc/self/fd/{f.fileno()}"
    if os.path.exists(opened) and not _inside(os.path.realpath(opened), [os.path.realpath(d) for d in allowed_dirs]):
        f.close()
        raise _refusal(path, allowed_dirs, field)
    return f


def _load_format(req: dict, allowed: tuple[str | None, ...]) -> str | None:
    fmt = _field(req, "load_format", str, None, allow_none=True)
    if fmt not in allowed:
        raise ValueError(f"load_format: {fmt!r} is not supported here (allowed: {list(allowed)})")
    return fmt


def _bucket_meta(req: dict) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    names = _field(req, "names", list)
    dtypes = _field(req, "dtypes", list)
    shapes = _field(req, "shapes", list)
    if not names:
        raise ValueError("names: must not be empty")
    if len(dtypes) != len(names) or len(shapes) != len(names):
        raise ValueError(f"dtypes/shapes: need one per name ({len(names)}), got {len(dtypes)} and {len(shapes)}")
    for i, n in enumerate(names):
        if not isinstance(n, str) or not n:
            raise ValueError(f"names[{i}]: expected a non-empty string, got {n!r}")
    parsed = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes)]
    for i, s in enumerate(shapes):
        if not isinstance(s, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s):
            raise ValueError(f"shapes[{i}]: expected a list of non-negative integers, got {s!r}"[:300])
    return names, parsed, shapes


# --------------------------------------------------------------------------------------------
# loading (shared by every transport and the in-process path)
# --------------------------------------------------------------------------------------------

_FUSED_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
Item = tuple[str, Sequence[int], torch.dtype]


def check_weights(core: Any, items: Iterable[Item], field: str) -> None:
    """ValueError (prefixed with the request `field`) naming the first (name, shape, dtype) the
    engine's model cannot take; run before anything is copied."""
    expected = {n: (tuple(t.shape), t.dtype) for n, t in core.model.state_dict().items()}
    for name, shape, dtype in items:
        if name.endswith(_FUSED_SUFFIXES) or name.endswith("rotary_emb.inv_freq"):
            continue  # stock fused MoE experts / derived buffers: load_weights splits or skips them
        if name not in expected:
            raise ValueError(
                f"{field}: {name!r} is not a weight of the engine's model (quantization={core.quantization})"
            )
        want_shape, want_dtype = expected[name]
        if tuple(shape) != want_shape:
            raise ValueError(f"{field}: {name!r} has shape {list(shape)}, the model's is {list(want_shape)}")
        if dtype == torch.float8_e4m3fn and want_dtype != torch.float8_e4m3fn:
            raise ValueError(f"{field}: {name!r} is FP8, but the engine holds it in {want_dtype} (not an FP8 engine)")
        if not dtype.is_floating_point:
            raise ValueError(f"{field}: {name!r} has dtype {dtype}, not a floating-point weight")


def _items(named: NamedTensors) -> Iterable[Item]:
    return ((n, tuple(t.shape), t.dtype) for n, t in named)


def load_named_tensors(
    core: Any, named: NamedTensors, field: str = "names", digests: Sequence[Any] | None = None
) -> int:
    """Check a whole bucket, then copy it into the model (under the core's lock). `digests`: the
    tensors' content digests if the caller has them (the trainer's, for an in-process engine)."""
    check_weights(core, _items(named), field)
    return _load_recorded(core, named, digests)


def _finish(core: Any, req: dict, count: int, source: str, whole_checkpoint: bool) -> dict:
    """Set the version the engine reports and flush the cache, as the request asks."""
    version = _version(req)
    if version is not None:
        core.weight_version = core_version(version)
    elif whole_checkpoint:
        core.weight_version = next_version(core.weight_version)
    if version is not None or whole_checkpoint:  # a sync is complete: weights are valid again
        core.weights_need_reload = False
    flushed = _field(req, "flush_cache", bool, True) and core.flush_cache()
    return _ok(
        f"Succeeded to update {count} weights from {source}; weight_version={core.weight_version}"
        + ("; cache flushed." if flushed else ".")
    )


def _check_options(req: dict) -> None:
    _version(req)
    _field(req, "flush_cache", bool, True)


# --------------------------------------------------------------------------------------------
# the broadcast group
# --------------------------------------------------------------------------------------------


def init_weights_update_group(core: Any, req: dict, timeout: timedelta = GROUP_TIMEOUT) -> dict:
    """Join the trainer's broadcast group (blocks until every member has joined, at most
    `timeout_s` seconds, default `timeout`)."""
    seconds = _field(req, "timeout_s", (int, float), None, allow_none=True)
    if seconds is not None:
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {seconds!r}")
        timeout = timedelta(seconds=seconds)
    address = _field(req, "master_address", str)
    port = _field(req, "master_port", int)
    rank_offset = _field(req, "rank_offset", int)
    world_size = _field(req, "world_size", int)
    group_name = _field(req, "group_name", str, "weight_update_group")
    backend = _field(req, "backend", str, "nccl")
    if not address:
        raise ValueError("master_address: must not be empty")
    if not 0 < port < 65536:
        raise ValueError(f"master_port: expected 1..65535, got {port}")
    if rank_offset < 1:
        raise ValueError(f"rank_offset: must be >= 1 (rank 0 is the trainer), got {rank_offset}")
    if world_size <= rank_offset:
        raise ValueError(f"world_size: must exceed rank_offset ({rank_offset}), got {world_size}")
    if not group_name:
        raise ValueError("group_name: must not be empty")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and core.device.type != "cuda":
        raise ValueError("backend: 'nccl' needs an engine on CUDA; this engine runs on CPU, use 'gloo'")
    with _groups_lock:
        groups = _groups.setdefault(core, {})
        if group_name in groups:
            raise ValueError(f"group_name: {group_name!r} is already initialized; destroy it first")
        groups[group_name] = None  # reserved while joining
    try:
        pg = init_custom_process_group(backend, address, port, rank_offset, world_size, group_name, timeout)
    except Exception as e:
        with _groups_lock:
            groups.pop(group_name, None)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return _fail(
            f"Failed to initialize custom process group within {timeout.total_seconds():g} s: "
            f"{type(e).__name__}: {detail}"[:1000]
        )
    with _groups_lock:
        groups[group_name] = _Group(pg, backend)
    return _ok(f"Succeeded to initialize custom process group {group_name!r} as rank {rank_offset} of {world_size}.")


def destroy_weights_update_group(core: Any, req: dict) -> dict:
    group_name = _field(req, "group_name", str, "weight_update_group")
    with _groups_lock:
        entry = _groups.get(core, {}).get(group_name)
        if entry is None:
            return _fail(f"The group to be destroyed does not exist: {group_name!r}")
        del _groups[core][group_name]
    dist.destroy_process_group(entry.pg)
    return _ok(f"Succeeded to destroy custom process group {group_name!r}.")


def _group(core: Any, group_name: str) -> _Group:
    entry = _groups.get(core, {}).get(group_name)
    if entry is None:
        raise ValueError(f"group_name: {group_name!r} is not initialized; call /init_weights_update_group first")
    return entry


# --------------------------------------------------------------------------------------------
# weight updates
# --------------------------------------------------------------------------------------------


def _destinations(core: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The model's own tensors by HF name, where bytes can land directly (no staging copy); the
    `load_weights` call that follows then skips the copy (same memory) and only refreshes what the
    engine derives from its weights."""
    return {n: t for n, t in core.model.state_dict().items() if t.is_contiguous() and t.device == device}


def _landing(
    dest: dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    t = dest.get(name)
    if t is not None and t.dtype == dtype and tuple(t.shape) == tuple(shape):
        return t
    return torch.empty(list(shape), dtype=dtype, device=device)


def update_weights_from_distributed(core: Any, req: dict) -> dict:
    """Receive one bucket by broadcast from the trainer (group rank 0) and load it.

    Per-tensor broadcasts land directly in the model's parameters when dtype and shape match (the
    names were checked first); a flattened bucket lands in one buffer and is copied from there."""
    names, dtypes, shapes = _bucket_meta(req)
    group_name = _field(req, "group_name", str, "weight_update_group")
    fmt = _load_format(req, (None, "flattened_bucket"))
    _check_options(req)
    group = _group(core, group_name)
    pg, backend = group.pg, group.backend
    try:
        check_weights_present(core)
        released = None
    except ValueError as e:
        released = e  # still receive (into scratch), so the trainer's broadcast completes
    device = core.device if backend == "nccl" else torch.device("cpu")
    try:
        check_weights(core, zip(names, shapes, dtypes), "names")
        refused = released
    except ValueError as e:
        refused = released or e  # still receive (into scratch), so the trainer's broadcast completes
    dest = {} if refused else _destinations(core, device)
    digests: list[Any] = []
    try:
        if fmt == "flattened_bucket":
            received(core).wait()  # the last bucket's digests read the buffer this one reuses
            flat = group.buffer(sum(nbytes(s, d) for s, d in zip(shapes, dtypes)), device)
            broadcast_tensors([flat], pg)
            named = unflatten(flat, names, dtypes, shapes)
        else:
            named = [(n, _landing(dest, n, d, s, device)) for n, d, s in zip(names, dtypes, shapes)]
            # each tensor's digest while the later ones are still arriving
            sums = received(core)
            broadcast_tensors(
                [t for _, t in named],
                pg,
                each=None if refused else lambda i: digests.append(sums.digest_later(named[i][1])),
            )
    except Exception as e:
        if not refused:
            received(core).discard(names)
        return _fail(
            f"Failed to receive weights over {group_name!r} (the model may be partially updated; "
            f"send the whole model again): {type(e).__name__}: {e}"
        )
    if refused:
        raise refused
    count = _load_recorded(core, named, digests or None)
    return _finish(core, req, count, f"distributed group {group_name!r}", whole_checkpoint=False)


def update_weights_from_tensor(core: Any, req: dict, allowed_dirs: Sequence[str] | None = None) -> dict:
    """Load the tensors of `serialized_named_tensors[0]`: carried in the request, or in the
    shared-memory file it points at (a colocated trainer's bucket), which must lie in
    `allowed_dirs` (None: `default_weight_dirs`)."""
    payloads = _field(req, "serialized_named_tensors", list)
    if not payloads:
        raise ValueError("serialized_named_tensors: must hold one entry per TP rank (this engine has 1)")
    _load_format(req, (None, "direct"))
    _check_options(req)
    check_weights_present(core)
    field = "serialized_named_tensors[0]"
    named, path = decode_tensor_payload(payloads[0], field)
    if path is not None:
        allowed = _allowed(core, allowed_dirs)
        resolved = allowed_path(path, allowed, field)
        return _load_files(core, req, [resolved], field, source=path, whole_checkpoint=False, allowed_dirs=allowed)
    count = load_named_tensors(core, named, field)
    return _finish(core, req, count, "tensor", whole_checkpoint=False)


def update_weights_from_disk(core: Any, req: dict, allowed_dirs: Sequence[str] | None = None) -> dict:
    """Load every *.safetensors file under `model_path` (a whole checkpoint or a partial one),
    which must lie in `allowed_dirs` (None: `default_weight_dirs`)."""
    path = _field(req, "model_path", str)
    _load_format(req, (None, "auto", "safetensors"))
    _check_options(req)
    check_weights_present(core)
    allowed = _allowed(core, allowed_dirs)
    resolved = allowed_path(path, allowed, "model_path")
    files = sorted(f for f in os.listdir(resolved) if f.endswith(".safetensors")) if os.path.isdir(resolved) else []
    if not files:
        raise ValueError(f"model_path: {path!r} is not a directory with *.safetensors files")
    paths = [allowed_path(os.path.join(resolved, f), allowed, "model_path") for f in files]
    return _load_files(core, req, paths, "model_path", source=path, whole_checkpoint=True, allowed_dirs=allowed)


def _allowed(core: Any, allowed_dirs: Sequence[str] | None) -> list[str]:
    return list(allowed_dirs) if allowed_dirs is not None else default_weight_dirs(getattr(core, "model_path", None))


def _load_files(
    core: Any, req: dict, files: list[str], field: str, source: str, whole_checkpoint: bool, allowed_dirs: Sequence[str]
) -> dict:
    """Check every file's header before any weight changes; then read each file's bytes straight
    into the model's parameters where dtype and shape match (else into a buffer that
    `load_weights` converts), one file at a time."""
    try:
        headers = []
        for f in files:
            with _open_allowed(f, allowed_dirs, field) as fh:
                headers.append(read_safetensors_header(fh))
    except (OSError, ValueError) as e:
        if str(e).startswith(f"{field}: "):
            raise
        raise ValueError(f"{field}: cannot read {source!r}: {e}") from None
    check_weights(core, ((e.name, e.shape, e.dtype) for h in headers for e in h), field)
    cpu = torch.device("cpu")
    dest = _destinations(core, cpu)
    count = 0
    for f, entries in zip(files, headers):
        try:
            with _open_allowed(f, allowed_dirs, field) as fh:
                named, digests = [], []
                for entry in entries:
                    target = _landing(dest, entry.name, entry.dtype, entry.shape, cpu)
                    fh.seek(entry.begin)
                    if fh.readinto(host_bytes(target).data) != entry.end - entry.begin:
                        received(core).discard(x.name for x in entries)
                        return _fail(f"Failed to read {entry.name!r} from {f} (the model may be partially updated)")
                    named.append((entry.name, target))
                    digests.append(received(core).digest_later(target))  # while the next one is read
        except BaseException:
            received(core).discard(x.name for x in entries)
            raise
        count += _load_recorded(core, named, digests)
    return _finish(core, req, count, source, whole_checkpoint)


def get_weights_by_name(core: Any, name: str, truncate_size: int = 100) -> list | None:
    """SGLang's `/get_weights_by_name`: the weight as float32 nested lists, its first
    `truncate_size` rows (outermost dimension); None if the model has no such weight. FP8 layers
    give their e4m3 values (the scales are `<name>_scale_inv`)."""
    check_weights_present(core)
    tensors = core.model.state_dict()
    if name == "lm_head.weight" and name not in tensors and core.config.tie_word_embeddings:
        name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    t = tensors.get(name)
    if t is None:
        return None
    t = t.detach().to("cpu", torch.float32)
    return t[:truncate_size].tolist() if t.dim() else t.tolist()
