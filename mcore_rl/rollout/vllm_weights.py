"""vLLM's NCCL weight transfer: `rollout.sync_transport: distributed` with `engine_kind: vllm` (GPU only).

The trainer is rank 0 of one NCCL group with every vLLM engine's worker (engine i is rank 1 + i:
one worker per engine, tensor parallelism 1) and broadcasts each tensor to all of them at once,
through vLLM 0.32's routes (`VLLM_SERVER_DEV_MODE=1`):

    /init_weight_transfer_engine  {init_info: {nccl_unique_id_b64, rank_offset, world_size, packed}}
    /start_weight_update          (vLLM's layerwise reload begins)
    /update_weights               {update_info: {names, dtype_names, shapes}}: the worker receives
                                  each tensor from rank 0, in that order, while the trainer sends
    /finish_weight_update         {weight_version}: the reload is finished, the version taken
    /reset_prefix_cache           (no prefix-cache hit on KV the old weights computed)
    /shutdown_weight_transfer_engine

The group meets by an `ncclUniqueId` the trainer mints and sends in the init request (vLLM's path
for trainers that cannot join its TCPStore rendezvous, whose messages are pickles of vLLM's own
classes): the trainer needs libnccl, which a CUDA build of torch loads, not vLLM. Every rank enters
`ncclCommInitRank` at once, then a one-element float32 all-reduce (the warm-up vLLM's communicator
runs) before any broadcast. Tensors go one by one, each with its own dtype and element count
(`packed: false`), as the worker receives them into `torch.empty(shape, dtype)`.

An engine that dies breaks the group's collectives: that sync fails and the next forms a new group
with the engines that answer (`connect`), as `DistributedTransport` does for SGLang. NCCL has no
timeout here: an engine that refuses `/update_weights` after the trainer began broadcasting leaves
the broadcast waiting for it (a refusal that arrived before is raised first, as vLLM's own trainer
engine does).

Written against vLLM 0.32's source; not run where it was written (no GPU with vLLM): validation
(`config/rl_vllm.py`) refuses it without CUDA, and `tests/test_vllm_weights.py` carries the `gpu`
marker.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_rl.rollout.weight_protocol import BucketMeta, NamedTensors
from mcore_rl.rollout.weight_transports import EngineFanout, SyncStats

NCCL_UNIQUE_ID_BYTES = 128
NCCL_SUM = 0
NCCL_DTYPES = {  # ncclDataType_t
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
NCCL_LIBRARIES = ("libnccl.so.2", "libnccl.so")  # a CUDA torch has loaded one of them already


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclCommunicator:
    """One rank of an NCCL group met by a unique id, over libnccl's C API (ctypes): what a vLLM
    worker's `PyNcclCommunicator.from_unique_id_bytes` does, so that the two meet."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device) -> None:
        """Join the group (blocks until every rank joined), then the one-element warm-up."""
        if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id: {NCCL_UNIQUE_ID_BYTES} bytes expected, got {len(unique_id)}")
        self.lib = load_nccl()
        self.device = device
        self.rank, self.world_size = rank, world_size
        uid = _UniqueId()
        ctypes.memmove(uid.internal, unique_id, NCCL_UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(self.lib, self.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank))
            warm = torch.zeros(1, dtype=torch.float32, device=device)
            self.all_reduce(warm)
            torch.cuda.current_stream(device).synchronize()

    @staticmethod
    def unique_id() -> bytes:
        """A fresh `ncclUniqueId` (rank 0 mints it; the others get it out of band)."""
        lib = load_nccl()
        uid = _UniqueId()
        _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid.internal)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the group, in place, on the current stream."""
        ptr = ctypes.c_void_p(tensor.data_ptr())
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        _check(
            self.lib,
            self.lib.ncclAllReduce(ptr, ptr, tensor.numel(), _dtype(tensor), NCCL_SUM, self.comm, stream),
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """`tensor` (contiguous, on this rank's device) from rank `src` to every rank."""
        if not tensor.is_contiguous() or tensor.device != self.device:
            raise ValueError("broadcast: a contiguous tensor on the communicator's device expected")
        ptr = ctypes.c_void_p(tensor.data_ptr())
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        _check(self.lib, self.lib.ncclBroadcast(ptr, ptr, tensor.numel(), _dtype(tensor), src, self.comm, stream))

    def synchronize(self) -> None:
        """Until every broadcast enqueued so far has completed on this side."""
        torch.cuda.current_stream(self.device).synchronize()

    def destroy(self) -> None:
        if self.comm:
            self.lib.ncclCommAbort(self.comm)  # abort: a peer that died would make a destroy wait for it
            self.comm = ctypes.c_void_p()


def load_nccl() -> ctypes.CDLL:
    """libnccl (the one a CUDA torch loaded, found by its soname); `OSError` naming what was tried."""
    errors = []
    for name in NCCL_LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
        except OSError as err:
            errors.append(f"{name}: {err}")
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        return lib
    raise OSError("vLLM's NCCL weight transfer needs libnccl (a CUDA build of torch): " + "; ".join(errors))


def _check(lib: ctypes.CDLL, result: int) -> None:
    if result != 0:
        raise RuntimeError(f"NCCL error {result}: {lib.ncclGetErrorString(result).decode(errors='replace')}")


def _dtype(tensor: torch.Tensor) -> int:
    try:
        return NCCL_DTYPES[tensor.dtype]
    except KeyError:
        raise ValueError(f"NCCL has no type for {tensor.dtype}") from None


def init_info(unique_id: bytes, rank_offset: int, world_size: int) -> dict[str, Any]:
    """The `init_info` of `/init_weight_transfer_engine` for the engine at `rank_offset`."""
    return {
        "nccl_unique_id_b64": base64.b64encode(unique_id).decode(),  # standard base64, as vLLM requires
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": False,
    }


def update_info(bucket: NamedTensors) -> dict[str, Any]:
    """The `update_info` of `/update_weights`: what the workers receive, in broadcast order."""
    meta = BucketMeta.of(bucket)
    return {"names": meta.names, "dtype_names": meta.dtypes, "shapes": meta.shapes}


@dataclass
class VLLMNcclTransport:
    """The `Transport` of `sync_transport: distributed` to vLLM engines (see the module docstring)."""

    engines: EngineFanout
    pause_mode: str = "abort"
    # how the trainer's rank is made: (unique id, rank, world size, device) -> a communicator with
    # `device`, `broadcast`, `synchronize`, `destroy`; and how the unique id is minted
    communicator: Callable[[bytes, int, int, torch.device], Any] = NcclCommunicator
    mint: Callable[[], bytes] = NcclCommunicator.unique_id
    device: torch.device | None = None  # None: the current CUDA device
    _comm: Any = field(default=None, init=False)
    _members: list[str] = field(default_factory=list, init=False)

    def connect(self, urls: Sequence[str]) -> None:
        """Form the group with `urls`; one with other members is shut down first (an engine died
        or came back since it was formed)."""
        urls = list(urls)
        if self._comm is not None and urls == self._members:
            return
        self.close()
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        uid = self.mint()
        world_size = 1 + len(urls)
        futures = self.engines.start(
            "init_weight_transfer_engine", lambda i: {"init_info": init_info(uid, 1 + i, world_size)}, urls
        )
        try:  # every rank must enter the group's init at once: the engines wait in their requests
            self._comm = self.communicator(uid, 0, world_size, device)
        finally:
            answered = self.engines.wait(futures, "/init_weight_transfer_engine")
        if len(answered) < len(urls):
            self._drop()
            raise RuntimeError(f"weight sync: engines {sorted(set(urls) - set(answered))} did not join the group")
        self._members = urls

    def send(
        self, buckets: Iterable[NamedTensors], version: int, stats: SyncStats, only: Sequence[str] | None = None
    ) -> None:
        with self.engines.weight_update(self.pause_mode, only) as targets:
            self.connect(targets)
            comm = self._comm
            assert comm is not None  # connect() formed it
            self.engines.call("start_weight_update", {}, targets)
            for bucket in buckets:
                futures = self.engines.start("update_weights", {"update_info": update_info(bucket)}, targets)
                try:
                    for f in futures.values():  # refused before any NCCL call: raise now, as no broadcast
                        if f.done():  # would find that peer (vLLM's own trainer engine checks the same)
                            f.result()
                    for _, tensor in bucket:
                        comm.broadcast(tensor.detach().to(comm.device).contiguous())
                    comm.synchronize()
                    answered = self.engines.wait(futures, "/update_weights")
                except BaseException:
                    self._drop()
                    raise
                if len(answered) < len(targets):  # the group lost a member: the next sync re-forms it
                    self._drop()
                    raise RuntimeError(
                        f"weight sync: engines {sorted(set(targets) - set(answered))} dropped out of "
                        "the NCCL group during a sync"
                    )
                stats.buckets += 1
            targets[:] = list(self.engines.call("finish_weight_update", {"weight_version": str(version)}, targets))
            targets[:] = list(self.engines.call("flush_cache", {}, targets))  # no prefix hit on the old weights' KV
            stats.mismatched.update(self.engines.delivered(targets, version, stats.checksum))

    def _drop(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
        self._members = []

    def close(self) -> None:
        """Shut the group down on both sides."""
        if self._comm is None:
            return
        futures = self.engines.start("shutdown_weight_transfer_engine", {}, self._members)
        self._drop()
        with contextlib.suppress(Exception):  # best effort: an engine that is gone has no group either
            self.engines.wait(futures, "/shutdown_weight_transfer_engine")
