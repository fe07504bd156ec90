"""Killable reward workers: sync reward functions run in child processes, one call at a time each.

A thread that runs a hanging verifier can never be freed; a process can. `WorkerPool` keeps up to
`size` workers, each a fresh interpreter (`python -c`, importing only `mcore_rl.rewards` and the
reward's own module: no torch, about 0.1 s) that loads the function by its "module:function"
path, so only samples and results are pickled. Every call has a hard deadline: past it the worker
is killed (SIGKILL to its process group, by pid) and replaced, its sample gets the timeout error,
and the other calls never notice. Whatever the function does — raise SystemExit or
KeyboardInterrupt, call `os._exit`, crash the interpreter — costs its own sample only.

Each worker gets a temporary directory of its own (its `tempfile.tempdir`: the sandbox's run
directories, with the program and its files, go there); the pool removes it when it kills or
reaps the worker, so a worker SIGKILLed in the middle of a run leaves nothing on disk, and a pool
removes the directories of workers whose pool died (SIGKILL of the trainer) when it starts.

Workers die with the trainer: each asks the kernel for SIGKILL when its parent dies
(`prctl(PR_SET_PDEATHSIG)`, Linux; it works when the parent is SIGKILLed and while the worker is
stuck in C code holding the GIL), and a watchdog thread polls the parent pid (other systems). The
kernel sends the death signal when the *thread* that forked the child exits, so every worker is
forked by one long-lived daemon thread (`_Spawner`), never by a short-lived executor thread.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, cast
from collections.abc import Sequence

from mcore_rl.parallel.lifetime import die_with_parent
from mcore_rl.rewards.base import describe, results_of
from mcore_rl.rewards.registry import resolve_import_path

logger = logging.getLogger(__name__)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from mcore_rl.rewards.workers import worker_main; worker_main()"


@dataclass
class Reply:
    """One call's outcome: (reward, info) per sample, or the `reward_error` message."""

    values: list[tuple[float, dict]] | None
    error: str | None
    elapsed_s: float


# ----------------------------------------------------------------------------------- parent side


class _Spawner:
    """Forks every worker from one long-lived daemon thread (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._pid = -1

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._jobs,), name="reward-spawner", daemon=True
                )
                self._thread.start()
            jobs = self._jobs
        assert jobs is not None  # made above, under the lock
        done: Future = Future()
        jobs.put((done, args, kwargs))
        return done.result()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            done, args, kwargs = jobs.get()
            try:
                done.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as exc:
                done.set_exception(exc)


_SPAWNER = _Spawner()
_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


_TMP_PREFIX = "mcore-reward-worker-"
_SWEPT = False


def _worker_tmp() -> str:
    """A new worker's temporary directory, named after this process (its owner); the first call
    removes those whose owner is dead."""
    global _SWEPT
    parent = tempfile.gettempdir()
    if not _SWEPT:
        _SWEPT = True
        try:
            names = [n for n in os.listdir(parent) if n.startswith(_TMP_PREFIX)]
        except OSError:
            names = []
        for name in names:
            owner = name[len(_TMP_PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=parent)


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    ready_by: float  # monotonic time by which it must have loaded the function
    tmp: str  # its temporary directory: removed with it
    ready: bool = False
    job: int | None = None
    sent: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid


def _exit_code(w: _Worker) -> int | None:
    try:
        return w.proc.wait(timeout=10)  # its pipe is closed: it has exited or is about to
    except subprocess.TimeoutExpired:
        return None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class WorkerPool:
    """`size` worker processes calling the function at `path`; `run` scores payloads with them.

    A payload is one `RewardInput` (or, with `per_group`, a list of them); the reply holds one
    (reward, info) per sample or the error. Not for concurrent use: `run` holds a lock."""

    def __init__(
        self,
        path: str,
        size: int,
        per_group: bool = False,
        timeout_s: float | None = 30.0,
        start_timeout_s: float = 60.0,
        options: dict[str, Any] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs size >= 1, got {size}")
        self.path, self.size, self.per_group = path, size, per_group
        self.options = dict(options or {})  # keyword arguments of every call: fn(sample, **options)
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self.start_error: str | None = None  # why the last worker that failed to start did
        _POOLS.add(self)

    # ---------------------------------------------------------------- processes

    def _spawn(self) -> None:
        """Start one worker (it reports "ready" once it has loaded the function)."""
        mine, theirs = socket.socketpair()
        tmp = None
        try:
            tmp = _worker_tmp()
            proc = _SPAWNER.popen(
                [sys.executable, "-c", _CHILD, _ROOT, str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "TMPDIR": tmp},
            )
        except OSError as exc:  # out of processes, memory or disk: the samples fail, the run goes on
            mine.close()
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self.start_error = f"the worker could not be started: {type(exc).__name__}: {exc}"
            logger.warning("reward worker: %s", self.start_error)
            return
        finally:
            theirs.close()
        conn = Connection(mine.detach())
        conn.send((list(sys.path), self.path, self.per_group, self.options))
        self._workers.append(_Worker(proc, conn, time.monotonic() + self.start_timeout_s, tmp))

    def _kill(self, w: _Worker) -> None:
        """SIGKILL the worker's process group (the worker and anything it started), reap it."""
        for kill in (os.killpg, os.kill):
            try:
                kill(w.pid, signal.SIGKILL)
                break
            except (ProcessLookupError, PermissionError):
                continue
        w.conn.close()
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel (D state): it will go when it can
            logger.warning("reward worker %d did not exit 10 s after SIGKILL", w.pid)
        shutil.rmtree(w.tmp, ignore_errors=True)  # what its last call left: a sandbox run's directory
        if w in self._workers:
            self._workers.remove(w)

    def _replace(self, w: _Worker, why: str) -> None:
        logger.warning("reward worker %d %s: killed and replaced", w.pid, why)
        self._kill(w)
        self._spawn()

    def start(self, wait_ready: bool = False) -> None:
        """Start the missing workers now: they load the function while the caller goes on, or,
        with `wait_ready`, before this returns (those that fail to are dropped, see `start_error`)."""
        with self._lock:
            self._grow(self.size)
            while wait_ready and any(not w.ready for w in self._workers):
                starting = {w.conn: w for w in self._workers if not w.ready}
                first_deadline = min(w.ready_by for w in starting.values())
                for conn in cast(
                    list[Connection], wait(list(starting), max(0.0, first_deadline - time.monotonic()))
                ):  # only Connections are waited on
                    w = starting[conn]
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    self._receive(w, msg, [])
                for w in [w for w in starting.values() if not w.ready and time.monotonic() >= w.ready_by]:
                    self._start_timed_out(w)

    def _grow(self, n: int) -> None:
        # dead workers go, and so do busy ones: a call of an interrupted `run` may still answer
        for w in [w for w in self._workers if w.proc.poll() is not None or w.job is not None]:
            self._kill(w)
        while len(self._workers) < n:
            self._spawn()

    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def close(self) -> None:
        """Kill every worker (idle ones hold nothing worth waiting for) and reap them."""
        if os.getpid() != self._owner:  # a forked copy of the pool owns no workers
            return
        for w in list(self._workers):
            self._kill(w)

    # ---------------------------------------------------------------- calls

    def run(self, payloads: Sequence[Any]) -> list[Reply]:
        """One reply per payload, in order; returns when each has a result, an error or timed out."""
        with self._lock:
            return self._run(payloads)

    def _run(self, payloads: Sequence[Any]) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(payloads)
        todo = collections.deque(range(len(payloads)))
        self.start_error = None
        self._grow(min(self.size, len(payloads)))
        while todo or any(w.job is not None for w in self._workers):
            if todo and not self._workers:  # every worker failed to start: the rest cannot be scored
                for i in todo:
                    replies[i] = Reply(None, f"no reward worker could load {self.path!r}: {self.start_error}", 0.0)
                break
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.job is None and todo:
                    self._send(w, todo, payloads, replies, now)
            deadlines = [w.ready_by for w in self._workers if not w.ready]
            if self.timeout_s is not None:
                deadlines += [w.sent + self.timeout_s for w in self._workers if w.job is not None]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            if not self._workers:
                continue
            by_conn = {w.conn: w for w in self._workers}
            for conn in cast(list[Connection], wait(list(by_conn), wait_s)):  # only Connections are waited on
                w = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                self._receive(w, msg, replies)
            now = time.monotonic()
            for w in list(self._workers):
                if w.job is not None and self.timeout_s is not None and now - w.sent >= self.timeout_s:
                    replies[w.job] = Reply(
                        None, f"timeout after {self.timeout_s:g}s (its worker was killed)", now - w.sent
                    )
                    self._replace(w, f"ran past the {self.timeout_s:g}s timeout")
                elif not w.ready and now >= w.ready_by:
                    self._start_timed_out(w)
        return replies  # type: ignore[return-value]  # the loop runs until every job has a reply, so no None is left

    def _start_timed_out(self, w: _Worker) -> None:
        self.start_error = f"the worker did not load it within {self.start_timeout_s:g}s"
        logger.warning("reward worker %d %s", w.pid, self.start_error)
        self._kill(w)

    def _send(self, w: _Worker, todo: collections.deque, payloads: Sequence[Any], replies: list, now: float) -> None:
        i = todo.popleft()
        try:
            w.conn.send(payloads[i])
        except (OSError, EOFError):  # it died while idle: the sample goes to the next worker
            todo.appendleft(i)
            self._replace(w, f"{_exit_text(w.proc.poll())} while idle")
            return
        except Exception as exc:
            replies[i] = Reply(None, describe(exc, "the sample could not be sent to a reward worker: "), 0.0)
            return
        w.job, w.sent = i, now

    def _receive(self, w: _Worker, msg: Any, replies: list) -> None:
        if not w.ready:
            if msg is not None and msg[0] == "ready":
                w.ready = True
                return
            self.start_error = msg[1] if msg is not None else f"the worker {_exit_text(_exit_code(w))} while starting"
            logger.warning("reward worker %d could not load %s: %s", w.pid, self.path, self.start_error)
            self._kill(w)
            return
        if w.job is None:  # an idle worker's pipe only becomes readable when it dies
            self._replace(w, f"{_exit_text(w.proc.poll())} while idle")
            return
        elapsed = time.monotonic() - w.sent
        if msg is None:
            code = _exit_code(w)
            replies[w.job] = Reply(None, f"the reward worker {_exit_text(code)} during the call", elapsed)
            self._replace(w, f"{_exit_text(code)} during a call")
            return
        kind, value = msg
        replies[w.job] = Reply(value, None, elapsed) if kind == "ok" else Reply(None, value, elapsed)
        w.job = None


# ------------------------------------------------------------------------------------ child side


def worker_main() -> None:
    """The child: load the function, then answer one call at a time until the pipe closes."""
    fd, parent = int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(signal.SIGKILL, parent)  # the kernel kills us with the trainer; a watchdog elsewhere
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle (it closes the pool)
    conn = Connection(fd)
    sys_path, path, per_group, options = conn.recv()
    sys.path[:] = sys_path
    try:
        fn = resolve_import_path(path)
        if options:
            fn = functools.partial(fn, **options)
    except BaseException as exc:
        conn.send(("failed", describe(exc)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            results = results_of(fn(arg), len(arg) if per_group else None)
            reply: tuple[str, Any] = ("ok", [(r.reward, r.info) for r in results])
        except BaseException as exc:
            reply = ("error", describe(exc))
        try:
            conn.send(reply)
        except Exception as exc:
            conn.send(("error", describe(exc, "the result could not be sent back: ")))
