"""An environment in a process of its own, so that a hang or a crash in it can be killed.

`GuardedEnv` runs each call in a thread under a timeout, but a thread cannot be stopped: an
environment stuck in C code (holding the GIL, it stalls the whole runner) or spinning in a loop keeps
its thread and its CPU. `make_process_env(name, **options)` builds the environment in a child
interpreter instead (`python -c`, importing `mcore_rl.envs`; 0.3-1 s to start) and forwards
`reset`/`step`/`close` over a socket pair, pickled; put it behind `GuardedEnv` as any other:

    env = GuardedEnv(make_process_env("frozen_lake", size=8), EnvGuards(step_timeout_s=5))

On a timeout the guard closes it, which SIGKILLs the child's process group, so the abandoned call
returns (its socket closes) and nothing is left running. An exception in the child comes back as
`EnvProcessError` naming it, a child that died as `EnvProcessError` with its exit status; both cost
the episode through the guard. The child dies with its parent (`PR_SET_PDEATHSIG`, asked from a
long-lived spawner thread, since the kernel sends it when the *thread* that forked the child exits).
"""

from __future__ import annotations

import importlib
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from mcore_rl.data.samples import Prompt
from mcore_rl.envs import env_options, make_env
from mcore_rl.envs.base import AgentAction, Environment, EnvReset, EnvStep
from mcore_rl.parallel.lifetime import die_with_parent

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from mcore_rl.envs.process import child_main; child_main()"


class EnvProcessError(Exception):
    """The environment's process raised (its exception named in the message) or died."""


class _Spawner:
    """Starts every child from one long-lived daemon thread (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue[tuple[list[str], dict[str, Any], Future[subprocess.Popen[bytes]]]] = (
            queue.SimpleQueue()
        )
        self.thread: threading.Thread | None = None

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._serve, name="env-spawner", daemon=True)
                self.thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self.jobs.put((args, kwargs, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            args, kwargs, done = self.jobs.get()
            try:
                done.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as exc:  # the caller re-raises it
                done.set_exception(exc)


_SPAWNER = _Spawner()


class ProcessEnv(Environment):
    """Environment `name` with `options`, built and run in a child process."""

    def __init__(self, name: str, options: dict[str, Any], modules: tuple[str, ...] = ()) -> None:
        parent_end, child_end = socket.socketpair()
        self.proc = _SPAWNER.popen(
            [sys.executable, "-c", _CHILD, _ROOT, str(child_end.fileno()), str(os.getpid())],
            pass_fds=(child_end.fileno(),),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        child_end.close()
        self.conn = Connection(parent_end.detach())
        self.lock = threading.Lock()
        self.closed = False
        self._call("make", name, options, list(modules), list(sys.path))

    def _call(self, method: str, *args: Any) -> Any:
        with self.lock:
            try:
                self.conn.send((method, args))
                status, value = self.conn.recv()
            except (EOFError, OSError) as exc:
                # The socket closes a moment before the child is reaped: give it that moment to say why.
                try:
                    code: int | None = self.proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    code = None
                why = f"exited with status {code}" if code is not None else f"its connection broke ({exc})"
                raise EnvProcessError(f"the environment's process {why}") from None
        if status == "error":
            raise EnvProcessError(value)
        return value

    def reset(self, prompt: Prompt, seed: int) -> EnvReset:
        start = self._call("reset", prompt, seed)
        assert isinstance(start, EnvReset), type(start)
        return start

    def step(self, action: AgentAction) -> EnvStep:
        out = self._call("step", action)
        assert isinstance(out, EnvStep), type(out)
        return out

    def close(self) -> None:
        """Close the environment in its process if it answers within a second, then kill the process
        group (at once if a call is still running in it: that call then fails with `EnvProcessError`)."""
        if self.closed:
            return
        self.closed = True
        if self.lock.acquire(timeout=0.0):
            try:
                self.conn.send(("close", ()))
                if self.conn.poll(1.0):
                    self.conn.recv()
            except (EOFError, OSError):
                pass
            finally:
                self.lock.release()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.conn.close()


def make_process_env(name: str, modules: tuple[str, ...] = (), **options: Any) -> ProcessEnv:
    """`make_env(name, **options)` in a child process (options are checked here first, naming a bad key).
    `modules`: modules the child imports first, which register environments outside `mcore_rl.envs`
    (the child searches this process's `sys.path`)."""
    env_options(name, **options)
    return ProcessEnv(name, options, modules)


def child_main() -> None:
    """The child: build the environment, answer calls until "close" or end-of-file."""
    fd, parent = int(sys.argv[2]), int(sys.argv[3])
    die_with_parent(signal.SIGKILL, parent)
    conn = Connection(fd)
    env: Environment | None = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if method == "make":
                name, options, modules, path = args
                sys.path[:] = path
                for module in modules:
                    importlib.import_module(module)
                env = make_env(name, **options)
                value: Any = None
            elif env is None:
                raise RuntimeError("no environment: it was not built")
            elif method == "close":
                env.close()
                conn.send(("ok", None))
                break
            else:
                value = getattr(env, method)(*args)
            reply = ("ok", value)
            pickle.dumps(reply)  # an unpicklable answer is the environment's error, not the child's crash
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)
    os._exit(0)
