"""Trainer -> engine weight sync: gather megatron-core shards into full Hugging Face tensors, pack
them into buckets, quantize for FP8 engines, and ship them by disk, broadcast or in-process.

DESIGN.md decision 4. The flow, collective over the trainer world (every rank calls `WeightSync.sync`):

1. `iter_hf_weights` walks each rank's model chunks. Shards are gathered where they live —
   TP/ETP shards with `all_gather` in the TP/ETP group, experts across the EP group — by the one
   replica that matters (data-parallel rank 0; expert-data-parallel rank 0 for experts), and named
   with `mcore_rl.hf.weight_map` (the exporter's mapping). Each pipeline stage is gathered by its
   own ranks at the same time; its first rank streams the result to global rank 0 in buckets, one
   stage after another. Only global rank 0 ever holds full tensors, one bucket at a time.
2. On rank 0, FP8 engines get `x.weight` (e4m3) + `x.weight_scale_inv` for every Linear the engine
   quantizes (`engine.fp8.is_quantized_linear_name`), made with the engine's `quantize_block_fp8`.
3. Buckets (default 512 MiB) go to the engines through a transport: `DiskTransport` (safetensors
   shards + `/update_weights_from_disk`), `DistributedTransport` (SGLang's
   `/init_weights_update_group` + `/update_weights_from_distributed`, one broadcast per bucket),
   `TensorTransport` (`/update_weights_from_tensor`: a shared-memory file for engines on the same
   host, or the bytes in the request) or `InProcessTransport` (a colocated
   `EngineCore`). Engines are named by base URL and called through `EngineClient`. They are
   paused for the whole sync (`/pause_generation` ... `/continue_generation`), so no token is
   generated from half-updated weights, and the last request of a sync carries `weight_version`,
   so an engine reports the new version only once every tensor has arrived (rank 0 therefore
   holds up to two buckets: the one in flight and the next).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from mcore_rl.config.schema import ModelConfig
from mcore_rl.hf.weight_map import megatron_to_hf
from mcore_rl.models.shards import gather_data_parallel_shards, iter_local_params, unshard
from mcore_rl.rollout.weight_protocol import (
    BucketMeta,
    NamedTensors,
    broadcast_tensors,
    encode_named_tensors,
    encode_named_tensors_sglang,
    encode_tensor_file,
    flatten,
    init_custom_process_group,
    nbytes,
    parse_dtype,
    unflatten,
    write_safetensors,
)

DEFAULT_BUCKET_BYTES = 512 << 20


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
    roles: list[Optional[_Role]] = [None] * dist.get_world_size()
    dist.all_gather_object(roles, role)
    pp = 1 + max(r.pp_rank for r in roles)
    holders: list[list[int]] = [[] for _ in range(pp)]
    for rank, r in enumerate(roles):
        if r.holder:
            holders[r.pp_rank].append(rank)
    if any(len(h) != 1 for h in holders) or holders[0] != [0]:
        raise RuntimeError(f"weight sync: expected one holder per pipeline stage, rank 0 first; got {holders}")
    return [h[0] for h in holders]


def _gather_tp(param: torch.nn.Parameter, global_name: str, value: torch.Tensor, expert: bool) -> torch.Tensor:
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
    local = int(m.group(1)) - ps.get_expert_model_parallel_rank() * num_local_experts
    return [
        (global_name[: m.start(1)] + str(r * num_local_experts + local) + global_name[m.end(1) :], part)
        for r, part in enumerate(parts)
    ]


def _iter_stage(chunks: Sequence[torch.nn.Module], mc: ModelConfig, role: _Role) -> Iterator[tuple[str, torch.Tensor]]:
    """This stage's full HF tensors on its holder (other participants only join the collectives)."""
    from megatron.core import parallel_state as ps

    num_local_experts = mc.num_experts // ps.get_expert_model_parallel_world_size() if mc.is_moe else 0
    for _, global_name, param in iter_local_params(chunks):
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
        box: list[Optional[BucketMeta]] = [None]
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
    from mcore_rl.rollout.engine.fp8 import is_quantized_linear_name, quantize_block_fp8

    for name, tensor in named:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and tensor.dim() == 2 and is_quantized_linear_name(module):
            q, scale_inv = quantize_block_fp8(tensor)
            yield name, q
            yield module + ".weight_scale_inv", scale_inv
        else:
            yield name, tensor


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Consecutive groups of at most `bucket_bytes` (a larger tensor forms a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        n = tensor.numel() * tensor.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def _with_last(items: Iterable[NamedTensors]) -> Iterator[tuple[NamedTensors, bool]]:
    it = iter(items)
    prev = next(it, None)
    while prev is not None:
        nxt = next(it, None)
        yield prev, nxt is None
        prev = nxt


# --------------------------------------------------------------------------------------------
# 3. engines and transports (rank 0)
# --------------------------------------------------------------------------------------------


class Engines:
    """`EngineClient`s for the engines' base URLs, driven from a private event-loop thread, so the
    synchronous trainer can call every engine at once and broadcast while they wait in their
    handlers. Engine errors surface as the client's `EngineError`s (the message is the engine's)."""

    def __init__(self, urls: Sequence[str], timeout: float = 600.0) -> None:
        from mcore_rl.rollout.client import EngineClient

        if not urls:
            raise ValueError("urls: need at least one engine URL")
        self.urls = list(urls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()
        self.clients = [EngineClient(u, timeout=timeout) for u in self.urls]

    def start(self, method: str, kwargs: dict | Callable[[int], dict]) -> list[Future]:
        """Call `EngineClient.<method>(**kwargs)` on every engine; returns the pending futures."""
        return [
            asyncio.run_coroutine_threadsafe(
                getattr(c, method)(**(kwargs(i) if callable(kwargs) else kwargs)), self._loop
            )
            for i, c in enumerate(self.clients)
        ]

    def call(self, method: str, kwargs: dict | Callable[[int], dict]) -> list:
        return wait_all(self.start(method, kwargs))

    @contextlib.contextmanager
    def paused(self, mode: str) -> Iterator[None]:
        """`/pause_generation` ... `/continue_generation` around a sync (continue also on failure),
        so that no token is generated from half-updated weights."""
        self.call("pause_generation", {"mode": mode})
        try:
            yield
        finally:
            self.call("continue_generation", {})

    def close(self) -> None:
        if self._loop.is_closed():
            return
        for c in self.clients:
            asyncio.run_coroutine_threadsafe(c.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def wait_all(futures: list[Future]) -> list:
    """Every future's result; the first failure is raised once all have finished."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except Exception as e:  # noqa: BLE001 - re-raised below
            error = error or e
            results.append(None)
    if error is not None:
        raise error
    return results


@dataclass
class SyncStats:
    version: int
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class Transport(Protocol):
    def send(self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats) -> None: ...


@dataclass
class DistributedTransport:
    """SGLang's broadcast protocol: the trainer is rank 0 of a group with every engine rank.

    The first `send` calls `/init_weights_update_group` on each engine (rank_offset 1 for the first
    engine, then after each engine's `tp_size` ranks, read from `/get_server_info`) while joining
    the group itself; the group then stays up until `close()`. Each bucket is one
    `/update_weights_from_distributed` request per engine plus, while the engines wait in it, one
    broadcast per tensor (`load_format=None`, SGLang's default, the default here: the embedded
    engine receives each tensor straight into its parameter) or one broadcast of the flattened
    bucket (`load_format="flattened_bucket"`: fewer, larger messages, one staging copy per side).
    """

    urls: Sequence[str]
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0 = a free port
    group_name: str = "weight_update_group"
    backend: str = ""  # "" = nccl with CUDA, gloo without
    load_format: Optional[str] = None
    pause_mode: str = "retract"
    _engines: Optional[Engines] = field(default=None, init=False)
    _group: Optional[dist.ProcessGroup] = field(default=None, init=False)

    def connect(self) -> None:
        if self._group is not None:
            return
        self._engines = self._engines or Engines(self.urls)
        self.backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        port = self.master_port or _free_port(self.master_address)
        sizes = [int(info.get("tp_size", 1)) for info in self._engines.call("get_server_info", {})]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world_size = 1 + sum(sizes)
        futures = self._engines.start("init_weights_update_group", lambda i: dict(
            master_address=self.master_address, master_port=port, rank_offset=offsets[i],
            world_size=world_size, group_name=self.group_name, backend=self.backend,
        ))
        try:
            self._group = init_custom_process_group(
                self.backend, self.master_address, port, 0, world_size, self.group_name
            )
        finally:
            wait_all(futures)

    def send(self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats) -> None:
        self.connect()
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        with self._engines.paused(self.pause_mode):
            for bucket, last in _with_last(buckets):
                meta = BucketMeta.of(bucket)
                fields = dict(group_name=self.group_name, load_format=self.load_format, flush_cache=last)
                if last:
                    fields["weight_version"] = str(version)
                futures = self._engines.start(
                    "update_weights_from_distributed",
                    dict(names=meta.names, dtypes=meta.dtypes, shapes=meta.shapes, **fields),
                )
                try:
                    if self.load_format == "flattened_bucket":
                        broadcast_tensors([flatten(bucket).to(device)], self._group)
                    else:
                        broadcast_tensors([t.detach().to(device).contiguous() for _, t in bucket], self._group)
                finally:
                    wait_all(futures)
                stats.buckets += 1

    def close(self) -> None:
        """Tear the group down on both sides (`/destroy_weights_update_group`)."""
        if self._group is not None:
            futures = self._engines.start("destroy_weights_update_group", {"group_name": self.group_name})
            dist.destroy_process_group(self._group)
            self._group = None
            wait_all(futures)
        if self._engines is not None:
            self._engines.close()
            self._engines = None


@dataclass
class DiskTransport:
    """safetensors shards (one per bucket) plus `model.safetensors.index.json` in `directory`,
    then `/update_weights_from_disk` with that path. The directory must be readable by the
    engines (a shared filesystem for engines on other hosts). Between syncs it holds the latest
    weights (an engine can be restarted from it); each sync rewrites the shards in place, which
    reuses their page cache, and removes shards a smaller sync no longer needs."""

    urls: Sequence[str]
    directory: str
    pause_mode: str = "retract"

    def send(self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats) -> None:
        os.makedirs(self.directory, exist_ok=True)
        weight_map: dict[str, str] = {}
        written: set[str] = set()
        for i, bucket in enumerate(buckets):
            fname = f"model-{i + 1:05d}.safetensors"
            write_safetensors(bucket, os.path.join(self.directory, fname))
            weight_map.update((n, fname) for n, _ in bucket)
            written.add(fname)
            stats.buckets += 1
        _remove(os.path.join(self.directory, f) for f in os.listdir(self.directory)
                if f.endswith(".safetensors") and f not in written)
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": stats.bytes}, "weight_map": weight_map}, f)
        engines = Engines(self.urls)
        try:
            with engines.paused(self.pause_mode):
                engines.call("update_weights_from_disk",
                             dict(model_path=self.directory, weight_version=str(version), flush_cache=True))
        finally:
            engines.close()


@dataclass
class TensorTransport:
    """`/update_weights_from_tensor`, one request per bucket. `payload` says how tensors travel:

    - "shm" (default; engines on this host): each bucket is written, as safetensors, to a file in
      `shm_dir` (default /dev/shm) and the request points at it — the CPU analogue of the CUDA IPC
      handles a colocated SGLang receives. Two such files alternate (the next bucket is written
      while the engines read the current one) and are rewritten in place from sync to sync, which
      is several times faster than fresh shared memory; `close()` removes them;
    - "inline": the bytes travel in the request (base64 safetensors), for engines elsewhere; JSON
      and base64 make this the slowest transport;
    - "sglang": SGLang's `MultiprocessingSerializer` format, for a colocated real SGLang server.
    """

    urls: Sequence[str]
    payload: str = "shm"
    shm_dir: Optional[str] = None
    pause_mode: str = "retract"
    _files: list[str] = field(default_factory=list, init=False)

    def send(self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats) -> None:
        if self.payload not in ("shm", "inline", "sglang"):
            raise ValueError(f"payload: expected 'shm', 'inline' or 'sglang', got {self.payload!r}")
        engines = Engines(self.urls)
        try:
            with engines.paused(self.pause_mode):
                pending: list[Future] = []
                for i, (bucket, last) in enumerate(_with_last(buckets)):
                    fields: dict = dict(serialized_named_tensors=[self._encode(bucket, i % 2)], flush_cache=last)
                    if last:
                        fields["weight_version"] = str(version)
                    wait_all(pending)  # the previous bucket, loaded while this one was written
                    pending = engines.start("update_weights_from_tensor", fields)
                    stats.buckets += 1
                wait_all(pending)
        finally:
            engines.close()

    def _encode(self, bucket: NamedTensors, slot: int) -> str:
        if self.payload == "inline":
            return encode_named_tensors(bucket)
        if self.payload == "sglang":
            return encode_named_tensors_sglang(bucket)
        if not self._files:
            shm_dir = self.shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            stem = os.path.join(shm_dir, f"mcore_rl_weights_{os.getpid()}_{uuid.uuid4().hex[:8]}")
            self._files = [f"{stem}_{k}.safetensors" for k in (0, 1)]
        write_safetensors(bucket, self._files[slot])
        return encode_tensor_file(self._files[slot])

    def close(self) -> None:
        _remove(self._files)
        self._files = []


def _remove(paths: Iterable[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


@dataclass
class InProcessTransport:
    """Colocated `EngineCore`s in this process: buckets go straight into `load_weights`, with the
    same checks as the endpoints. Generation must not run meanwhile: pause the engine around the
    sync (`AsyncEngine.pause("in_place")` ... `resume()`), as the HTTP transports do."""

    cores: Sequence[object]

    def send(self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats) -> None:
        from mcore_rl.rollout.weight_receiver import load_named_tensors

        for bucket in buckets:
            for core in self.cores:
                load_named_tensors(core, bucket)
            stats.buckets += 1
        for core in self.cores:
            core.weight_version = version
            core.flush_cache()


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
    transport: Optional[Transport]  # used on rank 0 only
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    quantization: Optional[str] = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization: expected None or 'fp8', got {self.quantization!r}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be positive, got {self.bucket_bytes}")

    def sync(self, version: int) -> Optional[SyncStats]:
        """Ship the current weights as `version`; returns stats on rank 0, None elsewhere."""
        start = time.perf_counter()
        named = iter_hf_weights(self.chunks, self.model_config, self.bucket_bytes)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if not rank0:
            for _ in named:
                pass
            return None
        stats = SyncStats(version)
        stream = quantize_for_fp8_engine(named) if self.quantization == "fp8" else named
        try:
            self.transport.send(iter_buckets(_counted(stream, stats), self.bucket_bytes), version, stats)
        except BaseException:
            for _ in named:  # finish the collectives, so the other ranks are not left hanging
                pass
            raise
        stats.seconds = time.perf_counter() - start
        return stats


def _counted(named: Iterable[tuple[str, torch.Tensor]], stats: SyncStats) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in named:
        stats.tensors += 1
        stats.bytes += nbytes(tensor.shape, tensor.dtype)
        yield name, tensor


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
