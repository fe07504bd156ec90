"""Pre-emption: a signal makes the trainer checkpoint at the next step boundary and exit with 75.

Clusters announce the end of a job with a signal: SLURM sends SIGTERM on `scancel` and at the time
limit, and `#SBATCH --signal=B:USR1@120` sends SIGUSR1 shortly before it. The signals named in
`checkpoint.preempt_signals` (default SIGTERM, SIGUSR1) are caught by `PreemptionGuard`, whose
handler only records the signal; the training loops (`runtime/loop.py: run_rl`, `train/sft.py:
run_sft`) ask `stop_requested()` once per step, after the optimizer step. That call is a collective:
the signal may reach only some ranks (or reach them one step apart), so every rank contributes
what it received and all of them stop after the same step. They then write the ordinary checkpoint
(`train/checkpoint.py`, `latest` written last), close engines and workers, and `mcore-rl` exits
with `EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try again"), which a SLURM script can requeue on.

A second signal while the checkpoint is written is logged and ignored: the handler stays
installed until the process exits, so nothing interrupts the save. torchrun passes a signal on to
each rank's whole process group (`os.killpg`), and one node's torchrun may do so after another
node's rank has made every rank stop and save: a rank's helpers can get it in the middle of the
save. The forked checkpoint writers inherit the handler; the manager process serving megatron-core's
write-results queue ignores `group_signals()` (`train/checkpoint.py`), or it would die of SIGUSR1
and the save end in an EOFError (exit 1, no requeue). Each node's first rank writes
`<run_dir>/preempted.json` (step, checkpoint, signal) as well: torchrun reports a worker's exit
code only as "failed", so the launch scripts and `mcore-rl --nproc-per-node` read this file to exit
with 75 themselves (`exit_code_after_launch`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any
from collections.abc import Iterator, Sequence

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: the run stopped on request, resumable from its checkpoint
MARKER = "preempted.json"
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun passes these on to its workers' groups

_active: PreemptionGuard | None = None  # the guard `stop_requested` asks (None: no signals caught)
_preempted = False  # `preempted()` was called: the run saved and stops


class Preempted(Exception):
    """Raised by a training loop after it saved its checkpoint on a pre-emption signal."""

    def __init__(self, step: int, signal_name: str, checkpoint: str | None) -> None:
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.save_dir is not set)"
        super().__init__(f"pre-empted by {signal_name} after step {step}: {where}")
        self.step, self.signal_name, self.checkpoint = step, signal_name, checkpoint


class PreemptionGuard:
    """Catches `signals` for the lifetime of a run; `agree()` turns what each rank saw into one decision."""

    def __init__(self, signals: Sequence[str]) -> None:
        self.signals = [signal.Signals[name] for name in signals]
        self.received: int | None = None  # the first signal this rank got
        self.received_at: float | None = None  # time.monotonic() of it
        self.agreed_at: float | None = None  # when the ranks agreed to stop (the step boundary)
        self.repeats = 0  # signals after the first (ignored)
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
            signal.siginterrupt(sig, False)  # SA_RESTART: a blocked read in gloo/NCCL is not cut short

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
            logger.warning("got %s: stopping after the current step with a checkpoint", signal.Signals(signum).name)
        else:  # e.g. SLURM's SIGTERM after its SIGUSR1, during the save: the save goes on
            self.repeats += 1
            logger.warning(
                "got %s again while stopping: ignored, the checkpoint is being written", signal.Signals(signum).name
            )

    def agree(self) -> str | None:
        """Collective (every rank, at the same step boundary): the name of a signal some rank got, or None."""
        import torch
        import torch.distributed as dist

        got = self.received or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            flag = torch.tensor([got], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            got = int(flag.item())
        if got and self.agreed_at is None:
            self.agreed_at = time.monotonic()
        return signal.Signals(got).name if got else None

    def phases(self) -> dict[str, float]:
        """Seconds from this rank's signal to the step boundary, and from there to now (the save)."""
        now = time.monotonic()
        agreed = self.agreed_at if self.agreed_at is not None else now
        out = {"to_step_boundary_s": round(agreed - self.received_at, 3)} if self.received_at is not None else {}
        out["checkpoint_s"] = round(now - agreed, 3)
        return out


@contextlib.contextmanager
def preemption_guard(signals: Sequence[str], exit_process: bool = False) -> Iterator[PreemptionGuard | None]:
    """Catch `signals` while the body runs (the main thread of a trainer process); [] catches none.
    With `exit_process` (the `mcore-rl` command), a body that was pre-empted (`preempted()`)
    ends the process on its way out with `EXIT_PREEMPTED` at once (`exit_now`)."""
    global _active, _preempted
    _preempted = False
    if not signals:
        yield None
        return
    guard = PreemptionGuard(signals)
    guard.install()
    _active = guard
    try:
        yield guard
    finally:
        _active = None
        guard.restore()
        if exit_process and _preempted:
            exit_now(EXIT_PREEMPTED)


def exit_now(code: int) -> None:
    """Run the atexit handlers, flush, and end the process with `code`, skipping the interpreter's
    teardown of every module: with torch and megatron-core loaded that garbage-collects the whole
    heap and took 10 s of a pre-emption here (docs/launch.md), time a scheduler's grace period
    does not have. Everything the run opened is closed by then."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def stop_requested() -> str | None:
    """Called by a training loop once per step on every rank (collective when a guard is installed):
    the signal to stop for, or None to go on."""
    return _active.agree() if _active is not None else None


def preempted(run_dir: str, step: int, signal_name: str, checkpoint: str | None) -> Preempted:
    """The exception a loop raises after its (collective) save; local rank 0 of every node leaves
    `<run_dir>/preempted.json`, so each node's launcher sees it without a shared filesystem. It
    holds the phases since the signal (`PreemptionGuard.phases`: to the step boundary, the save)."""
    global _preempted
    _preempted = True
    phases = _active.phases() if _active is not None else {}
    logger.warning("pre-empted after step %d: %s", step, ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        write_marker(run_dir, {"step": step, "signal": signal_name, "checkpoint": checkpoint, "phases": phases})
    return Preempted(step, signal_name, checkpoint)


def write_marker(run_dir: str, marker: dict[str, Any]) -> None:
    """Leave `<run_dir>/preempted.json` whole or not at all: on a shared run directory every node's
    first rank writes it while the other nodes' launchers may be reading it, and a reader that met
    a half-written file would take the pre-empted run for a failed one (exit 1, no requeue). Each
    writer fills its own temporary file and renames it into place, which readers see atomically."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, MARKER)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({**marker, "time": time.time()}, f)
    os.replace(tmp, path)


def read_marker(run_dir: str, since: float = 0.0) -> dict[str, Any] | None:
    """The marker a run pre-empted after `since` (a time.time()) left, else None."""
    try:
        with open(os.path.join(run_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if float(marker.get("time", 0)) >= since else None


def exit_code_after_launch(returncode: int, run_dir: str, since: float) -> int:
    """A launcher's exit code: 75 when its run was pre-empted after `since` (torchrun itself says 1)."""
    return EXIT_PREEMPTED if returncode != 0 and read_marker(run_dir, since) is not None else returncode


def group_signals() -> list[signal.Signals]:
    """The signals a launcher may send to a rank's whole process group that the rank may survive:
    those torchrun always handles and passes on (`TORCHRUN_SIGNALS`) and the ones the installed
    guard catches. A helper process in the group ignores them (`lifetime.helper_init`)."""
    names = [*TORCHRUN_SIGNALS, *(s.name for s in (_active.signals if _active is not None else ()))]
    return [signal.Signals[name] for name in dict.fromkeys(names)]


def torchrun_signal_flags(signals: Sequence[str]) -> list[str]:
    """torchrun flags that make it pass `signals` on to its workers (it handles SIGTERM, SIGINT,
    SIGHUP and SIGQUIT by default, and dies of SIGUSR1) and give them time to save before it kills them."""
    names = [*TORCHRUN_SIGNALS, *[s for s in signals if s not in TORCHRUN_SIGNALS]]
    return [
        "--signals-to-handle",
        ",".join(names),
        "--shutdown-timeout",
        os.environ.get("MCORE_RL_SHUTDOWN_TIMEOUT", "600"),
    ]


def call_forwarding_signals(command: list[str], signals: Sequence[str], **popen: Any) -> int:
    """Run `command` (a torchrun launcher) to its end, passing the first of `signals` this process gets
    on to it; later ones are only logged (torchrun would give up on its ranks while they save)."""
    proc = subprocess.Popen(command, **popen)
    sigs = [signal.Signals[name] for name in signals]
    forwarded: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if forwarded:
            logger.warning("got %s again while the trainer stops: ignored", signal.Signals(signum).name)
            return
        forwarded.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in sigs}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
