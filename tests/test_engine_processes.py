"""Engines the trainer starts as `mcore-rl serve` processes (`EngineProcesses`): real processes on
loopback, reached through `HTTPEnginePool`, killed with SIGKILL and restarted, closed, failing at
startup, and outliving no trainer. One started pair serves the first tests (each server costs a
few seconds of imports)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from mcore_rl.config.schema import ModelConfig
from mcore_rl.rollout.client import EngineClient
from mcore_rl.rollout.engine_processes import EngineProcesses, EngineStartError
from mcore_rl.rollout.pool import GenRequest, HTTPEnginePool
from mcore_rl.rollout.weight_transports import SyncStats, TensorTransport
from mcore_rl.train.weight_sync import iter_buckets

ROOT = str(pathlib.Path(__file__).resolve().parents[1])
MODEL = ModelConfig()
START = dict(context_length=256, max_running_requests=8, threads=1, startup_timeout_s=120)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    engines = EngineProcesses.start(MODEL, num=2, workdir=str(tmp_path_factory.mktemp("engines")), seed=0, **START)
    yield engines
    engines.close()


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Weights for MODEL's shapes, initialised wide enough (std 0.2) for peaked distributions."""
    from mcore_rl.hf import McoreRLForCausalLM, hf_config_from_model_config

    torch.manual_seed(seed)
    wide = ModelConfig(init_method_std=0.2)
    return list(McoreRLForCausalLM(hf_config_from_model_config(wide)).state_dict().items())


def _sync(pool: HTTPEnginePool, shm: str, version: int) -> None:
    transport = TensorTransport(pool, shm_dir=shm)
    transport.send(iter_buckets(_weights(version), 1 << 20), version, SyncStats(version))
    transport.close()


def _each(urls: list[str], method: str, **kw) -> list:
    async def go() -> list:
        out = []
        for u in urls:
            async with EngineClient(u, retries=0, timeout=30) as c:
                out.append(await getattr(c, method)(**kw))
        return out

    return asyncio.run(go())


def _requests(n: int) -> list[GenRequest]:
    sp = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    return [GenRequest(list(b"12+34="), {**sp, "sampling_seed": i}) for i in range(n)]


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    """No such process, or only a zombie nobody reaped yet (its parent is gone too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_two_engines_start_with_dummy_weights_and_serve_through_the_pool(pair, tmp_path):
    with open(os.path.join(pair.model_dir, "config.json")) as f:
        assert json.load(f)["hidden_size"] == MODEL.hidden_size  # config.json only: no weight file
    assert os.listdir(pair.model_dir) == ["config.json"]
    infos = _each(pair.urls, "get_server_info")
    assert [i["load_format"] for i in infos] == ["dummy", "dummy"] and [i["random_seed"] for i in infos] == [0, 1]
    body = dict(input_ids=list(b"hello"), sampling_params=GREEDY, return_logprob=True)
    before = _each(pair.urls, "generate", **body)
    assert (
        before[0]["meta_info"]["output_token_logprobs"] != before[1]["meta_info"]["output_token_logprobs"]
    )  # seed + i

    pool = HTTPEnginePool(pair.urls, timeout=30, health_interval=0.3)
    try:
        _sync(pool, str(tmp_path), 1)
        gens = pool.generate(_requests(8))
        assert len(gens) == 8 and all(len(g.output_ids) == 4 and g.weight_version == 1 for g in gens)
    finally:
        pool.close()
    after = _each(pair.urls, "generate", **body)  # one sync: the same weights everywhere
    assert after[0]["output_ids"] == after[1]["output_ids"]
    assert after[0]["meta_info"]["output_token_logprobs"] == after[1]["meta_info"]["output_token_logprobs"]
    # Log-probs of the temperature-scaled distribution (what the learner recomputes): the gap
    # between the two likeliest first tokens doubles at temperature 0.5.
    gaps = []
    for t in (1.0, 0.5):
        out = _each(
            pair.urls[:1],
            "generate",
            input_ids=list(b"hello"),
            return_logprob=True,
            top_logprobs_num=2,
            sampling_params={"max_new_tokens": 1, "temperature": t, "sampling_seed": 0},
        )[0]
        (a, _, _), (b, _, _) = out["meta_info"]["output_top_logprobs"][0]
        gaps.append(a - b)
    assert gaps[0] > 0.01 and gaps[1] == pytest.approx(2 * gaps[0], rel=1e-4)


def test_a_killed_engine_restarts_at_its_url_and_waits_for_the_weights(pair, tmp_path):
    pool = HTTPEnginePool(pair.urls, timeout=10, health_interval=0.3)
    try:
        _sync(pool, str(tmp_path), 5)
        url, old = pair.urls[1], pair.pids[1]
        os.kill(old, signal.SIGKILL)
        _wait_for(lambda: not pair.alive(1))
        assert all(len(g.output_ids) == 4 for g in pool.generate(_requests(8)))  # failed over to engine 0

        pair.restart(1)
        assert pair.alive(1) and pair.pids[1] != old and pair.urls[1] == url and _gone(old)
        _wait_for(lambda: url in pool.router.stale)  # back with dummy weights: not served from yet
        assert pool.live == pair.urls[:1] and _each([url], "get_weight_version") == ["0"]
        _sync(pool, str(tmp_path), 6)
        assert _each(pair.urls, "get_weight_version") == ["6", "6"] and pool.live == pair.urls
        assert all(g.weight_version == 6 for g in pool.generate(_requests(4)))
    finally:
        pool.close()


def test_two_engines_killed_close_together_restart_at_once_and_a_sync_waits_for_them(tmp_path):
    """Both started engines die close together (one killed, the other killed while the first
    restarts): the pool restarts both at once, each launched without waiting for the other to
    answer, and a weight sync that finds no engine waits for a restarting one (up to
    `no_engine_timeout_s`) instead of raising; both serve again after it."""
    from mcore_rl.rollout.engine_state import EngineState

    engines = EngineProcesses.start(MODEL, num=2, workdir=str(tmp_path / "engines"), seed=0, **START)
    pool = HTTPEnginePool(
        engines.urls, timeout=30, health_interval=0.3, processes=engines, restart_dead=True, no_engine_timeout_s=240
    )
    try:
        _sync(pool, str(tmp_path), 1)
        first, second = engines.pids
        os.kill(first, signal.SIGKILL)
        _wait_for(lambda: pool.states.state(engines.urls[0]) is EngineState.STARTING)
        os.kill(second, signal.SIGKILL)  # while the first restarts
        _wait_for(lambda: pool.states.state(engines.urls[1]) is EngineState.STARTING)
        # both restart at once: the second was noticed before the first answered
        assert pool.states.state(engines.urls[0]) is EngineState.STARTING
        assert pool.live == [] and pool.update_targets() == []
        _sync(pool, str(tmp_path), 2)  # waits for a restarted engine, then sends to it
        assert "2" in _each([u for u in engines.urls if u in pool.live], "get_weight_version")
        _wait_for(lambda: pool.update_targets() == engines.urls, timeout=240)
        _sync(pool, str(tmp_path), 3)
        assert pool.live == engines.urls and _each(engines.urls, "get_weight_version") == ["3", "3"]
        assert first not in engines.pids and second not in engines.pids
    finally:
        pool.close()


def test_close_leaves_no_process(pair):
    pids = pair.pids
    pair.close()
    for pid in pids:
        assert _gone(pid)
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # nor anything in its process group
    assert pair.pids == [None, None] and not pair.alive(0)
    pair.close()  # idempotent


def test_an_engine_that_fails_at_startup_names_itself_and_its_log(tmp_path):
    with pytest.raises(EngineStartError) as err:
        EngineProcesses.start(MODEL, num=1, workdir=str(tmp_path / "bad"), extra_args=["--tp-size", "2"], **START)
    msg = str(err.value)
    log = str(tmp_path / "bad" / "engine_0.log")
    assert "engine 0" in msg and "exited with code 2" in msg and log in msg and "--tp-size 2" in msg

    with pytest.raises(EngineStartError) as err:
        EngineProcesses.start(MODEL, num=1, workdir=str(tmp_path / "slow"), **{**START, "startup_timeout_s": 0.5})
    msg = str(err.value)
    assert "did not answer" in msg and "/health within" in msg and "engine_0.log" in msg
    pid = int(msg.split("(pid ")[1].split(",")[0])
    assert _gone(pid)


_TRAINER = """
import sys, time
from mcore_rl.config.schema import ModelConfig
from mcore_rl.rollout.engine_processes import EngineProcesses
engines = EngineProcesses.start(ModelConfig(), num=1, workdir=sys.argv[1], context_length=64, threads=1)
print(engines.pids[0], flush=True)
time.sleep(600)
"""


def test_engines_die_with_the_trainer(tmp_path):
    """A trainer killed with SIGKILL runs no cleanup; its engines go anyway (PDEATHSIG)."""
    path = os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    try:
        engine = int(trainer.stdout.readline())
        assert not _gone(engine)
        trainer.kill()
        trainer.wait(10)
        _wait_for(lambda: _gone(engine), timeout=10)
    finally:
        trainer.kill()
        trainer.wait()


_SHM_ENGINE = r"""
import http.server, multiprocessing, os, subprocess, sys
from multiprocessing import resource_tracker, shared_memory
# Python's resource tracker (a process of its own) would unlink these when the server dies; vLLM's
# segments outlive it, so here nothing but the trainer's ledger may remove them.
host, port = sys.argv[1], int(sys.argv[2])
mine = shared_memory.SharedMemory(create=True, size=4096)  # held (mapped) by the server itself
seen = shared_memory.SharedMemory(name=os.environ["FOREIGN_SHM"])  # someone else's, mapped here too
for segment in (mine, seen):
    resource_tracker.unregister(segment._name, "shared_memory")
# a semaphore as vLLM's worker makes one (`sem.mp-*`): glibc maps it under a temporary name, so
# this process's mapping reads `/dev/shm/sem.XXXXXX (deleted)`, never the name it has
lock = multiprocessing.get_context("spawn").Lock()
resource_tracker.unregister(lock._semlock.name, "semaphore")
child = subprocess.Popen(  # a grandchild of the trainer makes one too (vLLM's EngineCore, say)
    [sys.executable, "-c", "import time; from multiprocessing import resource_tracker as r, shared_memory as s; "
     "m = s.SharedMemory(create=True, size=4096); r.unregister(m._name, 'shared_memory'); "
     "print(m.name, flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
print("made", mine.name, child.stdout.readline().strip(), "sem." + lock._semlock.name[1:], flush=True)
print("child pid", child.pid, flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer((host, port), Health).serve_forever()
"""


class _ShmEngines(EngineProcesses):
    """A stand-in server that makes POSIX shared memory in itself and in a child."""

    def _argv(self, e):
        return [sys.executable, "-c", _SHM_ENGINE, self.host, str(e.port)]


def _made(log: str) -> list[str]:
    with open(log) as f:
        return [line.split()[1:] for line in f if line.startswith("made ")][-1]


def test_shared_memory_an_engine_made_goes_with_it_and_nothing_else(tmp_path):
    """POSIX shared memory outlives a process killed with SIGKILL (vLLM's `psm_*` segments and a
    `sem.mp-*` semaphore, which glibc maps under a temporary name, did):
    what an engine's process tree made goes when it is restarted after a kill or closed; what
    predates it (even mapped by it), what another process holds, and what another process made
    and let go of while the engine ran, all stay."""
    from multiprocessing import shared_memory

    from mcore_rl.rollout.engine_processes import _Engine

    shm = "/dev/shm"
    old = shared_memory.SharedMemory(create=True, size=4096)  # before the engine, mapped by it too
    env = {**os.environ, "FOREIGN_SHM": old.name}
    log = str(tmp_path / "engine_0.log")
    engines = _ShmEngines([_Engine(0, 0, [], env, None, log)], "127.0.0.1", str(tmp_path), 60)
    held = unheld = None
    try:
        engines._start_all()
        first = _made(log)
        assert len(first) == 3 and all(os.path.exists(os.path.join(shm, n)) for n in first)
        assert engines.shared_memory(0) == set(first)
        held = shared_memory.SharedMemory(create=True, size=4096)  # made while it runs, held by us
        unheld = os.path.join(shm, f"foreign_{os.getpid()}_{time.monotonic_ns()}")
        with open(unheld, "wb") as f:  # made while it runs, by someone who let go of it
            f.write(b"x")
        assert engines.shared_memory(0) == set(first)

        os.kill(engines.pids[0], signal.SIGKILL)  # the server only: its child lives on, holding its segment
        _wait_for(lambda: not engines.alive(0))
        assert os.path.exists(os.path.join(shm, first[1]))
        engines.restart(0)  # stops what is left of the tree, removes what it made, starts again
        assert not any(os.path.exists(os.path.join(shm, n)) for n in first)
        second = _made(log)
        assert set(second).isdisjoint(first) and all(os.path.exists(os.path.join(shm, n)) for n in second)

        engines.close()
        assert not any(os.path.exists(os.path.join(shm, n)) for n in second)
        for name in (old.name, held.name, os.path.basename(unheld)):
            assert os.path.exists(os.path.join(shm, name)), f"{name} is not the engine's"
    finally:
        engines.close()
        if unheld is not None and os.path.exists(unheld):
            os.remove(unheld)
        for seg in (old, held):
            if seg is not None:
                seg.close()
                if os.path.exists(os.path.join(shm, seg.name)):
                    seg.unlink()


_SHM_TRAINER = """
import os, sys, time
sys.path.insert(0, sys.argv[2])
from mcore_rl.rollout.engine_processes import _Engine
from test_engine_processes import _ShmEngines
engines = _ShmEngines([_Engine(0, 0, [], dict(os.environ), None, sys.argv[1])], "127.0.0.1", os.path.dirname(sys.argv[1]), 60)
engines._start_all()
print(" ".join(sorted(engines.shared_memory(0))), flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_with_sigkill_leaves_no_engine_shared_memory(tmp_path):
    """The trainer runs no cleanup then; the ledger's reaper, told each name over a pipe, removes
    the engine's segments at the pipe's end (a grandchild still holding one does not keep it)."""
    from multiprocessing import shared_memory

    old = shared_memory.SharedMemory(create=True, size=4096)  # someone else's: stays
    path = os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
    log = str(tmp_path / "engine_0.log")
    trainer = subprocess.Popen(
        [sys.executable, "-c", _SHM_TRAINER, log, os.path.dirname(os.path.abspath(__file__))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "FOREIGN_SHM": old.name},
    )
    made: list[str] = []
    try:
        made = trainer.stdout.readline().split()
        assert sorted(made) == sorted(_made(log)) and all(os.path.exists(os.path.join("/dev/shm", n)) for n in made)
        trainer.kill()
        trainer.wait(10)
        _wait_for(lambda: not any(os.path.exists(os.path.join("/dev/shm", n)) for n in made), timeout=20)
        assert os.path.exists(os.path.join("/dev/shm", old.name))
    finally:
        trainer.kill()
        trainer.wait()
        lines = open(log).read().splitlines() if os.path.exists(log) else []
        for pid in [int(line.split()[2]) for line in lines if line.startswith("child pid ")]:
            # the server died with the trainer (PDEATHSIG); the child it started did not
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        old.close()
        old.unlink()
