"""Save and resume training with megatron-core distributed checkpointing.

A checkpoint directory `<save_dir>/iter_0000100/` holds the model and optimizer as sharded tensors
keyed by global parameter name (so it loads into any TP/PP/EP layout), plus common state (iteration,
scheduler, data position, config) and one RNG file per rank. `<save_dir>/latest` names the newest
complete checkpoint; it is written last, so a crash mid-save never points at a partial one.

A *model-only* checkpoint (`save_checkpoint(..., optimizer=None)`, e.g. written by `mcore-rl convert
hf-to-mcore`) has `common["model_only"] = True`, no optimizer state and no RNG files: it is a starting
point, not a resumable run, so `load_checkpoint` loads the weights and leaves optimizer and RNG as
they are.

Saving is synchronous, but megatron-core's writer forks worker processes for the shard files and
reports through a queue served by a `multiprocessing.spawn`ed manager process that it starts on the
first save and never stops. Both are made to die with the trainer (`_writers_die_with_trainer`), so
a killed trainer leaves no process behind. Both are in the trainer's process group, to which torchrun
passes a pre-emption signal as a whole, possibly during the save it causes (one node's torchrun
passing it on later than another's): the forked writers inherit the trainer's handler, and the
manager ignores those signals from its start (`parallel/preemption.py: group_signals`), or it would
die of SIGUSR1 and the save end in an EOFError from the queue.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from mcore_rl.parallel import preemption
from mcore_rl.parallel.lifetime import die_with_parent, helper_init, signals_blocked
from mcore_rl.progress import progress

if TYPE_CHECKING:  # annotations only: megatron-core is imported after the CPU compatibility layer patched it
    from megatron.core.transformer.module import MegatronModule

logger = logging.getLogger(__name__)

LATEST = "latest"

_saving_pid: int | None = None  # set during a save: processes forked then die with this one
_writer_manager: Any = None  # the manager serving megatron-core's write-results queue


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message says why and where."""


def checkpoint_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def latest_checkpoint(load_dir: str) -> str | None:
    """The newest complete checkpoint under `load_dir`, or `load_dir` itself if it is one."""
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"checkpoint.load_dir {load_dir!r} does not exist")
    if os.path.exists(os.path.join(load_dir, "metadata.json")):
        return load_dir
    marker = os.path.join(load_dir, LATEST)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        path = os.path.join(load_dir, f.read().strip())
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{marker} points at {path!r}, which does not exist")
    return path


def _model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    from mcore_rl.models.shards import unwrap_model  # lazy: transformers

    return {f"chunk{i}": cast("MegatronModule", unwrap_model(c)).sharded_state_dict() for i, c in enumerate(chunks)}


def _rng_state() -> dict[str, Any]:
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _forked_during_save() -> None:
    if _saving_pid is not None:
        die_with_parent(signal.SIGKILL, _saving_pid)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_during_save)


def _writers_die_with_trainer() -> None:
    """Start the manager that megatron-core's `FileSystemWriterAsync` would spawn for its results
    queue (`filesystem_async._get_write_results_queue`), set to die with this process, and hand
    megatron its queue. megatron's own manager outlives a SIGKILLed trainer under PID 1 (~280 MB).
    The kernel ties the death signal to the thread that starts the manager: saves run on the main one.
    The manager ignores the signals a launcher sends the trainer's process group (`preemption.group_signals`),
    blocked while it starts so that one sent before it could ignore them waits (`lifetime.helper_init`)."""
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _writer_manager is not None or getattr(filesystem_async, "_results_queue", None) is not None:
        return
    if not hasattr(filesystem_async, "_get_write_results_queue"):  # a megatron-core that does it differently
        logger.warning("megatron-core's checkpoint writer changed; its helper processes may outlive a killed trainer")
        return
    from multiprocessing.managers import SyncManager

    from torch import multiprocessing as mp

    manager = SyncManager(ctx=mp.get_context("spawn"))
    ignored = tuple(int(sig) for sig in preemption.group_signals())
    with signals_blocked(ignored):
        manager.start(initializer=helper_init, initargs=(os.getpid(), ignored))
    filesystem_async._results_queue = manager.Queue()
    _writer_manager = manager


def _layout_signature() -> tuple[int, ...]:
    from megatron.core import parallel_state as ps

    return (
        dist.get_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )


def save_checkpoint(
    save_dir: str,
    iteration: int,
    chunks: list[torch.nn.Module],
    optimizer: Any | None,
    common: dict[str, Any],
) -> str:
    """Write a complete checkpoint for `iteration` (collective: every rank calls it).

    `optimizer=None` writes a model-only checkpoint (no optimizer state, no RNG files).
    """
    path = checkpoint_dir(save_dir, iteration)
    try:
        _save(save_dir, path, iteration, chunks, optimizer, common)
    except (OSError, RuntimeError, CheckpointException) as err:
        full = _disk_full(save_dir, path, err)
        if full is None:
            raise
        raise full from err
    return path


def _save(
    save_dir: str,
    path: str,
    iteration: int,
    chunks: list[torch.nn.Module],
    optimizer: Any | None,
    common: dict[str, Any],
) -> None:
    global _saving_pid
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    model_sd = _model_sharded_state_dict(chunks)
    state = {
        "model": model_sd,
        "common": dict(common, iteration=iteration, layout=_layout_signature()),
    }
    if optimizer is None:
        state["common"]["model_only"] = True
    else:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd)
    _writers_die_with_trainer()
    _saving_pid = os.getpid()
    try:
        with progress(_state_bytes(state), f"saving {os.path.basename(path)}", "B") as bar:
            dist_checkpointing.save(state, path)
            bar.update(bar.total)
    finally:
        _saving_pid = None
    if optimizer is not None:
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
        torch.save(_rng_state(), os.path.join(path, "rng", f"rank_{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(save_dir, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(save_dir, LATEST))
    dist.barrier()


def _state_bytes(state: Any) -> int:
    """Bytes of this rank's shards in a (sharded) state dict: what a save writes or a load reads."""
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    data = getattr(state, "data", state)  # a ShardedTensor's local shard
    return data.numel() * data.element_size() if isinstance(data, torch.Tensor) else 0


def _disk_full(save_dir: str, path: str, err: BaseException) -> CheckpointError | None:
    """The error to raise instead of `err` if the save failed because the disk is full, else None.

    A full disk rarely says so: megatron-core's writer reports `RuntimeError: Worker failure:
    [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`. So besides ENOSPC in the
    chain of causes, a disk with (nearly) nothing left after the failure counts as full.
    """
    chain: list[BaseException] = []
    seen: BaseException | None = err
    while seen is not None and len(chain) < 16:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    enospc = any(getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e) for e in chain)
    try:
        usage = shutil.disk_usage(save_dir)
    except OSError:
        return None
    if not enospc and usage.free >= min(64 << 20, max(usage.total // 100, 1 << 20)):
        return None
    return CheckpointError(
        f"could not write checkpoint {path}: the disk holding checkpoint.save_dir {save_dir!r} is full "
        f"({_bytes(usage.free)} free of {_bytes(usage.total)} on the filesystem mounted at {_mount_point(save_dir)}). "
        f"Free space there or point checkpoint.save_dir at a larger disk; {path} is incomplete and can be deleted "
        f"({LATEST} was not moved to it, so a resume never reads it)."
    )


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def load_checkpoint(
    path: str, chunks: list[torch.nn.Module], optimizer: Any | None, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Load model (and optimizer) shards for this rank's layout; returns the common state.

    RNG streams are restored only when the layout matches the one that saved them (a different
    layout has different streams by construction); otherwise they stay as seeded. A model-only
    checkpoint (module doc) loads the weights only, whatever `optimizer` is. The chunks' modules
    named in `skip` (`output_layer`: a reward model's value head where a policy has its output layer)
    are not read and keep their values; only with `optimizer=None`.
    """
    if skip and optimizer is not None:
        raise ValueError("load_checkpoint: skipping modules leaves their optimizer state undefined; load weights only")
    from megatron.core import dist_checkpointing

    if not os.path.exists(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path!r} is not a distributed checkpoint (no metadata.json)")
    stored = dist_checkpointing.load_common_state_dict(path)
    common = stored["common"]
    if common.get("model_only"):
        optimizer = None
        logger.info("%s is a model-only checkpoint: optimizer state and RNG streams start fresh", path)
    if optimizer is not None:
        current = getattr(getattr(optimizer, "cfg", None), "name", "adamw")
        _check_optimizer_name(path, stored.get("optimizer", {}).get("name", "adamw"), current)
    model_sd = _model_sharded_state_dict(chunks)
    if skip:
        model_sd = {
            c: {k: v for k, v in sd.items() if not any(k == s or k.startswith(s + ".") for s in skip)}
            for c, sd in model_sd.items()
        }
    request: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        request["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True)
    with progress(_state_bytes(request), f"loading {os.path.basename(path)}", "B") as bar:
        loaded = dist_checkpointing.load(request, path)
        bar.update(bar.total)
    from mcore_rl.models.shards import unwrap_model  # lazy: transformers

    for i, chunk in enumerate(chunks):
        unwrap_model(chunk).load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
    if optimizer is not None:
        optimizer.load_sharded_state_dict(loaded["optimizer"])
    rng_file = os.path.join(path, "rng", f"rank_{dist.get_rank():05d}.pt")
    if tuple(common.get("layout", ())) == _layout_signature() and os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.info("checkpoint layout %s differs from this run's; RNG streams reseeded", common.get("layout"))
    return common


def _check_optimizer_name(path: str, saved: str, current: str) -> None:
    """AdamW's moments cannot come from an SGD checkpoint (it saved none); the reverse is allowed and
    drops them (SGD keeps no state). Checkpoints from before optimizer.name was saved are AdamW's."""
    if saved == "sgd" and current != "sgd":
        raise ValueError(
            f"{path} was written by optimizer.name=sgd, which keeps no optimizer state, so "
            f"optimizer.name={current!r} cannot resume from it; resume with optimizer.name=sgd, or start "
            "from its weights only (convert it, or point model loading at it)"
        )
    if saved != current:
        logger.warning(
            "%s was written by optimizer.name=%s; resuming with %s drops its optimizer state", path, saved, current
        )
