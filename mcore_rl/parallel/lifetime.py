"""Helper processes that die with the process that started them.

A trainer killed with SIGKILL runs no cleanup, so anything it started (megatron-core's checkpoint
writer, a relaunched torchrun) would live on under PID 1, holding memory and files. On Linux the
kernel sends a chosen signal to a process when its parent dies (`prctl(PR_SET_PDEATHSIG)`), however
the parent died; elsewhere a daemon thread watches the parent's pid.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    # Resolved once at import, so a freshly forked child only calls it (no dlopen after fork).
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # libc, already loaded
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; False if unsupported.

    Safe in a `subprocess` `preexec_fn` (no threads, no allocation beyond the call).
    """
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Receive `sig` when the parent exits. `parent_pid` is the pid of the process that started this
    one: if it is no longer the parent, it died before this call could take effect, so go now."""
    parent = os.getppid() if parent_pid is None else parent_pid
    if not set_parent_death_signal(sig):
        threading.Thread(target=_watch_parent, args=(parent, sig), name="die-with-parent", daemon=True).start()
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _watch_parent(parent: int, sig: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), sig)


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], Any]:
    """A `preexec_fn` for `subprocess`: the child gets `sig` when this process dies. SIGTERM lets a
    launcher such as torchrun stop its own workers on the way out."""
    parent = os.getpid()

    def preexec() -> None:
        if set_parent_death_signal(sig) and os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec
