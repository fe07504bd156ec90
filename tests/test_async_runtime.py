"""The asynchronous runtime end to end: real engine processes on loopback, real kills.

- `max_staleness: 0` gives the synchronous loop's samples and losses (same engine, same seed);
- `max_staleness: 1` overlaps generation with training, continues requests across weight syncs
  (partial rollouts: per-token versions), and keeps every sample within the bound;
- an engine SIGKILLed mid-run costs only its in-flight requests (re-sent to the other engine);
- with every engine dead the run stops with a clear error instead of hanging;
- every run writes `accounting.json`, whose identity drawn = trained + filtered + dropped +
  failed + pending holds, also across a SIGKILLed learner resumed from its checkpoint
  (tests/test_async_resume.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from tests.helpers import Engine
from tests.world import run_world
from tests.helpers import SMALL


def small(*overrides: str):
    from mcore_rl.config import RLConfig, load_config

    return load_config(RLConfig, None, SMALL + list(overrides))


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _accounting(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "accounting.json")) as f:
        return json.load(f)


def _same_numbers(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        for key in ("reward/mean", "response/length_mean", "rollout/policy_version_min", "rollout/policy_version_max"):
            assert x[key] == y[key], key  # the same samples
        for key in ("train/loss", "mismatch/k3", "train/grad_norm"):
            if key in x:  # the engine's batching changes μ in the last bits: not bit-identical
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-7), key


def _runs(rank: int, world_size: int, tmp: str, urls: list[str], victim_pid: int) -> None:
    from mcore_rl.runtime import run_rl

    one = f"rollout.engine_urls=[{urls[0]}]"
    # 1. staleness 0 is the synchronous loop
    run_rl(small(f"run_dir={tmp}/sync", one))
    run_rl(small(f"run_dir={tmp}/async0", one, "rollout.runtime=async"))
    sync, async0 = _records(f"{tmp}/sync"), _records(f"{tmp}/async0")
    _same_numbers(sync, async0)
    assert all(r["async/staleness_max"] == 0 for r in async0 if "async/staleness_max" in r)
    for name in ("sync", "async0"):
        acc = _accounting(f"{tmp}/{name}")
        assert acc["balanced"] and acc["trained"] == 3 * 4 and acc["failed"] == 0
    assert _accounting(f"{tmp}/async0")["pending"] == 0  # s = 0: nothing is generated ahead

    # 2. staleness 1 over two (slow) engines, one SIGKILLed after step 2: the run finishes, the
    #    killed engine's requests went to the other, nothing is lost, the bound holds
    both = f"rollout.engine_urls=[{','.join(urls)}]"
    cfg = small(
        f"run_dir={tmp}/async1",
        both,
        "rollout.runtime=async",
        "rollout.max_staleness=1",
        "train.num_steps=5",
        "rollout.max_new_tokens=24",
    )
    metrics = f"{tmp}/async1/metrics.jsonl"

    def kill_after_step_two() -> None:
        while True:
            if os.path.exists(metrics) and any(json.loads(x).get("rl_step") == 2 for x in open(metrics)):
                os.kill(victim_pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    threading.Thread(target=kill_after_step_two, daemon=True).start()
    summary = run_rl(cfg)
    recs = _records(f"{tmp}/async1")
    assert summary["state"]["rl_step"] == 5
    steps = [r for r in recs if "async/staleness_max" in r]
    assert max(r["async/staleness_max"] for r in steps) == 1  # generated ahead, within the bound
    assert all(r["rl_step"] - r["rollout/policy_version_min"] <= 1 for r in steps)  # step k trains version k
    acc = summary["accounting"]
    assert acc == _accounting(f"{tmp}/async1")
    assert acc["balanced"] and acc["failed"] == 0 and acc["trained"] == 5 * 4
    assert acc["drawn"] == acc["trained"] + acc["dropped_stale"] + acc["filtered"] + acc["pending"]
    # the slow engines were mid-generation at the syncs: requests continued across them
    assert acc["continued_requests"] > 0
    assert sum(r.get("async/partial_samples", 0) for r in steps) + acc["dropped_stale"] > 0


@pytest.mark.slow
def test_async_runtime_matches_sync_overlaps_and_survives_a_killed_engine(tmp_path):
    a, b = Engine(delay=0.01), Engine(delay=0.01)
    try:
        run_world(1, _runs, str(tmp_path), [a.url, b.url], b.proc.pid)
        assert not b.proc.is_alive()
    finally:
        a.close()
        b.close()


def _mipu_runs(rank: int, world_size: int, tmp: str, url: str) -> None:
    from mcore_rl.runtime import run_rl

    mipu = [
        f"rollout.engine_urls=[{url}]",
        "algorithm.mismatch.name=mipu",
        "algorithm.mismatch.mipu_validation_prompts=2",
        "algorithm.mismatch.mipu_bootstrap=0",
    ]
    run_rl(small(f"run_dir={tmp}/sync", *mipu))
    run_rl(small(f"run_dir={tmp}/async0", *mipu, "rollout.runtime=async"))
    sync, async0 = _records(f"{tmp}/sync"), _records(f"{tmp}/async0")
    _same_numbers(sync, async0)  # the same samples: no training group came from a candidate before its decision
    for recs in (sync, async0):
        decided = [r for r in recs if "mipu/accepted" in r]
        assert [r["rl_step"] for r in decided] == [1, 2, 3]  # one decision per step, after the sync
        assert all(r["rollout/policy_version_min"] == r["rollout/policy_version_max"] for r in decided)
    assert all(r["async/staleness_max"] == 0 for r in async0 if "async/staleness_max" in r)
    first_sync = next(r for r in sync if "mipu/accepted" in r)
    first_async = next(r for r in async0 if "mipu/accepted" in r)
    # the same validation prompts and seeds from the same candidate: the same validation batch
    assert first_sync["mipu/validation_reward"] == first_async["mipu/validation_reward"]
    assert first_sync["mipu/t_post"] == pytest.approx(first_async["mipu/t_post"], rel=1e-3, abs=1e-6)


@pytest.mark.slow
def test_mipu_accepts_or_rolls_back_in_both_schedules(tmp_path):
    """MIPU's accept/rollback, once sync-only, in the asynchronous runtime at max_staleness 0."""
    engine = Engine()
    try:
        run_world(1, _mipu_runs, str(tmp_path), engine.url)
    finally:
        engine.close()


def _all_dead(rank: int, world_size: int, tmp: str, urls: list[str], pids: list[int]) -> None:
    from mcore_rl.runtime import run_rl

    cfg = small(
        f"run_dir={tmp}/dead",
        f"rollout.engine_urls=[{','.join(urls)}]",
        "rollout.runtime=async",
        "rollout.max_staleness=1",
        "train.num_steps=50",
        "rollout.no_engine_timeout_s=3",
        "rollout.request_timeout_s=5",
    )
    metrics = f"{tmp}/dead/metrics.jsonl"

    def kill_all_after_step_one() -> None:
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_all_after_step_one, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(Exception, match="no engine|no inference engine") as err:
        run_rl(cfg)
    assert time.monotonic() - start < 120, "took too long to give up"
    print("error:", err.value)
    acc = _accounting(f"{tmp}/dead")  # written although the run failed
    assert acc["balanced"]


def test_with_every_engine_dead_the_run_stops_with_a_clear_error(tmp_path):
    a, b = Engine(), Engine()
    try:
        run_world(1, _all_dead, str(tmp_path), [a.url, b.url], [a.proc.pid, b.proc.pid])
    finally:
        a.close()
        b.close()


def _engine_pids(run_dir: str) -> list[int]:
    """`mcore-rl serve` processes serving this run's model directory."""
    import subprocess

    out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "serve" in line and f"{run_dir}/engines/" in line]


def _wait_for_pids(run_dir: str, n: int, timeout: float = 120) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        pids = _engine_pids(run_dir)
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    return []


def _started(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime import run_rl

    # no engine URL: the trainer starts its engine processes; colocated: they sleep while it trains
    cfg = small(
        f"run_dir={tmp}/colo",
        "rollout.runtime=async",
        "rollout.placement=colocated",
        "rollout.max_staleness=1",
        "rollout.quantization=fp8",
    )
    seen: dict[str, list[int]] = {}
    threading.Thread(target=lambda: seen.setdefault("during", _wait_for_pids(f"{tmp}/colo", 1)), daemon=True).start()
    summary = run_rl(cfg)
    assert len(seen["during"]) == 1  # (the check of the ps pattern: it finds the running engine)
    recs = [r for r in _records(f"{tmp}/colo") if "time/step_s" in r]
    assert len(recs) == 3 and all(r["time/engine_release_resume_s"] > 0 for r in recs)
    acc = summary["accounting"]
    assert acc["balanced"] and acc["trained"] == 12 and acc["failed"] == 0
    assert recs[-1]["mismatch/k3"] > 0  # the started engine runs FP8
    assert os.path.exists(f"{tmp}/colo/engines/engine_0.log")
    assert not _engine_pids(f"{tmp}/colo")  # stopped with the run

    # two started engines, one SIGKILLed after step 2: the trainer starts it again at its URL (it
    # serves again after the next sync), the run finishes, nothing is lost
    cfg = small(
        f"run_dir={tmp}/restart",
        "rollout.runtime=async",
        "rollout.max_staleness=1",
        "rollout.num_embedded_engines=2",
        "rollout.health_check_interval_s=0.5",
        "train.num_steps=12",
    )
    metrics = f"{tmp}/restart/metrics.jsonl"
    seen = {}

    def kill_one_after_step_two() -> None:
        while not (os.path.exists(metrics) and any(json.loads(x).get("rl_step") == 2 for x in open(metrics))):
            time.sleep(0.05)
        victim = min(_engine_pids(f"{tmp}/restart"))
        seen["before"] = _engine_pids(f"{tmp}/restart")
        os.kill(victim, signal.SIGKILL)
        seen["victim"] = [victim]
        end = time.monotonic() + 60
        while time.monotonic() < end:
            pids = _engine_pids(f"{tmp}/restart")
            if len(pids) == 2 and victim not in pids:
                seen["after"] = pids
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=kill_one_after_step_two, daemon=True)
    watcher.start()
    summary = run_rl(cfg)
    watcher.join(60)
    assert summary["state"]["rl_step"] == 12
    assert len(seen["before"]) == 2 and "after" in seen, seen  # restarted: a new process in its place
    acc = summary["accounting"]
    assert acc["balanced"] and acc["failed"] == 0 and acc["trained"] == 12 * 4
    assert not _engine_pids(f"{tmp}/restart")

    # an MoE with both replays through the started engines: they return routed experts and sampling
    # masks over HTTP, the learner replays them (a sample without its routing would fail the batch)
    cfg = small(
        f"run_dir={tmp}/replay",
        "rollout.runtime=async",
        "rollout.max_staleness=1",
        "train.num_steps=2",
        "model.arch=qwen3_moe",
        "model.num_experts=4",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=32",
        "rollout.quantization=fp8",
        "rollout.top_p=0.9",
        "algorithm.routing_replay=r3",
        "rollout.sampling_mask_replay=true",
    )
    summary = run_rl(cfg)
    recs = [r for r in _records(f"{tmp}/replay") if "rollout/sampling_mask_size_mean" in r]
    assert len(recs) >= 2 and all(r["rollout/sampling_mask_size_mean"] >= 1 for r in recs)
    assert all(r["mismatch/k3"] > 0 for r in recs if "mismatch/k3" in r)  # FP8 engines
    acc = summary["accounting"]
    assert acc["balanced"] and acc["failed"] == 0 and acc["trained"] == 2 * 4
    assert not _engine_pids(f"{tmp}/replay")


def test_started_colocated_engines_sleep_while_the_learner_trains_and_stop_with_the_run(tmp_path):
    run_world(1, _started, str(tmp_path))


def _engine_ports(run_dir: str) -> dict[int, int]:
    """pid -> port of the `mcore-rl serve` processes serving this run's model directory."""
    import subprocess

    out = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        if "serve" in line and f"{run_dir}/engines/" in line:
            args = line.split()
            found[int(args[0])] = int(args[args.index("--port") + 1])
    return found


def _get(port: int, path: str) -> bytes | None:
    """The body of a 200 answer, else None."""
    import urllib.request

    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            f"http://127.0.0.1:{port}{path}", timeout=2
        ) as r:
            return r.read()
    except OSError:
        return None


def _two_deaths(rank: int, world_size: int, tmp: str) -> None:
    from mcore_rl.runtime import run_rl
    from mcore_rl.runtime.accounting import check_provenance

    run_dir = f"{tmp}/two"
    cfg = small(
        f"run_dir={run_dir}",
        "rollout.runtime=async",
        "rollout.max_staleness=1",
        "rollout.num_embedded_engines=2",
        "rollout.health_check_interval_s=0.5",
        "train.num_steps=8",
        "rollout.no_engine_timeout_s=400",
        "rollout.engine_startup_timeout_s=400",
    )
    metrics = f"{run_dir}/metrics.jsonl"
    seen: dict = {}

    def kill_two() -> None:
        while not (os.path.exists(metrics) and any(json.loads(x).get("rl_step") == 2 for x in open(metrics))):
            time.sleep(0.05)
        engines = _engine_ports(run_dir)
        (first, first_port), (second, second_port) = sorted(engines.items())
        os.kill(first, signal.SIGKILL)
        seen["first"] = first
        end = time.monotonic() + 120
        while time.monotonic() < end:  # the second, at the next weight sync (it pauses for it)
            state = _get(second_port, "/get_server_info")
            if state is not None and json.loads(state)["internal_states"][0]["paused"]:
                break
            time.sleep(0.01)
        seen["paused"] = time.monotonic() < end
        seen["first_back"] = _get(first_port, "/health") is not None
        os.kill(second, signal.SIGKILL)
        seen["second"] = second

    killer = threading.Thread(target=kill_two, daemon=True)
    killer.start()
    summary = run_rl(cfg)
    killer.join(60)
    assert summary["state"]["rl_step"] == 8
    assert seen["paused"] and not seen["first_back"], seen  # killed in a sync, while the first restarted
    after = _engine_pids(run_dir)
    assert not after  # stopped with the run
    acc = summary["accounting"]
    assert acc["balanced"] and acc["failed"] == 0 and acc["trained"] == 8 * 4, acc
    check = check_provenance(run_dir)
    assert check.ok and check.trained == 8 * 4, check
    print("seen:", seen)


@pytest.mark.slow
def test_two_engine_deaths_close_together_do_not_end_the_run(tmp_path):
    """One started engine SIGKILLed after step 2, the other SIGKILLed during the next weight sync,
    while the first is still restarting: both restart at once, the sync waits for one and is sent
    again, and the run finishes with every prompt accounted for (accounting.json and
    provenance.jsonl)."""
    run_world(1, _two_deaths, str(tmp_path))
