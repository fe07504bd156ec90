"""The engine pool against real faults: engine processes killed with SIGKILL, frozen with SIGSTOP,
restarted; streams that break off. Every engine is its own process on loopback, found by its pid."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from mcore_rl.rollout.client import EngineClient, EngineUnavailable
from mcore_rl.rollout.pool import GenRequest, HTTPEnginePool
from mcore_rl.rollout.router import EngineRouter, NoHealthyEngine
from mcore_rl.rollout.weight_protocol import WeightChecksum
from mcore_rl.rollout.weight_transports import DiskTransport, DistributedTransport, SyncStats, TensorTransport
from mcore_rl.train.weight_sync import iter_buckets
from tests.helpers import ENGINE_FAULTS_CONTEXT as CONTEXT, Engine
from tests.helpers import _weights


@pytest.fixture
def engines():
    pair = [Engine(), Engine()]
    yield pair
    for e in pair:
        e.close()


def _versions(urls: list[str]) -> list[str]:
    async def get() -> list[str]:
        out = []
        for u in urls:
            async with EngineClient(u, retries=0, timeout=5) as c:
                out.append(str(await c.get_weight_version()))
        return out

    return asyncio.run(get())


def _info(url: str, what: str = "get_server_info") -> dict:
    async def get() -> dict:
        async with EngineClient(url, retries=0, timeout=5) as c:
            return await getattr(c, what)()

    return asyncio.run(get())


def _requests(n: int, tokens: int = 4) -> list[GenRequest]:
    return [
        GenRequest(
            list(b"12+34="), {"max_new_tokens": tokens, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
        )
        for i in range(n)
    ]


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.2)


def test_a_killed_engine_is_skipped_and_a_restarted_one_gets_the_weights_first(engines, tmp_path, caplog):
    a, b = engines
    pool = HTTPEnginePool([a.url, b.url], timeout=10, health_interval=0.3)
    try:
        transport = TensorTransport(pool, shm_dir=str(tmp_path))
        transport.send(iter_buckets(_weights(1), 1 << 20), 1, SyncStats(1))
        assert _versions([a.url, b.url]) == ["1", "1"]

        b.signal(signal.SIGKILL)
        gens = pool.generate(_requests(16))  # in-flight requests fail over to the live engine
        assert len(gens) == 16 and all(len(g.output_ids) == 4 for g in gens)
        with caplog.at_level(logging.WARNING):
            transport.send(iter_buckets(_weights(2), 1 << 20), 2, SyncStats(2))  # the sync skips the dead one
            DiskTransport(pool, str(tmp_path / "disk")).send(iter_buckets(_weights(3), 1 << 20), 3, SyncStats(3))
        assert _versions([a.url]) == ["3"] and pool.live == [a.url]

        b.start()  # back at the same URL with its initial weights: not served from until it has ours
        _wait_for(lambda: b.url in pool.router.stale)
        assert pool.live == [a.url] and _versions([b.url]) != ["3"]
        assert all(g.output_ids for g in pool.generate(_requests(8)))
        transport.send(iter_buckets(_weights(4), 1 << 20), 4, SyncStats(4))
        assert _versions([a.url, b.url]) == ["4", "4"] and pool.live == [a.url, b.url]
        assert "is back with other weights" in caplog.text
        transport.close()
    finally:
        pool.close()


def test_a_sync_that_fails_halfway_leaves_no_engine_serving(engines, tmp_path, caplog):
    """Fault 7d: a weight sync that breaks off (the trainer's bucket stream raises, an engine is
    killed mid-sync) leaves no engine generating from a mix of two versions; the next sync that
    reaches an engine, checked against the trainer's checksum, lets it serve again."""
    a, b = engines
    pool = HTTPEnginePool([a.url, b.url], timeout=10, health_interval=0.3)

    def sync(transport, seed: int, version: int, fail_after: int | None = None, then=None) -> SyncStats:
        stats = SyncStats(version, checksum=WeightChecksum())

        def buckets():
            for i, bucket in enumerate(iter_buckets(_weights(seed), 1 << 16, stats.checksum)):
                if i == fail_after:
                    raise RuntimeError("the trainer failed mid-sync")
                yield bucket
                if i == 0 and then is not None:
                    then()

        transport.send(buckets(), version, stats)
        return stats

    try:
        tensors = TensorTransport(pool, shm_dir=str(tmp_path))
        distributed = DistributedTransport(pool, group_name="halfway", load_format="flattened_bucket")
        assert sync(tensors, 1, 1).mismatched == {} and pool.live == [a.url, b.url]
        checksum_1 = _info(a.url, "weights_checksum")["checksum"]

        for transport in (tensors, distributed):
            with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="failed mid-sync"):
                sync(transport, 2, 2, fail_after=2)  # two buckets of version 2 loaded, then nothing
            for e in (a, b):
                assert _info(e.url)["internal_states"][0]["paused"]  # holds requests, generates nothing
                mixed = _info(e.url, "weights_checksum")
                assert mixed["weight_version"] == "1" and mixed["checksum"] != checksum_1  # a mix, under version 1
            assert pool.live == [] and pool.router.stale == {a.url, b.url}
            asyncio.run_coroutine_threadsafe(pool.router.check_health(), pool._loop).result()
            assert pool.live == []  # version 1 is what the pool expects, but a failed sync is not taken back
            with pytest.raises(NoHealthyEngine):
                pool.generate(_requests(1))
        assert "stays paused and out of routing" in caplog.text

        stats = sync(distributed, 3, 3)  # a whole sync: both serve again, checked
        assert stats.mismatched == {} and pool.live == [a.url, b.url] and _versions([a.url, b.url]) == ["3", "3"]
        assert _info(b.url, "weights_checksum")["checksum"] == stats.checksum.hexdigest()
        assert not _info(a.url)["internal_states"][0]["paused"]
        assert all(g.output_ids for g in pool.generate(_requests(4)))

        # an engine killed mid-sync: the other gets everything and serves; the killed one, back at
        # its URL, waits for the next sync
        stats = sync(tensors, 4, 4, then=lambda: b.signal(signal.SIGKILL))
        assert stats.mismatched == {} and pool.live == [a.url] and _versions([a.url]) == ["4"]
        assert all(g.output_ids for g in pool.generate(_requests(4)))
        b.start()
        _wait_for(lambda: b.url in pool.router.stale)
        assert sync(tensors, 5, 5).mismatched == {} and pool.live == [a.url, b.url]
        tensors.close()
        distributed.close()
    finally:
        pool.close()


def test_a_frozen_engine_costs_one_timeout_and_is_logged(engines, tmp_path, caplog):
    a, b = engines
    pool = HTTPEnginePool([a.url, b.url], timeout=3, health_interval=0.5, log_wait_s=1.0)
    try:
        transport = TensorTransport(pool, shm_dir=str(tmp_path))
        transport.send(iter_buckets(_weights(1), 1 << 20), 1, SyncStats(1))
        b.signal(signal.SIGSTOP)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING):
            transport.send(iter_buckets(_weights(2), 1 << 20), 2, SyncStats(2))
        took = time.monotonic() - start
        assert took < 3 * 2 + 5, f"the sync waited {took:.0f} s for a frozen engine"  # (1 retry) x timeout
        assert "for /pause_generation from " + b.url in caplog.text  # what it waited for, while it waited
        assert "unreachable during /pause_generation" in caplog.text
        assert pool.live == [a.url] and _versions([a.url]) == ["2"]

        b.signal(signal.SIGCONT)  # thawed: its weights are old, so it waits for the next sync
        _wait_for(lambda: b.url in pool.router.stale)
        transport.send(iter_buckets(_weights(3), 1 << 20), 3, SyncStats(3))
        assert _versions([a.url, b.url]) == ["3", "3"] and pool.live == [a.url, b.url]
        transport.close()
    finally:
        pool.close()


def test_a_frozen_engine_costs_a_control_timeout_not_a_generation_timeout(engines, tmp_path):
    """Pause, continue, health and weight updates have timeouts of their own, seconds by default,
    and a call that timed out is not repeated: a SIGSTOPped engine costs the next sync one control
    timeout, although a generation request may take 600 s."""
    from mcore_rl.config.rl_schema import RolloutConfig
    from mcore_rl.rollout.pool import engine_timeouts

    assert engine_timeouts(RolloutConfig()) == {
        "control_timeout": 30.0,
        "weight_update_timeout": 120.0,
        "no_engine_timeout_s": 120.0,
    }
    a, b = engines
    pool = HTTPEnginePool([a.url, b.url], timeout=600, control_timeout=2, weight_update_timeout=4, health_interval=3600)
    try:
        transport = TensorTransport(pool, shm_dir=str(tmp_path))
        transport.send(iter_buckets(_weights(1), 1 << 20), 1, SyncStats(1))
        b.signal(signal.SIGSTOP)
        start = time.monotonic()
        transport.send(iter_buckets(_weights(2), 1 << 20), 2, SyncStats(2))
        took = time.monotonic() - start
        assert took < 2 + 8, f"the sync waited {took:.0f} s for a frozen engine"  # one control timeout
        assert pool.live == [a.url] and _versions([a.url]) == ["2"]
        start = time.monotonic()
        assert asyncio.run_coroutine_threadsafe(pool.router.check_health(), pool.loop).result() == {
            a.url: True,
            b.url: False,
        }
        assert time.monotonic() - start < 2 + 3  # the health check gives up as soon
        transport.close()
    finally:
        b.signal(signal.SIGCONT)
        pool.close()


def test_a_stream_whose_engine_dies_fails_over_and_finishes():
    slow, other = Engine(delay=0.02), Engine()
    try:

        async def go() -> tuple[list[dict], str]:
            router = EngineRouter([slow.url, other.url], timeout=10, health_interval=60)
            router.outstanding[other.url] = 1  # the first pick is the slow engine
            body = {
                "input_ids": list(b"12+34="),
                "rid": "s1",
                "sampling_params": {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True},
            }
            events = []
            try:
                async for event in router.generate_stream(body):
                    events.append(event)
                    if len(events) == 3:
                        slow.signal(signal.SIGKILL)
            finally:
                router.outstanding[other.url] = 0
                await router.close()
            return events, ""

        events, _ = asyncio.run(go())
        final = events[-1]
        assert final["meta_info"]["finish_reason"]["type"] == "length"
        assert len(final["output_ids"]) == 64
    finally:
        slow.close()
        other.close()


def test_a_stream_that_breaks_off_raises_the_projects_error():
    slow = Engine(delay=0.02)
    try:

        async def go() -> None:
            async with EngineClient(slow.url, retries=0, timeout=10) as c:
                n = 0
                async for _ in c.generate_stream(
                    input_ids=list(b"1+1="), rid="x", sampling_params={"max_new_tokens": 200, "ignore_eos": True}
                ):
                    n += 1
                    if n == 2:
                        slow.signal(signal.SIGKILL)

        with pytest.raises(EngineUnavailable, match="stream broke off"):
            asyncio.run(go())
    finally:
        slow.close()


def _rl_run_losing_an_engine(rank: int, world_size: int, tmp: str, urls: list[str], victim_pid: int) -> None:
    import json
    import threading

    from mcore_rl.config.schema import ModelConfig
    from mcore_rl.runtime import run_rl
    from tests.helpers import tiny

    cfg = tiny(
        f"run_dir={tmp}",
        f"rollout.engine_urls=[{','.join(urls)}]",
        "rollout.quantization=none",
        "rollout.request_timeout_s=10",
        "train.num_steps=4",
        "eval.interval=0",
        "eval.at_start=false",
        "logging.tensorboard=false",
        "logging.plot=false",
    )
    cfg.model = ModelConfig()  # the engines serve the default (demo-shaped) model
    metrics = os.path.join(tmp, "metrics.jsonl")

    def kill_after_step_two() -> None:
        while True:
            if os.path.exists(metrics) and any(json.loads(line).get("rl_step") == 2 for line in open(metrics)):
                os.kill(victim_pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    threading.Thread(target=kill_after_step_two, daemon=True).start()
    summary = run_rl(cfg)
    assert summary["state"]["rl_step"] == 4
    records = [json.loads(line) for line in open(metrics)]
    assert [r["rl_step"] for r in records] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert all(r["rollout/weight_version"] == r["rl_step"] + 1 for r in records if "rollout/weight_version" in r)


@pytest.mark.slow
def test_the_rl_loop_survives_an_engine_killed_mid_run(engines, tmp_path):
    """Issue scenario: two engines, one SIGKILLed after step 2; the run finishes on the other."""
    from tests.world import run_world

    a, b = engines
    run_world(1, _rl_run_losing_an_engine, str(tmp_path), [a.url, b.url], b.proc.pid)
    assert not b.proc.is_alive() and _versions([a.url]) == ["5"]


def test_the_pool_sends_the_api_keys(tmp_path):
    """A server with --api-key and --admin-api-key: the pool generates with the one and syncs
    weights with the other; without keys it is refused (401) and says so."""
    from mcore_rl.rollout.client import EngineHTTPError
    from mcore_rl.rollout.engine.core import EngineCore
    from mcore_rl.rollout.engine.driver import EngineDriver
    from mcore_rl.rollout.launch_flags import parse_server_args
    from mcore_rl.rollout.server import EngineServer, ServerThread

    args = parse_server_args(["--api-key", "user-key", "--admin-api-key", "admin-key"])
    core = EngineCore.from_model_path(None, context_length=CONTEXT, random_seed=0)
    srv = ServerThread(EngineServer(EngineDriver(core), args), shutdown_timeout=0.5)
    srv.start()
    pool = HTTPEnginePool([srv.url], timeout=10, api_key="user-key", admin_api_key="admin-key")
    anonymous = HTTPEnginePool([srv.url], timeout=10)
    try:
        assert all(g.output_ids for g in pool.generate(_requests(2)))
        TensorTransport(pool, shm_dir=str(tmp_path)).send(iter_buckets(_weights(5), 1 << 20), 7, SyncStats(7))
        assert str(core.weight_version) == "7"
        with pytest.raises(EngineHTTPError, match="401"):
            anonymous.generate(_requests(1))
        with pytest.raises(EngineHTTPError, match="401"):
            TensorTransport(anonymous, shm_dir=str(tmp_path)).send(iter_buckets(_weights(6), 1 << 20), 8, SyncStats(8))
        assert str(core.weight_version) == "7"
    finally:
        pool.close()
        anonymous.close()
        srv.stop()
