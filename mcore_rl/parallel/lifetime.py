"""Helper processes that die with the process that started them.

A trainer killed with SIGKILL runs no cleanup, so anything it started (megatron-core's checkpoint
writer, a relaunched torchrun) would live on under PID 1, holding memory and files. On Linux the
kernel sends a chosen signal to a process when its parent dies (`prctl(PR_SET_PDEATHSIG)`), however
the parent died; elsewhere a daemon thread watches the parent's pid. A helper left in the trainer's
process group ignores the signals a launcher sends that group and the trainer survives (`helper_init`).
The POSIX shared memory such a process tree made goes with it too (`SharedMemoryLedger`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

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


# ---- helpers in the trainer's process group ------------------------------------------------------
# torchrun passes a signal on to a rank with os.killpg: every process in the rank's group gets it,
# so a helper the rank started there (not in a session of its own) gets the pre-emption signal its
# trainer survives, and dies of it unless it ignores it. A helper started with `spawn` has the
# default dispositions until its first Python line runs; the signal mask, though, is inherited
# through fork and exec: blocked around the start, the signals wait in the helper until
# `helper_init` has set them to be ignored (which discards them).


@contextlib.contextmanager
def signals_blocked(signals: Iterable[int]) -> Iterator[None]:
    """Block `signals` in this thread while the body runs; what arrives meanwhile is delivered at the
    end. A process started in the body starts with them blocked (see `helper_init`)."""
    sigs = set(signals)
    if not sigs or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def helper_init(parent_pid: int, ignored: Sequence[int] = ()) -> None:
    """Initializer of a helper process the trainer starts in its process group (e.g. a
    multiprocessing manager): ignore `ignored` (and unblock them, `signals_blocked`), and die with
    the trainer (`die_with_parent`, SIGKILL), so it lives as long as the trainer, whatever reaches the group."""
    for sig in ignored:
        signal.signal(sig, signal.SIG_IGN)
    if ignored and hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(ignored))
    die_with_parent(signal.SIGKILL, parent_pid)


# ---- shared memory a process tree made ---------------------------------------------------------

SHM_DIR = "/dev/shm"
_REAPER = r"""
import os, shutil, sys
names = set()
for line in sys.stdin:
    op, name = line[:1], line[1:].rstrip("\n")
    if op == "+":
        names.add(name)
    elif op == "!":
        names.clear()
for name in names:
    path = os.path.join(sys.argv[1], name)
    try:
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    except OSError:
        pass
"""


class SharedMemoryLedger:
    """The /dev/shm entries one process tree (a session a started process leads) made, removed
    when it is gone, and nothing else's.

    POSIX shared memory (Python's `psm_*` segments, semaphores, torch's files) is RAM that outlives
    a process killed with SIGKILL: nothing in it runs its cleanup, and a resource tracker in the same
    process group dies with it. The kernel does not say who created an entry, so it is attributed by
    who holds it: an entry is the tree's if it is new since the tree started, was first seen while a
    process of the tree held it (an fd or a mapping of its inode, `/proc/<pid>/fd`, `/proc/<pid>/maps`) and never
    seen before that unheld by the tree (a creator holds what it makes from the start; a file someone
    else wrote and the tree only reads is seen first without it). `scan()` looks (call it while the
    tree lives: once it is ready, now and then, and before it is stopped); `release()`, once the tree
    is dead, removes what it made unless a process outside the tree holds it now. A trainer killed
    with SIGKILL runs no `release()`: a reaper process, fed each attributed name over a pipe, removes
    them at the pipe's end of file unless `release()` ran first.
    """

    def __init__(self, shm_dir: str = SHM_DIR, keep_prefixes: tuple[str, ...] = ()) -> None:
        """Snapshot `shm_dir` (call it before starting the tree); `keep_prefixes`: names never
        attributed (files of the starting process that the tree reads, e.g. weight buckets)."""
        self.shm_dir = shm_dir
        self.keep_prefixes = keep_prefixes
        self._before = set(_listdir(shm_dir))
        self._foreign: set[str] = set()  # new entries first seen unheld by the tree
        self.made: set[str] = set()
        self.leader: int | None = None
        self._reaper: subprocess.Popen | None = None

    def started(self, leader: int) -> None:
        """The tree is the session `leader` leads (`start_new_session=True`)."""
        self.leader = leader

    def scan(self) -> set[str]:
        """Attribute the entries the tree holds now; returns the tree's entries so far."""
        if self.leader is None or not os.path.isdir(self.shm_dir):
            return self.made
        # listed before the holders are read: an entry made in between is seen held
        new = {
            n: _inode(self.shm_dir, n) for n in set(_listdir(self.shm_dir)) - self._before - self.made - self._foreign
        }
        held: set[int] = set()
        for pid in session_members(self.leader):
            held |= shm_held_by(pid, self.shm_dir)
        for name, inode in new.items():
            if inode is None:
                continue  # gone already
            if name.startswith(self.keep_prefixes) or inode not in held:
                self._foreign.add(name)
            else:
                self.made.add(name)
                self._tell_reaper(f"+{name}")
        return self.made

    def release(self) -> list[str]:
        """Remove what the tree made (call once it is dead), except entries a live process outside
        it holds now; returns the paths removed."""
        removed: list[str] = []
        if self.made:
            tree = set(session_members(self.leader)) if self.leader is not None else set()
            others = {i for pid in _pids() if pid not in tree for i in shm_held_by(pid, self.shm_dir)}
            for name in sorted(self.made):
                path = os.path.join(self.shm_dir, name)
                if _inode(self.shm_dir, name) in others:
                    continue
                try:
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
        self.made.clear()
        self._tell_reaper("!")
        if self._reaper is not None:
            assert self._reaper.stdin is not None  # started with a pipe
            self._reaper.stdin.close()
            self._reaper.wait()
            self._reaper = None
        return removed

    def _tell_reaper(self, line: str) -> None:
        if self._reaper is None:
            if line == "!":
                return
            try:  # its own session: a signal to the trainer's group does not reach it
                self._reaper = subprocess.Popen(
                    [sys.executable, "-c", _REAPER, self.shm_dir],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    text=True,
                )
            except OSError:
                return  # release() still removes them; only a SIGKILLed starter leaves them
        assert self._reaper.stdin is not None
        try:
            self._reaper.stdin.write(line + "\n")
            self._reaper.stdin.flush()
        except OSError:
            pass


def session_members(leader: int) -> list[int]:
    """Live (not zombie) processes of the session `leader` leads."""
    members = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == leader:
            members.append(pid)
    return members


def shm_held_by(pid: int, shm_dir: str = SHM_DIR) -> set[int]:
    """Inodes of the `shm_dir` files `pid` has open or mapped (`/proc/<pid>/fd`, `/proc/<pid>/maps`).

    Inodes, not names: glibc's `sem_open` makes a semaphore under a temporary name
    (`sem.XXXXXX`), maps it, and only then links it to its own name and unlinks the temporary
    one, so its creator's mapping reads `/dev/shm/sem.XXXXXX (deleted)` for the whole of its life
    (a vLLM worker's `sem.mp-*` was attributed to no one)."""
    try:
        dev = os.stat(shm_dir).st_dev
    except OSError:
        return set()
    inodes: set[int] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        fds = []
    prefix = shm_dir.rstrip("/") + "/"

    def top(path: str) -> None:  # a file in a directory of shm_dir: the directory is held
        if path.startswith(prefix) and "/" in path[len(prefix) :] and not path.endswith(" (deleted)"):
            inode = _inode(shm_dir, path[len(prefix) :].split("/", 1)[0])
            if inode is not None:
                inodes.add(inode)

    for fd in fds:
        try:
            st = os.stat(os.path.join(fd_dir, fd))  # the open file itself, renamed or unlinked
            if st.st_dev == dev:
                inodes.add(st.st_ino)
                top(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            continue
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if " " + prefix in line:  # "start-end perms offset major:minor inode   path"
                    fields = line.split(maxsplit=5)
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    if os.makedev(major, minor) == dev:
                        inodes.add(int(fields[4]))
                        top(fields[5].rstrip("\n"))
    except (OSError, ValueError, IndexError):
        pass
    return inodes


def _inode(shm_dir: str, name: str) -> int | None:
    try:
        return os.lstat(os.path.join(shm_dir, name)).st_ino
    except OSError:
        return None


def _pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
