"""The engine side of trainer -> engine weight sync: the transports that ship HF-named buckets.

docs/design.md#weights-by-name. A transport gets buckets of full HF-named tensors (from
`mcore_rl.train.weight_sync`) and delivers them to every engine of an engine pool:

- `DiskTransport`: safetensors shards + `/update_weights_from_disk`;
- `DistributedTransport`: SGLang's `/init_weights_update_group` + `/update_weights_from_distributed`,
  the trainer being rank 0 of a broadcast group with every engine rank;
- `TensorTransport`: `/update_weights_from_tensor` (a shared-memory file for engines on the same
  host, or the bytes in the request);
- `InProcessTransport`: colocated `EngineCore`s, straight into `load_weights`.

HTTP transports reach the engines only through the pool's fan-out (`weight_update`, `start`,
`wait`, `delivered`). Engines are paused for the whole sync (`/pause_generation` ...
`/continue_generation`), so no token is generated from half-updated weights, and the last request
of a sync carries `weight_version`, so an engine reports the new version only once every tensor
has arrived. An engine that dies during a sync drops out of it (the pool marks it dead; it gets
the whole of the next sync once it is back); the others get every tensor.

Checksums: when `stats.checksum` is given (the trainer's `WeightChecksum` of what it sends, filled
while the buckets are made: `train.weight_sync.iter_buckets`), every engine's `/weights_checksum`
is compared with it before the engine may generate again. Engines that differ, or report another
version, are left paused and out of routing and listed in `stats.mismatched`; the trainer re-syncs
them (`send(..., only=...)`). So does an engine whose sync failed halfway: only engines that got,
and confirmed, the whole model resume.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import subprocess
import tempfile
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: the engine (and its model code) loads with the engines that use it
    from mcore_rl.rollout.engine.core import EngineCore

from mcore_rl.rollout.weight_protocol import (
    BucketMeta,
    NamedTensors,
    WeightChecksum,
    checksum_problem,
    broadcast_tensors,
    encode_named_tensors,
    encode_named_tensors_sglang,
    encode_tensor_file,
    flatten,
    init_custom_process_group,
    write_safetensors,
)
from mcore_rl.rollout.weight_receiver import load_named_tensors, weights_checksum

logger = logging.getLogger(__name__)
SHM_PREFIX = "mcore_rl_weights_"  # + the trainer's pid + "_": shared-memory buckets of `TensorTransport`


class EngineFanout(Protocol):
    """What an HTTP transport needs of the engine pool (`mcore_rl.rollout.pool.HTTPEnginePool`)."""

    def weight_update(
        self, mode: str, urls: Sequence[str] | None = None
    ) -> contextlib.AbstractContextManager[list[str]]: ...

    def start(self, method: str, kwargs: Any, urls: Sequence[str] | None = None) -> dict[str, Future]: ...

    def wait(self, futures: dict[str, Future], what: str) -> dict[str, Any]: ...

    def call(self, method: str, kwargs: Any, urls: Sequence[str] | None = None) -> dict[str, Any]: ...

    def delivered(
        self, urls: Sequence[str], version: int, checksum: WeightChecksum | None = None
    ) -> dict[str, str]: ...


@dataclass
class SyncStats:
    version: int
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    checksum: WeightChecksum | None = None  # of what was sent; None: engines are not checked
    mismatched: dict[str, str] = field(default_factory=dict)  # engine -> why its checksum differs
    resynced: list[str] = field(default_factory=list)  # engines that needed a second send

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


class Transport(Protocol):
    def send(
        self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats, only: Sequence[str] | None = None
    ) -> None:
        """Every bucket to every engine (`only`: to these engines, by the names `stats.mismatched`
        uses), then check them against `stats.checksum` if set."""


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

    engines: EngineFanout
    master_address: str = "127.0.0.1"
    master_port: int = 0  # 0 = a free port
    group_name: str = "weight_update_group"
    backend: str = ""  # "" = nccl with CUDA, gloo without
    load_format: str | None = None
    pause_mode: str = "retract"
    rendezvous_timeout_s: float | None = None  # how long an engine waits to join the group
    _group: dist.ProcessGroup | None = field(default=None, init=False)
    _members: list[str] = field(default_factory=list, init=False)
    _staging: torch.Tensor | None = field(default=None, init=False)  # flattened buckets on CPU

    def connect(self, urls: Sequence[str] | None = None) -> None:
        """Form the group with the engines `urls` (default: the pool's live ones); a group with
        other members is torn down first (an engine died or came back since it was formed)."""
        infos = self.engines.call("get_server_info", {}, urls)  # those that answer
        urls = list(infos)
        if self._group is not None and urls == self._members:
            return
        self.close()
        self.backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        port = self.master_port or _free_port(self.master_address)
        sizes = [int(infos[u].get("tp_size", 1)) for u in urls]
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        world_size = 1 + sum(sizes)
        futures = self.engines.start(
            "init_weights_update_group",
            lambda i: dict(
                master_address=self.master_address,
                master_port=port,
                rank_offset=offsets[i],
                world_size=world_size,
                group_name=self.group_name,
                backend=self.backend,
                timeout_s=self.rendezvous_timeout_s,
            ),
            urls,
        )
        try:
            self._group = init_custom_process_group(
                self.backend, self.master_address, port, 0, world_size, self.group_name
            )
        finally:
            self.engines.wait(futures, "/init_weights_update_group")
        self._members = urls

    def send(
        self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats, only: Sequence[str] | None = None
    ) -> None:
        """Every bucket to every member. An engine that dies while a broadcast is under way breaks
        the group's collectives: that sync fails (the next one forms a new group without it).
        With `only`, the group is formed with those engines alone (and re-formed for the next)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        with self.engines.weight_update(self.pause_mode, only) as targets:
            self.connect(targets)
            group = self._group
            assert group is not None  # connect() formed it
            targets[:] = list(self._members)
            for bucket, last in _with_last(buckets):
                meta = BucketMeta.of(bucket)
                fields = dict(group_name=self.group_name, load_format=self.load_format, flush_cache=last)
                if last:
                    fields["weight_version"] = str(version)
                futures = self.engines.start(
                    "update_weights_from_distributed",
                    dict(names=meta.names, dtypes=meta.dtypes, shapes=meta.shapes, **fields),
                    targets,
                )
                try:
                    if self.load_format == "flattened_bucket":
                        broadcast_tensors([self._flatten(bucket, meta.total_bytes, device)], group)
                    else:
                        broadcast_tensors([t.detach().to(device).contiguous() for _, t in bucket], group)
                except BaseException:
                    self._drop_group()
                    raise
                finally:
                    answered = self.engines.wait(futures, "/update_weights_from_distributed")
                if len(answered) < len(targets):  # the group lost a member: the next sync re-forms it
                    self._drop_group()
                    raise RuntimeError(
                        f"weight sync: engines {sorted(set(targets) - set(answered))} dropped out of "
                        "the broadcast group during a sync"
                    )
                stats.buckets += 1
            stats.mismatched.update(self.engines.delivered(targets, version, stats.checksum))

    def _flatten(self, bucket: NamedTensors, total: int, device: torch.device) -> torch.Tensor:
        """The bucket as one uint8 tensor on `device`. On CPU it is written into a buffer kept
        between buckets and syncs (fresh memory costs page faults as long as the copy); on CUDA
        the caching allocator reuses memory already, and a buffer held here would stay out of
        the trainer's reach between syncs."""
        if device.type != "cpu":
            return flatten(bucket, out=torch.empty(total, dtype=torch.uint8, device=device))
        if self._staging is None or self._staging.numel() < total:
            self._staging = None
            self._staging = torch.empty(total, dtype=torch.uint8)
        return flatten(bucket, out=self._staging)

    def _drop_group(self) -> None:
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
            self._members = []

    def close(self) -> None:
        """Tear the group down on both sides (`/destroy_weights_update_group`)."""
        self._staging = None
        if self._group is not None:
            futures = self.engines.start("destroy_weights_update_group", {"group_name": self.group_name}, self._members)
            dist.destroy_process_group(self._group)
            self._group = None
            self._members = []
            with contextlib.suppress(Exception):  # best effort: an engine that is gone has no group either
                self.engines.wait(futures, "/destroy_weights_update_group")


@dataclass
class DiskTransport:
    """safetensors shards (one per bucket) plus `model.safetensors.index.json` in `directory`,
    then `/update_weights_from_disk` with that path. The directory must be readable by the
    engines (a shared filesystem for engines on other hosts). Between syncs it holds the latest
    weights (an engine can be restarted from it); each sync rewrites the shards in place, which
    reuses their page cache, and removes shards a smaller sync no longer needs."""

    engines: EngineFanout
    directory: str
    pause_mode: str = "retract"

    def send(
        self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats, only: Sequence[str] | None = None
    ) -> None:
        os.makedirs(self.directory, exist_ok=True)
        weight_map: dict[str, str] = {}
        written: set[str] = set()
        for i, bucket in enumerate(buckets):
            fname = f"model-{i + 1:05d}.safetensors"
            write_safetensors(bucket, os.path.join(self.directory, fname))
            weight_map.update((n, fname) for n, _ in bucket)
            written.add(fname)
            stats.buckets += 1
        _remove(
            os.path.join(self.directory, f)
            for f in os.listdir(self.directory)
            if f.endswith(".safetensors") and f not in written
        )
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": stats.bytes}, "weight_map": weight_map}, f)
        with self.engines.weight_update(self.pause_mode, only) as targets:
            targets[:] = list(
                self.engines.call(
                    "update_weights_from_disk",
                    dict(model_path=self.directory, weight_version=str(version), flush_cache=True),
                    targets,
                )
            )
            stats.mismatched.update(self.engines.delivered(targets, version, stats.checksum))


@dataclass
class TensorTransport:
    """`/update_weights_from_tensor`, one request per bucket. `payload` says how tensors travel:

    - "shm" (default; engines on this host): each bucket is written, as safetensors, to a file in
      `shm_dir` (default /dev/shm) and the request points at it — the CPU analogue of the CUDA IPC
      handles a colocated SGLang receives. Two such files alternate (the next bucket is written
      while the engines read the current one) and are rewritten in place from sync to sync, which
      is several times faster than fresh shared memory; `close()` removes them. Shared memory is
      RAM that outlives a process killed before `close()`, so the files are also reclaimed when
      the trainer dies by SIGKILL (a `sh` started with them waits on a pipe from the trainer and
      removes them at its end of file), and every transport that creates its files first removes
      those of trainers that no longer run (their pid is in the name): a resumed run, or any
      later one on the host, reclaims what an earlier one left;
    - "inline": the bytes travel in the request (base64 safetensors), for engines elsewhere; JSON
      and base64 make this the slowest transport;
    - "sglang": SGLang's `MultiprocessingSerializer` format, for a colocated real SGLang server.
    """

    engines: EngineFanout
    payload: str = "shm"
    shm_dir: str | None = None
    pause_mode: str = "retract"
    _files: list[str] = field(default_factory=list, init=False)
    _reaper: subprocess.Popen | None = field(default=None, init=False)

    def send(
        self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats, only: Sequence[str] | None = None
    ) -> None:
        if self.payload not in ("shm", "inline", "sglang"):
            raise ValueError(f"payload: expected 'shm', 'inline' or 'sglang', got {self.payload!r}")
        with self.engines.weight_update(self.pause_mode, only) as targets:
            pending: dict[str, Future] = {}
            for i, (bucket, last) in enumerate(_with_last(buckets)):
                fields: dict = dict(serialized_named_tensors=[self._encode(bucket, i % 2)], flush_cache=last)
                if last:
                    fields["weight_version"] = str(version)
                if pending:  # the previous bucket, loaded while this one was written
                    targets[:] = list(self.engines.wait(pending, "/update_weights_from_tensor"))
                pending = self.engines.start("update_weights_from_tensor", fields, targets)
                stats.buckets += 1
            targets[:] = list(self.engines.wait(pending, "/update_weights_from_tensor"))
            stats.mismatched.update(self.engines.delivered(targets, version, stats.checksum))

    def _encode(self, bucket: NamedTensors, slot: int) -> str:
        if self.payload == "inline":
            return encode_named_tensors(bucket)
        if self.payload == "sglang":
            return encode_named_tensors_sglang(bucket)
        if not self._files:
            shm_dir = self.shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            reclaim_orphaned_buffers(shm_dir)
            stem = os.path.join(shm_dir, f"{SHM_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}")
            self._files = [f"{stem}_{k}.safetensors" for k in (0, 1)]
            self._reaper = _start_reaper(self._files)
        write_safetensors(bucket, self._files[slot])
        return encode_tensor_file(self._files[slot])

    def close(self) -> None:
        _remove(self._files)
        self._files = []
        if self._reaper is not None:
            if self._reaper.stdin is not None:  # always: it is started with a pipe
                self._reaper.stdin.close()  # its end of file: it removes files that are gone already, and exits
            self._reaper.wait()
            self._reaper = None


def reclaim_orphaned_buffers(directory: str) -> list[str]:
    """Remove the shared-memory buckets in `directory` of trainers that no longer run (and belong
    to this user); returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"{SHM_PREFIX}*_*.safetensors")):
        m = re.match(rf"{SHM_PREFIX}(\d+)_", os.path.basename(path))
        if m is None or _running(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            if os.stat(path).st_uid == os.getuid():
                os.remove(path)
                removed.append(path)
    if removed:
        logger.warning(
            "removed %d shared-memory weight bucket(s) a killed trainer left: %s", len(removed), ", ".join(removed)
        )
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _start_reaper(paths: Sequence[str]) -> subprocess.Popen | None:
    """A `sh` that removes `paths` once this process is gone, however it ends: it waits for end of
    file on a pipe whose only writer is this process (the pipe is not inherited across exec). Its
    own session, so a signal to the trainer's process group does not reach it. None without `sh`."""
    try:
        return subprocess.Popen(
            ["sh", "-c", 'cat >/dev/null; rm -f -- "$@"', "mcore-rl-shm-reaper", *paths],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as err:
        logger.warning(
            "could not start the shared-memory reaper (%s): a SIGKILLed trainer leaves %s behind until "
            "the next run on this host removes them",
            err,
            ", ".join(paths),
        )
        return None


def _remove(paths: Iterable[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


@dataclass
class InProcessTransport:
    """Colocated `EngineCore`s in this process: buckets go straight into `load_weights`, with the
    same checks as the endpoints. Generation must not run meanwhile: pause the engine around the
    sync (`EngineDriver.pause("in_place")` ... `resume()`), as the HTTP transports do."""

    cores: Sequence[EngineCore]

    def send(
        self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats, only: Sequence[str] | None = None
    ) -> None:
        """`only`: names as in `stats.mismatched`, "embedded:<index>"."""

        cores = {f"embedded:{i}": c for i, c in enumerate(self.cores) if only is None or f"embedded:{i}" in only}
        for bucket in buckets:
            # the engines hold the very tensors the trainer digested: its digests are theirs
            digests = stats.checksum.contents([n for n, _ in bucket]) if stats.checksum is not None else None
            for core in cores.values():
                load_named_tensors(core, bucket, digests=digests)
            stats.buckets += 1
        for name, core in cores.items():
            core.weight_version = version
            core.flush_cache()
            if stats.checksum is not None:
                problem = checksum_problem(weights_checksum(core), version, stats.checksum)
                if problem is not None:
                    stats.mismatched[name] = problem


def _with_last(items: Iterable[NamedTensors]) -> Iterator[tuple[NamedTensors, bool]]:
    it = iter(items)
    prev = next(it, None)
    while prev is not None:
        nxt = next(it, None)
        yield prev, nxt is None
        prev = nxt


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
