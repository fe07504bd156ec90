"""Embedded engines as their own processes, started and owned by the trainer (docs/design.md#engines-are-processes).

In asynchronous mode with no engine URL configured, generation must overlap training, so the
engines cannot be `EngineCore`s stepped by the trainer's own thread. `EngineProcesses.start`
writes an HF-format directory holding only the config.json of the trainer's model and runs
`mcore-rl serve --load-format dummy` on it, once per engine: random weights (engine i seeded
with seed + i, as `EmbeddedEnginePool.build` does), no weight file read; the trainer's first
weight sync fills them. The trainer then reaches the engines as any SGLang servers, through
`HTTPEnginePool(engines.urls)`.

The processes die with the trainer, however it dies: each gets SIGTERM from the kernel when the
thread that started it exits (`PR_SET_PDEATHSIG`, `parallel/lifetime.py`; so start and restart
them from a thread that lives as long as they should, normally the main thread), and each leads
its own process group, which `close()` kills (SIGKILL: nothing in an engine needs a graceful
stop) so nothing it started survives it. Nor does the POSIX shared memory its process tree made
(vLLM's `psm_*` segments, say): a `SharedMemoryLedger` per launch notes what the tree holds (once it
answers, every few seconds in `alive()`, before it is stopped) and removes it once the tree is dead,
never an entry that predates it or that another process holds. `restart(i)` brings an engine back at the same URL with dummy weights again (returning
once it answers); `relaunch(i)` and `poll_start(i)` do the same in two halves, so that the pool's
restarter can bring several back at once. The pool then finds it at another weight version and
keeps it waiting for weights, out of generation, until the next weight sync reaches it.

The servers report log-probs of the temperature-scaled distribution they sample from
(`SGLANG_RETURN_ORIGINAL_LOGPROB=0`), as the embedded pool's engines do, because that is what the
learner recomputes.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Sequence

from mcore_rl.config.rl_schema import EngineGroupConfig
from mcore_rl.config.schema import ModelConfig
from mcore_rl.parallel.lifetime import SharedMemoryLedger, preexec_die_with_parent
from mcore_rl.rollout.weight_transports import SHM_PREFIX
import mcore_rl

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 20  # of an engine's log, in a startup error
STOP_GRACE_S = 5.0  # restart of a live engine: SIGTERM -> SIGKILL (the server exits within 3 s of SIGTERM)
_BIND_RETRIES = 3  # a free port taken by someone else between the probe and the server's bind
_PORT_IN_USE = ("address already in use", "errno 98")
SHM_SCAN_INTERVAL_S = 2.0  # how often `alive()` looks for shared memory a running engine made


class EngineStartError(RuntimeError):
    """An engine process exited or did not answer `/health` in time; the message names the engine,
    its log and the log's last lines."""


@dataclass
class _Engine:
    index: int
    port: int
    argv_tail: list[str]  # the flags after --port, fixed for the engine's life
    env: dict[str, str]
    cores: list[int] | None
    log_path: str
    proc: subprocess.Popen | None = None
    log_offset: int = 0  # where this launch's lines start in the (appended) log
    launched_at: float = 0.0  # time.monotonic() of the current launch
    shm: SharedMemoryLedger | None = None  # the shared memory this launch's process tree made
    scanned_at: float = 0.0  # time.monotonic() of the ledger's last scan


class EngineProcesses:
    """`num` `mcore-rl serve` processes on this host; `.urls` for `HTTPEnginePool`."""

    def __init__(self, engines: list[_Engine], host: str, model_dir: str, startup_timeout_s: float) -> None:
        self._engines = engines
        self.host = host
        self.model_dir = model_dir
        self.startup_timeout_s = startup_timeout_s
        self._closed = False
        ref = weakref.ref(self)
        self._atexit: Callable[[], None] = lambda: (lambda s: s.close() if s is not None else None)(ref())
        atexit.register(self._atexit)

    @classmethod
    def start(
        cls,
        model_config: ModelConfig | None,
        *,
        num: int,
        workdir: str,
        tokenizer_path: str | None = None,
        quantization: str = "none",
        max_running_requests: int = 256,
        context_length: int = 1024,
        seed: int = 0,
        cores: Sequence[Sequence[int]] | None = None,
        devices: Sequence[str] | None = None,
        threads: int | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 300.0,
        model_path: str | None = None,
    ) -> EngineProcesses:
        """Start `num` engines serving `model_config` and return once every one answers `/health`.

        With `model_path` (an HF-format directory with weights, e.g. a teacher of on-policy
        distillation) the engines serve that checkpoint as it is (`--load-format auto`: no weight
        sync fills them, a restart reads it again) and `model_config` is not used.

        quantization: "fp8" | "bf16" | "none" (`rollout.quantization`). cores: CPU affinity per
        engine; devices: `CUDA_VISIBLE_DEVICES` per engine (each engine then runs on CUDA; without
        it the server picks cuda when visible, else cpu); threads: torch/OpenMP threads per
        engine. extra_args: more `mcore-rl serve` flags (e.g. `--weight-dirs DIR`). Logs go to
        `workdir/engine_{i}.log`. Raises `EngineStartError` (after stopping every engine it
        started) if one exits or stays silent for `startup_timeout_s`."""
        if num < 1:
            raise ValueError(f"num: need at least one engine, got {num}")
        for name, per in (("cores", cores), ("devices", devices)):
            if per is not None and len(per) != num:
                raise ValueError(f"{name}: one entry per engine expected ({num}), got {len(per)}")
        if quantization not in ("fp8", "bf16", "none"):
            raise ValueError(f"quantization: {quantization!r} is not one of fp8, bf16, none")
        os.makedirs(workdir, exist_ok=True)
        if model_path is not None:
            model_dir, load_format = os.path.abspath(model_path), "auto"
        elif model_config is not None:
            model_dir, load_format = write_model_dir(model_config, os.path.join(workdir, "model")), "dummy"
        else:
            raise ValueError("model_config / model_path: give one of them")
        common = [
            "--model-path",
            model_dir,
            "--load-format",
            load_format,
            "--context-length",
            str(context_length),
            "--max-running-requests",
            str(max_running_requests),
        ]
        common += ["--quantization", "fp8"] if quantization == "fp8" else []
        common += ["--dtype", "bfloat16" if quantization == "bf16" else "float32"]
        common += ["--tokenizer-path", tokenizer_path] if tokenizer_path else []
        common += ["--api-key", api_key] if api_key else []
        common += ["--admin-api-key", admin_api_key] if admin_api_key else []
        if model_config is not None and model_config.is_moe:  # routing replay (R3) may ask for the experts
            common += ["--enable-return-routed-experts"]
        engines = []
        for i in range(num):
            env = _child_env(threads)
            tail = [*common, "--random-seed", str(seed + i)]
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(devices[i])
                tail += ["--device", "cuda"]
            engines.append(
                _Engine(
                    i,
                    0,
                    [*tail, *extra_args],
                    env,
                    list(cores[i]) if cores is not None else None,
                    os.path.join(workdir, f"engine_{i}.log"),
                )
            )
        procs = cls(engines, host, model_dir, startup_timeout_s)
        procs._start_all()
        logger.info("started %d engine processes: %s", num, ", ".join(procs.urls))
        return procs

    # ---- state -----------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [self._url(e) for e in self._engines]

    @property
    def pids(self) -> list[int | None]:
        """The current process of each engine (None once closed)."""
        return [e.proc.pid if e.proc is not None else None for e in self._engines]

    @property
    def log_paths(self) -> list[str]:
        return [e.log_path for e in self._engines]

    def __len__(self) -> int:
        return len(self._engines)

    def alive(self, i: int) -> bool:
        """Whether engine `i`'s process runs (every `SHM_SCAN_INTERVAL_S` this also notes the
        shared memory its process tree made, which goes when it is stopped)."""
        e = self._engines[i]
        running = e.proc is not None and e.proc.poll() is None
        if running and time.monotonic() - e.scanned_at > SHM_SCAN_INTERVAL_S:
            self._scan_shm(e)
        return running

    def shared_memory(self, i: int) -> set[str]:
        """The /dev/shm entries engine `i`'s current process tree made, as far as seen."""
        e = self._engines[i]
        return self._scan_shm(e) if e.proc is not None else set()

    # ---- control ---------------------------------------------------------------------------

    def restart(self, i: int) -> None:
        """Stop engine `i` if it still runs and start it again at the same URL, dummy weights
        again; returns once it answers `/health`. The pool keeps it out of generation until a
        weight sync reached it."""
        for attempt in range(_BIND_RETRIES):
            self.relaunch(i)
            try:
                while not self.poll_start(i):
                    time.sleep(0.1)
                logger.warning("engine %d restarted at %s (pid %s)", i, self._url(self._engines[i]), self.pids[i])
                return
            except _PortInUse:
                time.sleep(0.5 * (attempt + 1))  # our URL is fixed: wait for the port to come free
        e = self._engines[i]
        raise EngineStartError(
            f"engine {i}: port {e.port} stayed in use; cannot restart at {self._url(e)} (log: {e.log_path})"
        )

    def relaunch(self, i: int) -> None:
        """Stop engine `i` if it still runs and launch it again at the same URL (dummy weights
        again), without waiting for it: `poll_start(i)` says when it answers. Call it from the
        thread that should outlive the engine (PDEATHSIG)."""
        if self._closed:
            raise RuntimeError("relaunch: the engine processes are closed")
        e = self._engines[i]
        self._stop(e)
        self._launch(e)

    def poll_start(self, i: int) -> bool:
        """True once engine `i`, (re)launched, answers `/health`; False while it starts. Raises
        `EngineStartError` (naming its log) if it exited or stayed silent for the startup timeout
        (it is stopped then; `relaunch` starts it again); `_PortInUse` if its port was taken."""
        e = self._engines[i]
        if e.proc is None:
            raise EngineStartError(f"engine {i} is not running")
        code = e.proc.poll()
        if code is not None:
            if any(s in self._log_tail(e).lower() for s in _PORT_IN_USE):
                raise _PortInUse(e.port)
            raise EngineStartError(self._failure(e, f"exited with code {code} during startup"))
        if _healthy(self._url(e)):
            self._ready(e)
            return True
        if time.monotonic() - e.launched_at > self.startup_timeout_s:
            message = self._failure(
                e, f"did not answer {self._url(e)}/health within {self.startup_timeout_s:g} s; stopped it"
            )
            self._stop(e)
            raise EngineStartError(message)
        return False

    def close(self) -> None:
        """Stop every engine: SIGKILL to its process group, then reap it; idempotent. No grace
        period: an engine the trainer started holds nothing that outlives it (its weights come
        from the trainer, its requests are the scheduler's, which checkpoints them), and a
        graceful stop cost the trainer's exit 3-5 s, inside a scheduler's pre-emption grace."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        for e in self._engines:
            self._scan_shm(e)
            _signal_group(e, signal.SIGKILL)
        for e in self._engines:
            if e.proc is not None:
                pgid = e.proc.pid
                e.proc.wait()
                e.proc = None
                _wait_group_gone(pgid)
            self._release_shm(e)

    def __enter__(self) -> EngineProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- internals -------------------------------------------------------------------------

    def _url(self, e: _Engine) -> str:
        return f"http://{self.host}:{e.port}"

    def _argv(self, e: _Engine) -> list[str]:
        """The command line of engine `e` (a subclass starts another server: `vllm_processes.py`)."""
        return [sys.executable, "-m", "mcore_rl.cli", "serve", "--host", self.host, "--port", str(e.port), *e.argv_tail]

    def _start_all(self) -> None:
        """Launch every engine at once (their imports and model builds overlap) on a free port and
        wait until each answers; on any failure stop them all and raise."""
        try:
            for e in self._engines:
                e.port = _free_port(self.host)
                self._launch(e)
            for e in self._engines:
                self._wait_ready(e, new_port_on_clash=True)
        except BaseException:
            self.close()
            raise

    def _launch(self, e: _Engine) -> None:
        argv = self._argv(e)
        self._release_shm(e)  # an earlier launch that exited by itself (a port clash)
        e.shm = SharedMemoryLedger(keep_prefixes=(SHM_PREFIX,))  # the trainer's weight buckets stay
        with open(e.log_path, "ab") as log:
            e.log_offset = log.tell()
            log.write(f"--- engine {e.index}: {' '.join(argv)}\n".encode())
            log.flush()
            e.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=e.env,
                start_new_session=True,
                preexec_fn=_preexec(e.cores),
            )
            e.launched_at = time.monotonic()
        e.shm.started(e.proc.pid)

    def _wait_ready(self, e: _Engine, *, new_port_on_clash: bool) -> None:
        """Until `/health` answers 200. An engine whose port was taken meanwhile starts again on
        another one (`new_port_on_clash`) or raises `_PortInUse`."""
        for _ in range(_BIND_RETRIES):
            try:
                while not self.poll_start(e.index):
                    time.sleep(0.1)
                return
            except _PortInUse:
                if not new_port_on_clash:
                    raise
            logger.warning("engine %d: port %d was taken; trying another", e.index, e.port)
            e.port = _free_port(self.host)
            self._launch(e)
        raise EngineStartError(self._failure(e, f"found no free port in {_BIND_RETRIES} tries"))

    def _ready(self, e: _Engine) -> None:
        """Engine `e` answered `/health` (after each launch): note the shared memory it made."""
        self._scan_shm(e)

    def _failure(self, e: _Engine, what: str) -> str:
        return (
            f"engine {e.index} (pid {e.proc.pid if e.proc is not None else None}, {self._url(e)}) {what}; log: {e.log_path}; its last lines:\n"
            + self._log_tail(e)
        )

    def _log_tail(self, e: _Engine) -> str:
        try:
            with open(e.log_path, "rb") as f:
                f.seek(e.log_offset)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError as err:
            return f"  (log unreadable: {err})"
        return "\n".join("  " + line for line in lines[-LOG_TAIL_LINES:])

    def _stop(self, e: _Engine, deadline: float | None = None) -> None:
        """SIGTERM the engine's group (unless already sent), SIGKILL it at `deadline`, reap it."""
        if e.proc is None:
            return
        self._scan_shm(e)  # the last look while its tree may still live
        if deadline is None:
            _signal_group(e, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
        try:
            e.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("engine %d (pid %d) ignored SIGTERM; killing it", e.index, e.proc.pid)
        _signal_group(e, signal.SIGKILL)  # also whatever it started, even if it exited itself
        e.proc.wait()
        e.proc = None
        self._release_shm(e)

    def _scan_shm(self, e: _Engine) -> set[str]:
        e.scanned_at = time.monotonic()
        return e.shm.scan() if e.shm is not None else set()

    def _release_shm(self, e: _Engine) -> None:
        """Remove the shared memory engine `e`'s (dead) process tree made."""
        if e.shm is not None:
            removed = e.shm.release()
            e.shm = None
            if removed:
                logger.info("engine %d: removed the shared memory it left: %s", e.index, ", ".join(removed))


def start_engine_group(
    group: EngineGroupConfig,
    *,
    workdir: str,
    context_length: int,
    startup_timeout_s: float,
    tokenizer_path: str | None = None,
    seed: int = 0,
    extra_args: Sequence[str] = (),
) -> EngineProcesses | None:
    """The `mcore-rl serve` processes of an engine group with `model_path` (engine teachers, the
    explorer, judges), started and healthy; None for a group of running servers (`urls`).
    `context_length`: the run's, for a group that sets none."""
    if not group.model_path:
        return None
    return EngineProcesses.start(
        None,
        num=group.num_engines,
        workdir=workdir,
        model_path=group.model_path,
        tokenizer_path=tokenizer_path,
        context_length=group.context_length or context_length,
        max_running_requests=group.max_running_requests,
        quantization=group.quantization,
        seed=seed,
        cores=group.engine_cores or None,
        threads=group.engine_threads,
        api_key=group.api_key,
        startup_timeout_s=startup_timeout_s,
        extra_args=extra_args,
    )


class _PortInUse(Exception):
    pass


def write_model_dir(model_config: ModelConfig, path: str) -> str:
    """An HF-format directory with the config.json of `model_config` (no weights: the engines
    start with `--load-format dummy`); returns its absolute path."""
    from mcore_rl.hf import hf_config_from_model_config  # lazy: transformers

    os.makedirs(path, exist_ok=True)
    hf_config_from_model_config(model_config).save_pretrained(path)
    return os.path.abspath(path)


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(mcore_rl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)  # this mcore_rl
    env["PYTHONUNBUFFERED"] = "1"
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "0"  # what the learner recomputes (see the module docstring)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _preexec(cores: list[int] | None) -> Callable[[], None]:
    """Runs in the child before exec: SIGTERM when the starting thread dies, then CPU affinity."""
    die = preexec_die_with_parent(signal.SIGTERM)

    def preexec() -> None:
        die()
        if cores:
            os.sched_setaffinity(0, cores)

    return preexec


def _signal_group(e: _Engine, sig: int) -> None:
    if e.proc is None:
        return
    try:
        os.killpg(e.proc.pid, sig)  # start_new_session: the engine leads its own group
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout_s: float = 15.0) -> None:
    """Until no live process of group `pgid` is left: SIGKILL is delivered at once, but a process
    that maps gigabytes (vLLM's EngineCore and worker) takes a moment to tear down after its leader
    is reaped, and `close()` promises that nothing of the engine runs when it returns."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = False
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                alive = True
                break
        if not alive:
            return
        time.sleep(0.05)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
